"""The vLLM emulator: the simulator's engine in real time behind an OpenAI-compatible server.

It streams tokens at the simulated step times, honours `priority`, aborts on disconnect and
exports vLLM's metric names, so the proxy, the daemon and Prometheus run for real without
a GPU.
"""
