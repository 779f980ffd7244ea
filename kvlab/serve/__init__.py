"""kvlab's OpenAI-compatible server: `kvlab serve`, or `create_app(engine, tokenizer, ...)` in code.

Needs the `serve` extra (fastapi, uvicorn, prometheus_client); nothing else in kvlab imports this package.
"""
