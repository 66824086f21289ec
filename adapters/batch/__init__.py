"""Batch jobs on borrowed capacity: the OpenAI Files + Batches API (`borrowd batch serve`),
the workers that run items through the proxy (`borrowd batch worker`), state in Redis."""
