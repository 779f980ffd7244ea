"""The model shape the benches time: SmolLM2-135M's (config.json of HuggingFaceTB/SmolLM2-135M-Instruct),
the model of FIELD-NOTES' peer measurements, so a bench's figures line up with llama.cpp's on the real file."""

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0,
                    eos_token_id=0)


def models_in_formats(formats: list[str], seed: int = 0) -> dict:
    """One random float32 model of SMOLLM2_135M's shape in each weight format, by name: "float32",
    "bfloat16" (rounded, kept half), or a GGUF block type kept as stored ("q8_0", "q4_0", ...: llama.cpp's
    encoder), optionally "+q8" for the products' inputs rounded to int8 (`activations="q8"`: "q8_0+q8").
    All share the same weights, so their differences are the format's alone."""
    import numpy as np

    from kvlab import LlamaModel
    from kvlab.config import ModelConfig
    from kvlab.model.quantized import quantize_weights
    from kvlab.model.weights import random_weights

    config = ModelConfig(**SMOLLM2_135M)
    weights = random_weights(config, seed, np.float32)
    models = {}
    for name in formats:
        if name in ("float32", "bfloat16"):
            models[name] = LlamaModel(config, weights, dtype=np.float32,
                                      weights_dtype=None if name == "float32" else "bfloat16")
        else:
            kind, _, activations = name.partition("+")
            models[name] = LlamaModel(config, quantize_weights(weights, kind), dtype=np.float32,
                                      activations=activations or None)
    return models
