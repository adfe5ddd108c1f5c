"""The RL batch source and evaluation: sample groups from the current weights, reward them, advantages. Pure Python.

A sampled batch (`RLBatches.batch` at every step that is a multiple of rl.updates_per_batch, K): the workers export
their weights into the sampler (runtime/sampler.py, behind the `Sampler` seam), the batch's prompts (the next
`rl.prompts_per_step` from the prompt cursor, shuffled each epoch with the run's seed) are sampled `rl.group_size`
times each, every response is rewarded, and the group's advantages computed; the batch is the rollouts with their
sampler log-probs (and the initial model's, when the run has a KL reference). The next K - 1 optimizer steps train on
the same rollouts: the ratio is taken against the sampler's log-probs each time. Its state in a checkpoint: the
prompt cursor, the sampler's random state, and mid-batch the batch itself, so a resumed run samples and trains on
what the uninterrupted run did.

A step whose groups all have zero advantage (every group's rewards equal) is trained as any other: forward_backward
(the loss and its gradient are zero) and optimizer_step with the plan's values (AdamW's moments and weight decay
still move the weights); the row says so with train/zero_advantage_step = 1.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

from tinker_exp.rl.advantages import group_advantages
from tinker_exp.rl.prompts import PromptRow
from tinker_exp.train.protocols import Batch


@dataclass(frozen=True)
class Rollout:
    """One sampled response, as the RL loss takes it."""

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    """The sampler's log-prob of each response token (old_log_probs)."""
    advantage: float
    reward: float
    ref_log_probs: list[float] | None = None
    """The initial model's log-prob of each response token (a run with a KL reference), else None."""

    @property
    def input_ids(self) -> list[int]:
        """The whole sequence the workers see (the loop counts its tokens)."""
        return [*self.prompt_ids, *self.response_ids]


class Sampled(Protocol):
    response_ids: list[int]
    log_probs: list[float]
    text: str


class Sampler(Protocol):
    """Samples from weights it is given (the driver's HF model now; a rollout server later)."""

    def prompt_ids(self, text: str) -> list[int]: ...

    def load(self, tensors: Any) -> None: ...

    def sample(self, prompt_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float) -> list[Sampled]: ...

    def reference_log_probs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
        """Each response token's log-prob under the initial model (softmax(logits / temperature)), whatever weights
        the sampler has loaded since."""
        ...

    def rng_state(self) -> str: ...

    def set_rng_state(self, state: str) -> None: ...

    def state_for(self, seed: int) -> str:
        """The random state a fresh sampler seeded with `seed` starts from."""
        ...


Reward = Callable[[PromptRow, str], float]
"""(prompt row, response text) -> reward (tinker_exp.rl.rewards.Reward: a failure is a RewardError)."""


@dataclass(frozen=True)
class Prompt:
    row: PromptRow
    ids: list[int]
    """The row's prompt as one user turn in the model's chat template."""


class Exporting(Protocol):
    """The workers as the sampler sees them (runtime/rl_workers.py RLWorkers)."""

    weights_version: int
    """Changes whenever their weights do (an optimizer step, a loaded checkpoint)."""

    def export_weights(self) -> Any: ...


