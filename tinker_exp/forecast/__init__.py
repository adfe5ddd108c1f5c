"""Forecast a schedule before running it, from loss-curve laws fitted to finished runs.

Fit a loss-curve law (the multi-power law of Luo et al. 2025, or the momentum law of Tissue et al. 2024) to finished
runs' `applied/lr` and loss, check it on runs it did not see, rank candidate plans with intervals from refits, and
propose the best schedule of a family as an override file.

    python -m tinker_exp.forecast fit RUN... [--law mpl|momentum] [--metric train/loss|val/loss] [--out DIR] [--overwrite] [--from-step N]
    python -m tinker_exp.forecast check LAW RUN...
    python -m tinker_exp.forecast rank LAW PLAN...
    python -m tinker_exp.forecast propose LAW --steps N [--family wsd|cosine|linear] [--force]
    python -m tinker_exp.forecast corpus OUT [--rows N]   # a generated corpus of distinct rows, for runs to fit

numpy, scipy and matplotlib; no torch, verl or ray (docs/forecast.md).
"""
