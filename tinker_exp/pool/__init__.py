"""Warm workers: a long-lived process holding a Ray cluster and a verl worker group that runs reuse.

`python -m tinker_exp.pool up|status|down`. Each run starts from exactly the state a cold start leaves
(docs/pool.md)."""
