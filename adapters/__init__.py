"""Adapters that store and enforce budgets: the Redis budget store, the admission gate, the
OpenAI-compatible proxy, the vLLM scheduler plugin and the engine emulator's HTTP front."""
