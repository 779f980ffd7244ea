"""The model shape the benches time: SmolLM2-135M's (config.json of HuggingFaceTB/SmolLM2-135M-Instruct),
the model of FIELD-NOTES' peer measurements, so a bench's figures line up with llama.cpp's on the real file."""

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0,
                    eos_token_id=0)
