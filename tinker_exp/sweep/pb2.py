"""PB2's explore step: a Gaussian-process bandit proposes the values an exploiting member trains with next.

Parker-Holder et al. 2020, "Provably Efficient Online Hyperparameter Optimization with Population-Based Bandits": a
Gaussian-process bandit over the members' recent improvements proposes the values an exploiting member trains with next.
Pure numpy/scipy.

The data: one point per (member, boundary) whose interval's start score is known, x = the values the member trained
that interval with (each numeric key scaled to [0, 1] within the space's bounds, a log key in log space), t = the
boundary's index (step / interval), y = the improvement over the interval (the start score minus the score, sign
applied: higher is better). The model: a GP with the time-varying squared-exponential kernel of TV-GP-UCB (Bogunovic
et al. 2016), k((x, t), (x', t')) = exp(-|x - x'|^2 / (2 l^2)) * (1 - eps)^(|t - t'| / 2), so older intervals count
less; l, eps and the noise are fitted by maximum marginal likelihood (L-BFGS-B from a fixed start: deterministic).
The proposal maximises the upper confidence bound mean + kappa * std at the next boundary's time over [0, 1]^d:
seeded random candidates, the best few polished by L-BFGS-B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.optimize import minimize

BOUNDS = {"lengthscale": (0.05, 5.0), "epsilon": (1e-4, 0.5), "noise": (1e-4, 1.0)}
"""Where the kernel's fitted values may lie (y is standardised, x in [0, 1])."""
START = {"lengthscale": 0.5, "epsilon": 0.1, "noise": 0.1}
"""The fit's fixed starting point."""


def kernel(x1: np.ndarray, t1: np.ndarray, x2: np.ndarray, t2: np.ndarray, lengthscale: float, epsilon: float) -> np.ndarray:
    """The time-varying squared-exponential kernel between two sets of points (rows of x, entries of t)."""
    squared = ((x1[:, None, :] - x2[None, :, :]) ** 2).sum(axis=-1)
    return np.exp(-squared / (2 * lengthscale**2)) * (1 - epsilon) ** (np.abs(t1[:, None] - t2[None, :]) / 2)


@dataclass(frozen=True)
class TimeVaryingGP:
    """A GP fitted to (x, t) -> y (y standardised inside: its mean and scale are kept to predict in y's units)."""

    x: np.ndarray
    t: np.ndarray
    y: np.ndarray
    lengthscale: float
    epsilon: float
    noise: float

    @property
    def _standardised(self) -> tuple[np.ndarray, float, float]:
        mean, scale = float(self.y.mean()), float(self.y.std())
        scale = scale if scale > 0 else 1.0
        return (self.y - mean) / scale, mean, scale

    def predict(self, x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The posterior mean and standard deviation at the points (rows of x, entries of t), in y's units."""
        z, mean, scale = self._standardised
        gram = kernel(self.x, self.t, self.x, self.t, self.lengthscale, self.epsilon) + self.noise * np.eye(len(self.y))
        factor = cho_factor(gram, lower=True)
        cross = kernel(x, t, self.x, self.t, self.lengthscale, self.epsilon)
        mu = cross @ cho_solve(factor, z)
        variance = 1.0 - np.einsum("ij,ji->i", cross, cho_solve(factor, cross.T))
        return mean + scale * mu, scale * np.sqrt(np.maximum(variance, 1e-12))


def negative_log_likelihood(log_params: np.ndarray, x: np.ndarray, t: np.ndarray, z: np.ndarray) -> float:
    lengthscale, epsilon, noise = np.exp(log_params)
    gram = kernel(x, t, x, t, lengthscale, epsilon) + noise * np.eye(len(z))
    try:
        factor = cho_factor(gram, lower=True)
    except np.linalg.LinAlgError:
        return 1e10
    alpha = cho_solve(factor, z)
    return float(0.5 * z @ alpha + np.log(np.diag(factor[0])).sum() + 0.5 * len(z) * math.log(2 * math.pi))


def fit(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> TimeVaryingGP:
    """The GP with its kernel's lengthscale, eps and noise at their maximum marginal likelihood (within BOUNDS)."""
    x, t, y = np.asarray(x, float), np.asarray(t, float), np.asarray(y, float)
    z = (y - y.mean()) / (y.std() if y.std() > 0 else 1.0)
    names = list(START)
    result = minimize(
        negative_log_likelihood, np.log([START[n] for n in names]), args=(x, t, z), method="L-BFGS-B",
        bounds=[tuple(np.log(BOUNDS[n])) for n in names],
    )  # fmt: skip
    lengthscale, epsilon, noise = (float(v) for v in np.exp(result.x))
    return TimeVaryingGP(x, t, y, lengthscale, epsilon, noise)


def kappa(n: int) -> float:
    """The UCB's exploration weight after n data points: sqrt(0.2 + max(0, log(0.4 n))), slowly growing."""
    return math.sqrt(0.2 + max(0.0, math.log(0.4 * n)))


def propose(x: np.ndarray, t: np.ndarray, y: np.ndarray, t_next: float, rng: np.random.Generator, candidates: int = 512,
            polished: int = 4) -> np.ndarray:  # fmt: skip
    """The point of [0, 1]^d that maximises the fitted GP's UCB at time `t_next`."""
    gp = fit(x, t, y)
    weight = kappa(len(y))
    dims = x.shape[1]

    def ucb(points: np.ndarray) -> np.ndarray:
        mean, std = gp.predict(points, np.full(len(points), float(t_next)))
        return mean + weight * std

    pool = np.vstack([rng.random((candidates, dims)), x])  # the data's own points among the candidates
    scores = ucb(pool)
    best, best_score = pool[int(np.argmax(scores))], float(scores.max())
    for start in pool[np.argsort(-scores)[:polished]]:
        result = minimize(lambda p: -float(ucb(p[None, :])[0]), start, method="L-BFGS-B", bounds=[(0.0, 1.0)] * dims)
        if -result.fun > best_score:
            best, best_score = np.clip(result.x, 0.0, 1.0), -float(result.fun)
    return best