class Weights:
    """The sampler's weights, loaded from the workers' export whenever their weights changed (an evaluation and the
    next step share one export; a checkpoint a member loads mid-run is exported before its next batch)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.workers: Exporting | None = None
        self.loaded_version: int | None = None
        self.export_time_s = self.load_time_s = 0.0

    def refresh(self) -> None:
        assert self.workers is not None, "attach the workers first"
        if self.loaded_version == self.workers.weights_version:
            self.export_time_s = self.load_time_s = 0.0
            return
        start = time.perf_counter()
        tensors = self.workers.export_weights()
        exported = time.perf_counter()
        self.sampler.load(tensors)
        self.export_time_s, self.load_time_s = exported - start, time.perf_counter() - exported
        self.loaded_version = self.workers.weights_version


def sample_groups(
    weights: Weights, prompts: Sequence[Prompt], reward: Reward, rl: Any, max_new_tokens: int,
) -> tuple[list[Rollout], list[Any], dict[str, Any]]:  # fmt: skip
    """Each prompt sampled rl.group_size times, rewarded, advantaged (rl.advantage within each group); the
    rollouts, the (prompt, sample) pairs and what was measured."""
    start = time.perf_counter()
    samples, rewards = [], []
    for prompt in prompts:
        group = weights.sampler.sample(prompt.ids, rl.group_size, max_new_tokens, rl.temperature)
        samples += [(prompt, s) for s in group]
        rewards += [float(reward(prompt.row, s.text)) for s in group]
    advantages = group_advantages(rewards, rl.group_size, rl.advantage)
    rollouts = [
        Rollout(prompt.ids, list(s.response_ids), list(s.log_probs), advantage, r)
        for (prompt, s), advantage, r in zip(samples, advantages.advantages, rewards)
    ]
    mean = sum(rewards) / len(rewards)
    lengths = [len(r.response_ids) for r in rollouts]
    measured = {
        "reward": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "degenerate_groups": len(advantages.degenerate),
        "all_degenerate": advantages.all_degenerate,
        "response_length": sum(lengths) / len(lengths),
        "sampling_s": time.perf_counter() - start,
    }
    return rollouts, samples, measured


def with_reference(sampler: Sampler, rollouts: list[Rollout], temperature: float) -> list[Rollout]:
    """The rollouts with the initial model's log-probs of their responses, one call per prompt's group."""
    out: list[Rollout] = []
    start = 0
    while start < len(rollouts):
        end = start
        while end < len(rollouts) and rollouts[end].prompt_ids == rollouts[start].prompt_ids:
            end += 1
        group = rollouts[start:end]
        ref = sampler.reference_log_probs(group[0].prompt_ids, [r.response_ids for r in group], temperature)
        out += [replace(r, ref_log_probs=list(lp)) for r, lp in zip(group, ref, strict=True)]
        start = end
    return out


@dataclass(frozen=True)
class SampledBatch:
    """A sampled batch, kept for the K - 1 optimizer steps after the one that sampled it."""

    first_step: int
    """The optimizer step that sampled it (its update 0)."""
    rollouts: list[Rollout]
    measured: dict[str, Any]
    """What sampling it measured (rewards, lengths; its times are those of its first step only)."""

    def to_json(self) -> dict[str, Any]:
        """Ints and floats only: Python floats round-trip exactly through JSON (repr), so a resumed run trains on
        the same bits."""
        return {"first_step": self.first_step, "rollouts": [asdict(r) for r in self.rollouts], "measured": self.measured}

    @classmethod
    def from_json(cls, state: Mapping[str, Any]) -> "SampledBatch":
        return cls(int(state["first_step"]), [Rollout(**r) for r in state["rollouts"]], dict(state["measured"]))


class RLBatches:
    """The BatchSource of an RL run (train/protocols.py). `rl.updates_per_batch` (K) optimizer steps per sampled
    batch: a batch is sampled at each step that is a multiple of K (or when none is kept: a run branched from a
    batch's end with another K), and kept for the steps up to the next multiple."""

    def __init__(self, prompts: Sequence[Prompt], weights: Weights, reward: Reward, rl: Any, max_new_tokens: int, seed: int):
        self.prompts, self.weights, self.reward = list(prompts), weights, reward
        self.rl, self.max_new_tokens, self.seed = rl, max_new_tokens, seed
        self.cursor = 0
        """How many prompts the run has taken so far."""
        self.current: SampledBatch | None = None
        """The batch being trained on; None before the first."""
        self.next_step = 0
        """The step after the last one served: a checkpoint taken now resumes there."""

    def attach(self, workers: Exporting) -> None:
        """The workers whose weights it samples from (they start after this source is built)."""
        self.weights.workers = workers

    def _prompt(self, index: int) -> Prompt:
        epoch, position = divmod(index, len(self.prompts))
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return self.prompts[order[position]]

    def batch(self, step: int) -> Batch:
        self.next_step = step + 1
        if self.current is not None and step % self.rl.updates_per_batch:
            times = {"perf/sampling_s": 0.0, "perf/weight_export_s": 0.0, "perf/sampler_load_s": 0.0}
            if self.rl.uses_reference:
                times["perf/reference_s"] = 0.0
            return Batch(self.current.rollouts, {**self.current.measured, **times, "train/update": step - self.current.first_step})
        self.weights.refresh()
        prompts = [self._prompt(self.cursor + i) for i in range(self.rl.prompts_per_step)]
        self.cursor += len(prompts)
        rollouts, _, measured = sample_groups(self.weights, prompts, self.reward, self.rl, self.max_new_tokens)
        row = {
            "train/reward": measured["reward"],
            "train/reward_std": measured["reward_std"],
            "train/degenerate_groups": measured["degenerate_groups"],
            "train/zero_advantage_step": int(measured["all_degenerate"]),
            "train/response_length": measured["response_length"],
        }
        times = {"perf/sampling_s": measured["sampling_s"], "perf/weight_export_s": self.weights.export_time_s,
                 "perf/sampler_load_s": self.weights.load_time_s}  # fmt: skip
        if self.rl.uses_reference:
            start = time.perf_counter()
            rollouts = with_reference(self.weights.sampler, rollouts, self.rl.temperature)
            times["perf/reference_s"] = time.perf_counter() - start
        self.current = SampledBatch(step, rollouts, row)
        return Batch(rollouts, {**row, **times, "train/update": 0})

    def state(self) -> dict[str, Any]:
        """The prompt cursor and the sampler's random state; mid-batch (the next step trains on the kept batch),
        the batch too."""
        state: dict[str, Any] = {"prompt_cursor": self.cursor, "sampler_rng": self.weights.sampler.rng_state()}
        if self.current is not None and self.next_step % self.rl.updates_per_batch:
            state["batch"] = self.current.to_json()
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's state ({} at step 0); a checkpoint at a batch's end holds no batch: the next step samples."""
        if state:
            self.cursor = int(state["prompt_cursor"])
            self.weights.sampler.set_rng_state(state["sampler_rng"])
        self.current = SampledBatch.from_json(state["batch"]) if state.get("batch") else None


class RLEvaluation:
    """Held-out prompts sampled every trainer.eval_every steps (and after the last): eval/reward, their mean reward.
    Seeded sampling at the run's temperature, from the same seed at every evaluation, so that two evaluations differ
    only by the weights; the training sampler's random state is left as it was."""

    TABLE_ROWS = 4
    """Sampled (prompt, response, reward) rows in W&B's table at each evaluation."""

    def __init__(self, prompts: Sequence[Prompt], weights: Weights, reward: Reward, rl: Any, max_new_tokens: int,
                 every: int, total_steps: int, seed: int, sink: Any = None):  # fmt: skip
        self.prompts, self.weights, self.reward, self.rl = list(prompts), weights, reward, rl
        self.max_new_tokens, self.every, self.total_steps, self.seed, self.sink = max_new_tokens, every, total_steps, seed, sink
        self.table: list[list[Any]] = []

    def due(self, steps_done: int) -> bool:
        return bool(self.every and steps_done % self.every == 0) or steps_done == self.total_steps

    def run(self, workers: Any, steps_done: int) -> dict[str, Any]:
        start = time.perf_counter()
        sampler = self.weights.sampler
        self.weights.refresh()
        training_rng = sampler.rng_state()
        sampler.set_rng_state(sampler.state_for(self.seed))
        try:
            rollouts, samples, measured = sample_groups(self.weights, self.prompts, self.reward, self.rl, self.max_new_tokens)
        finally:
            sampler.set_rng_state(training_rng)
        shown = zip(samples[: self.TABLE_ROWS], rollouts)
        self.table += [[steps_done, prompt.row.prompt, sample.text, rollout.reward] for (prompt, sample), rollout in shown]
        if self.sink is not None:
            self.sink.attach_table("eval/samples", ["step", "prompt", "response", "reward"], self.table)
        return {"eval/reward": measured["reward"], "eval/reward_std": measured["reward_std"],
                "perf/eval_time_s": time.perf_counter() - start}  # fmt: skip

