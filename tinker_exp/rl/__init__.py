"""RL environments: prompt rows, rewards, advantages. Pure Python (no torch)."""
