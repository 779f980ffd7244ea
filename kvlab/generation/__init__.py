"""Generation over a KVCache without the engine: the one decode loop and `generate` / `stream_generate`."""
