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

numpy (and scipy's lfilter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

MOMENTUM_DECAY = 0.999  # lambda of the momentum law, as published


def warmup_end(lr: np.ndarray) -> int:
    """The first update at the run's peak lr: the warmup is the updates before it (0 without warmup)."""
    return int(np.argmax(lr >= lr.max() * (1 - 1e-12)))


CHUNK_ENTRIES = 2_000_000
"""At most this many (point, change point) pairs are held at once: a curve predicted at every step of a long
cosine run has tens of millions (memory, not time, is what this bounds)."""


@dataclass(frozen=True)
class Features:
    """What a law needs of one or more schedules at the update counts it is evaluated at.

    Precomputed once per fit: a fit evaluates the law thousands of times on the same schedules.

    The multi-power law's decay sum runs over the (point n, change point k < n) pairs only, packed flat row by
    row (`row_ptr`): a dense [point, change point] matrix would be half zeros and, evaluated at every step of a
    long cosine run, too large to hold."""

    updates: np.ndarray  # n at each evaluated point (>= 1)
    s1: np.ndarray  # S1(n), warmup as run (multi-power law)
    s1_peak_warmup: np.ndarray  # S1(n) with the warmup counted at the peak (momentum law)
    s2: np.ndarray  # S2(n) of the momentum law
    row_ptr: np.ndarray  # the pairs of point j are [row_ptr[j], row_ptr[j + 1])
    drop: np.ndarray  # per pair: eta_{k-1} - eta_k
    log_lr: np.ndarray  # per pair: log eta_k
    log_sum: np.ndarray  # per pair: log S_k(n) (S_k(n) >= eta_k > 0)
    full_drop: np.ndarray  # per point: the drops to an lr of exactly 0 before n (G is 1 there: the drop counts whole)

    @property
    def decays(self) -> bool:
        """Whether any point has seen an lr change after the warmup: without one the decay terms are not seen."""
        return bool(len(self.drop) and np.any(self.drop != 0)) or bool(np.any(self.full_drop != 0))


def features(lr: np.ndarray, updates: np.ndarray, resolution: float | None = None) -> Features:
    """The sums both laws use, of a normalised lr array (one value per update), at update counts `updates`.

    `resolution`: the decay sum of point n taken over blocks of consecutive change points, each at most
    `resolution` x its distance from n wide (its drops' sum at their |drop|-weighted middle change point): far
    change points are summed coarsely, where G varies slowly, the recent ones one by one. A block holding one
    change point is exact, so a schedule with few changes (two-stage, a step decay) is exact; a cosine's pairs
    drop from ~n/2 to ~log(n)/resolution per point."""
    lr = np.asarray(lr, dtype=np.float64)
    updates = np.asarray(updates, dtype=np.int64)
    if updates.size and (updates.min() < 1 or updates.max() > len(lr)):
        raise ValueError(f"update counts must be in 1..{len(lr)}")
    cumsum = np.concatenate([[0.0], np.cumsum(lr)])  # cumsum[n] = sum_{i<n} eta_i
    warm = warmup_end(lr)
    peak_warm = lr.copy()
    peak_warm[:warm] = lr.max()
    cumsum_peak = np.concatenate([[0.0], np.cumsum(peak_warm)])
    # Momentum of the lr's decrease (the momentum law), over the warmup-at-peak array: m_i = sum_j lambda^(i-j) d_j.
    decrease = np.concatenate([[0.0], peak_warm[:-1] - peak_warm[1:]])
    momentum = _decayed_sum(decrease, MOMENTUM_DECAY)
    s2 = np.concatenate([[0.0], np.cumsum(momentum)])
    steps = np.arange(1, len(lr))
    changed = steps[(steps > warm) & (np.abs(np.diff(lr)) > 0)]
    to_zero = lr[changed] <= 0
    zero_at, changed = changed[to_zero], changed[~to_zero]
    drops = lr[changed - 1] - lr[changed]
    if resolution:
        k, drops, counts = _blocks(changed, drops, updates, resolution)
    else:
        counts = np.searchsorted(changed, updates, side="left")  # change points k < n
        index = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        k, drops = changed[index].astype(np.float64), drops[index]
    row_ptr = np.concatenate([[0], np.cumsum(counts)])
    n = np.repeat(updates, counts)
    # at a block's fractional middle: the lr and the lr sum interpolated (at a change point itself: exact)
    lr_at = np.maximum(np.interp(k, np.arange(len(lr)), lr), lr[changed].min(initial=1.0))
    sum_at = cumsum[n] - np.interp(k, np.arange(len(cumsum)), cumsum)
    zero_drop = np.concatenate([[0.0], np.cumsum(lr[zero_at - 1] - lr[zero_at])])
    return Features(
        updates=updates,
        s1=cumsum[updates],
        s1_peak_warmup=cumsum_peak[updates],
        s2=s2[updates],
        row_ptr=row_ptr,
        drop=drops,
        log_lr=np.log(lr_at),
        log_sum=np.log(sum_at),
        full_drop=zero_drop[np.searchsorted(zero_at, updates, side="left")],
    )


def _blocks(changed: np.ndarray, drops: np.ndarray, updates: np.ndarray, resolution: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per point n, the blocks of change points k < n of `features(resolution=...)`.

    Returns (each pair's |drop|-weighted middle step, its drop, the number of pairs per point). Distances n - k in [d_i,
    d_{i+1}), d_{i+1} = d_i + max(1, floor(resolution d_i)): one ladder for every point, so a [point, block] matrix of
    prefix sums does it."""
    ladder = [1]
    while ladder[-1] <= int(updates.max(initial=1)):
        ladder.append(ladder[-1] + max(1, int(resolution * ladder[-1])))
    ladder = np.array(ladder)
    # prefix sums over the change points: drops, |drops|, |drops| x step
    weight = np.abs(drops)
    prefix = [np.concatenate([[0.0], np.cumsum(v)]) for v in (drops, weight, weight * changed)]
    # block i of point n: change points with n - ladder[i+1] < k <= n - ladder[i]
    hi = np.searchsorted(changed, updates[:, None] - ladder[None, :-1], side="right")
    lo = np.searchsorted(changed, updates[:, None] - ladder[None, 1:], side="right")
    drop, total, moment = ((p[hi] - p[lo]) for p in prefix)
    used = total > 0
    middle = moment[used] / total[used]
    return middle, drop[used], used.sum(axis=1)


def _decayed_sum(values: np.ndarray, decay: float) -> np.ndarray:
    """m_i = decay * m_{i-1} + values_i from m_{-1} = 0: a first-order filter, not a Python loop over every step."""
    from scipy.signal import lfilter

    return lfilter([1.0], [1.0, -decay], values)


def concat(parts: list[Features]) -> Features:
    """Several schedules' features as one: a fit evaluates every run in one vectorised pass."""
    offsets = np.cumsum([0] + [int(f.row_ptr[-1]) for f in parts[:-1]])
    joined = {name: np.concatenate([getattr(f, name) for f in parts]) for name in ("updates", "s1", "s1_peak_warmup", "s2", "drop", "log_lr", "log_sum", "full_drop")}
    row_ptr = np.concatenate([[0]] + [f.row_ptr[1:] + o for f, o in zip(parts, offsets)])
    return Features(row_ptr=row_ptr, **joined)


def _row_sums(f: Features, values: np.ndarray) -> np.ndarray:
    """Per point, the sum of `values` over its pairs (0 for a point with none)."""
    out = np.zeros(len(f.updates))
    filled = f.row_ptr[1:] > f.row_ptr[:-1]
    if np.any(filled):
        out[filled] = np.add.reduceat(values, f.row_ptr[:-1][filled])
    return out


def multi_power(p: np.ndarray, f: Features, jacobian: bool = False):
    """The multi-power law at the points of `f`; with `jacobian`, (prediction, d prediction / d p) in one pass.

    With x = eta_k^-gamma S_k(n), u = C x + 1 and G = 1 - u^-beta: dG/dC = beta x u^-beta / u,
    dG/dbeta = ln(u) u^-beta, dG/dgamma = -beta C x u^-beta / u * ln(eta_k)."""
    l0, a, alpha, b, c, beta, gamma = p
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x = np.exp(f.log_sum - gamma * f.log_lr)
        log_u = np.log1p(c * x)
        kept = f.drop * np.exp(-beta * log_u)  # drop * u^-beta: the part of each drop not yet realised
        decay = f.full_drop + _row_sums(f, f.drop - kept)  # sum drop * G
        power = np.power(f.s1, -alpha)
        predicted = l0 + a * power - b * decay
        if not jacobian:
            return predicted
        w = kept * x / (1.0 + c * x)
        jac = np.empty((len(predicted), 7))
        jac[:, 0] = 1.0
        jac[:, 1] = power
        jac[:, 2] = -a * power * np.log(f.s1)
        jac[:, 3] = -decay
        jac[:, 4] = -b * beta * _row_sums(f, w)
        jac[:, 5] = -b * _row_sums(f, kept * log_u)
        jac[:, 6] = b * beta * c * _row_sums(f, w * f.log_lr)
    return predicted, jac


def momentum(p: np.ndarray, f: Features, jacobian: bool = False):
    l0, a, alpha, c = p
    power = np.power(f.s1_peak_warmup, -alpha)
    predicted = l0 + a * power - c * f.s2
    if not jacobian:
        return predicted
    jac = np.stack([np.ones_like(power), power, -a * power * np.log(f.s1_peak_warmup), -f.s2], axis=1)
    return predicted, jac


def predict(kind: "LawKind", p: np.ndarray, lr: np.ndarray, updates: np.ndarray) -> np.ndarray:
    """`kind`'s prediction for the normalised schedule `lr` at `updates`, in chunks of points (CHUNK_ENTRIES)."""
    updates = np.asarray(updates, dtype=np.int64)
    per_point = max(1, int(np.sum(np.abs(np.diff(lr)) > 0)))
    size = max(1, CHUNK_ENTRIES // per_point)
    parts = [kind.predict(p, features(lr, updates[i : i + size])) for i in range(0, len(updates), size)]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass(frozen=True)
class LawKind:
    """A law's formula, its parameter names, where its fit may look, and generic starting points."""

    name: str
    params: tuple[str, ...]
    predict: Callable[..., Any]  # (p, Features, jacobian=False) -> prediction, or (prediction, jacobian)
    decay_params: tuple[str, ...]  # the parameters only a run whose lr changes after the warmup identifies
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
        "mpl", ("L0", "A", "alpha", "B", "C", "beta", "gamma"), multi_power, ("B", "C", "beta", "gamma"),
        lower=(0.0, 0.0, 1e-3, 0.0, 1e-6, 1e-3, 0.0), upper=(np.inf, np.inf, 5.0, np.inf, 1e4, 20.0, 2.0),
    ),  # fmt: skip
    "momentum": LawKind(
        "momentum", ("L0", "A", "alpha", "C"), momentum, ("C",), lower=(0.0, 0.0, 1e-3, 0.0), upper=(np.inf, np.inf, 5.0, np.inf)
    ),
}
