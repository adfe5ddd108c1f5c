"""RL environments, pure Python (no torch): prompt rows, rewards (yours, or the shipped envs'), group advantages.

The sampler and the RL workers live in tinker_exp/runtime; the config nodes in tinker_exp/config/rl.py.
"""
