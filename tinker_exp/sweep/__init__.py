"""Sweeps: job identity (job.json), W&B group and run names, Slurm's view of a job, and the sweep summary.

Pure Python; the Hydra launchers in hydra_plugins/tinker_exp_plugins build on it.
"""
