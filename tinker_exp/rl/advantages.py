"""Advantages within groups (one group: the group_size responses sampled for one prompt). Pure Python.

grpo matches verl's `compute_grpo_outcome_advantage` (norm_adv_by_std_in_grpo=True, epsilon 1e-6, the unbiased
std), computed here in float64; mean_centred is tinker-cookbook's (reward - group mean). A degenerate group, all
of whose rewards are equal, has advantages exactly 0 in both: it carries no signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from tinker_exp.config.rl import Advantage

GRPO_EPSILON = 1e-6
"""Added to the group's std (verl's default epsilon)."""


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float]
    """One per response, in the order of the rewards."""
    degenerate: list[int]
    """Indices of the groups whose rewards are all equal (their advantages are 0)."""
    groups: int
    """How many groups there are."""

    @property
    def all_degenerate(self) -> bool:
        """Every group is degenerate: no response carries a signal."""
        return len(self.degenerate) == self.groups


def group_advantages(rewards: Sequence[float], group_size: int, mode: Advantage | str) -> GroupAdvantages:
    """The advantage of every response; `rewards` holds whole groups, one after another."""
    mode = Advantage(mode)
    if group_size < 2 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group_size} (group_size >= 2)")
    advantages: list[float] = []
    degenerate = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        if max(group) == min(group):
            degenerate.append(start // group_size)
            advantages += [0.0] * group_size
            continue
        mean = math.fsum(group) / group_size
        centred = [r - mean for r in group]
        if mode is Advantage.grpo:
            std = math.sqrt(math.fsum(c * c for c in centred) / (group_size - 1))
            centred = [c / (std + GRPO_EPSILON) for c in centred]
        advantages += centred
    return GroupAdvantages(advantages, degenerate, len(rewards) // group_size)
