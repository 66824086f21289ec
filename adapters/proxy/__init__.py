"""The borrowd proxy: an OpenAI-compatible streaming proxy in front of vLLM.

It maps API keys to tenants and classes, injects vLLM's `priority`, admits batch work
through the gate, revokes batch streams resumably, and measures per-class TTFT and ITL.
"""
