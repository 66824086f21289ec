"""The engine simulator: vLLM-V1-like replicas, a routed fleet, trace workloads, metrics.

It is the plant every controller, test and benchmark runs against (see DESIGN.md, "The plant
for tests"): `engine` is one replica, `fleet` a routed set of them, `simulation` the run loop.
"""
