"""Batch jobs, the batch owners' side: pure models of input validation, resumption,
ordering (EDF, weighted fair share), lateness and cost. No I/O; `adapters/batch` runs them.
"""
