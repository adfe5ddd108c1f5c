"""Training: the loop, its sinks (metrics.jsonl, W&B, progress), checkpoints, data and signal handling.

Talks to the workers through the ``Workers`` protocol only: no torch, verl or ray here (wandb when enabled).
"""
