"""Two published loss-curve laws over learning-rate schedules, as functions of the lr sent at every step.

The lr is divided by the fitted runs' peak (`Law.lr_scale`) before it enters a law: sums of lr are then in
"steps at the peak", and the parameters are of order one whatever the optimizer's lr (the fit is conditioned
better; the published parameters are in raw-lr units and not comparable one to one).

A curve's loss after n updates depends on eta[0..n-1] (eta[i]: the lr of update i). `updates` says how many
updates a logged loss has seen: train/loss at step t is computed before step t's update (t updates), val/loss
after it (t + 1).

- Multi-power law (Luo et al., ICLR 2025): L(n) = L0 + A (S1(n) + S_W)^-alpha - LD(n), S1(n) = sum_{i<n} eta_i
  (warmup included: the authors' code takes the cumsum of the whole lr array, so S_W is in S1),
  LD(n) = B sum_{k} (eta_{k-1} - eta_k) G(eta_k^-gamma S_k(n)), S_k(n) = sum_{i=k..n-1} eta_i,
  G(x) = 1 - (C x + 1)^-beta, over the steps k after the warmup (the first step at the peak) where the lr drops
  or rises; only steps where the lr changes contribute.
- Momentum law (Tissue et al. 2024): L(n) = L0 + A S1^-alpha - C S2, S2 = sum_{i<n} m_i,
  m_i = lambda m_{i-1} + (eta_{i-1} - eta_i), lambda = 0.999; warmup steps count at the peak lr (the authors'
  script), so a warmup neither adds to S2 nor shortens S1.

numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

MOMENTUM_DECAY = 0.999  # lambda of the momentum law, as published


def warmup_end(lr: np.ndarray) -> int:
    """The first update at the run's peak lr: the warmup is the updates before it (0 without warmup)."""
    return int(np.argmax(lr >= lr.max() * (1 - 1e-12)))


@dataclass(frozen=True)
class Features:
    """What a law needs of one schedule at the update counts it is evaluated at (precomputed once per fit: a
    fit evaluates the law thousands of times on the same schedules)."""

    updates: np.ndarray  # n at each evaluated point (>= 1)
    s1: np.ndarray  # S1(n), warmup as run (multi-power law)
    s1_peak_warmup: np.ndarray  # S1(n) with the warmup counted at the peak (momentum law)
    s2: np.ndarray  # S2(n) of the momentum law
    drops: np.ndarray  # eta_{k-1} - eta_k at each change point k after the warmup
    drop_lr: np.ndarray  # eta_k at each change point
    sums_after: np.ndarray  # S_k(n): [point, change point], 0 where k >= n (masked by `active`)
    active: np.ndarray  # k < n: the change point has happened before the n-th update's loss


def features(lr: np.ndarray, updates: np.ndarray) -> Features:
    """The sums both laws use, of a normalised lr array (one value per update), at update counts `updates`."""
    lr = np.asarray(lr, dtype=np.float64)
    updates = np.asarray(updates, dtype=np.int64)
    if updates.size and (updates.min() < 1 or updates.max() > len(lr)):
        raise ValueError(f"update counts must be in 1..{len(lr)}")
    cumsum = np.concatenate([[0.0], np.cumsum(lr)])  # cumsum[n] = sum_{i<n} eta_i
    warm = warmup_end(lr)
    peak_warm = lr.copy()
    peak_warm[:warm] = lr.max()
    cumsum_peak = np.concatenate([[0.0], np.cumsum(peak_warm)])
    # Momentum of the lr's decrease (the momentum law), over the warmup-at-peak array.
    momentum = np.zeros(len(lr))
    previous = peak_warm[0]
    m = 0.0
    for i, eta in enumerate(peak_warm):
        m = MOMENTUM_DECAY * m + (previous - eta)
        momentum[i] = m
        previous = eta
    s2 = np.concatenate([[0.0], np.cumsum(momentum)])
    steps = np.arange(1, len(lr))
    changed = steps[(steps > warm) & (np.abs(np.diff(lr)) > 0)]
    sums_after = cumsum[updates][:, None] - cumsum[changed][None, :]
    active = changed[None, :] < updates[:, None]
    return Features(
        updates=updates,
        s1=cumsum[updates],
        s1_peak_warmup=cumsum_peak[updates],
        s2=s2[updates],
        drops=lr[changed - 1] - lr[changed],
        drop_lr=lr[changed],
        sums_after=np.where(active, sums_after, 0.0),
        active=active,
    )


def multi_power(p: np.ndarray, f: Features) -> np.ndarray:
    l0, a, alpha, b, c, beta, gamma = p
    # eta_k^-gamma at an lr of exactly 0 (a decay to zero) is infinite: G is then 1, the drop counts whole.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        x = np.where(f.active, np.power(np.maximum(f.drop_lr, 1e-300), -gamma)[None, :] * f.sums_after, 0.0)
        g = 1.0 - np.power(c * x + 1.0, -beta)
    g = np.where(np.isfinite(g), g, 1.0)
    loss_drop = b * np.sum(np.where(f.active, f.drops[None, :] * g, 0.0), axis=1)
    return l0 + a * np.power(f.s1, -alpha) - loss_drop


def momentum(p: np.ndarray, f: Features) -> np.ndarray:
    l0, a, alpha, c = p
    return l0 + a * np.power(f.s1_peak_warmup, -alpha) - c * f.s2


@dataclass(frozen=True)
class LawKind:
    """A law's formula, its parameter names, where its fit may look, and generic starting points."""

    name: str
    params: tuple[str, ...]
    predict: Callable[[np.ndarray, Features], np.ndarray]
    lower: tuple[float, ...]
    upper: tuple[float, ...]

    def starts(self, losses: np.ndarray) -> list[np.ndarray]:
        """A few generic starting points scaled to the measured losses (the lowest one sets L0's guess)."""
        low, span = float(np.min(losses)), float(np.ptp(losses)) or 0.1
        if self.name == "momentum":
            return [np.array([0.8 * low, span, 0.5, 0.01 * span]), np.array([0.5 * low, 2 * span, 0.3, 0.001 * span])]
        return [np.array([0.8 * low, span, 0.5, span, c, 0.5, 0.5]) for c in (0.1, 1.0, 0.01)] + [
            np.array([0.5 * low, 2 * span, 0.3, 0.5 * span, 0.1, 1.0, 0.2])
        ]


LAWS = {
    "mpl": LawKind(
        "mpl", ("L0", "A", "alpha", "B", "C", "beta", "gamma"), multi_power,
        lower=(0.0, 0.0, 1e-3, 0.0, 1e-6, 1e-3, 0.0), upper=(np.inf, np.inf, 5.0, np.inf, 1e4, 20.0, 2.0),
    ),  # fmt: skip
    "momentum": LawKind(
        "momentum", ("L0", "A", "alpha", "C"), momentum, lower=(0.0, 0.0, 1e-3, 0.0), upper=(np.inf, np.inf, 5.0, np.inf)
    ),
}
