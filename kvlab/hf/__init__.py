"""Hugging Face model folders: safetensors without pickle, config/tokenizer/chat-template files, `load`."""

from kvlab.hf.loader import DEFAULT_MODEL_DIR, load, load_model, load_tokenizer

__all__ = ["DEFAULT_MODEL_DIR", "load", "load_model", "load_tokenizer"]
