"""GGUF files (llama.cpp's format): config from metadata, dequantized tensors, tokenizer, `load_gguf`."""

from kvlab.gguf.loader import GGUFCheckpoint, gguf_file, load_gguf, read_checkpoint

__all__ = ["GGUFCheckpoint", "gguf_file", "load_gguf", "read_checkpoint"]
