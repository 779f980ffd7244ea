"""KV cache events in vLLM's wire format (ZMQ PUB + msgpack), so routers built for vLLM route to kvlab.

config.py parses `--kv-events-config` (vLLM's flag and field names); messages.py builds the event maps;
publisher.py owns the ZMQ socket on its own thread.
"""
