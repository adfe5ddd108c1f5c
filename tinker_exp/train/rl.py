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
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

from tinker_exp import threads
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
        """Each response token's log-prob under the initial model (softmax(logits / temperature)).

        Whatever weights the sampler has loaded since."""
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
    """The sampler's weights, loaded from the workers' export whenever their weights changed.

    An evaluation and the next step share one export; a checkpoint a member loads mid-run is exported before its next
    batch."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.workers: Exporting | None = None
        self.loaded: Any = None
        """What the sampler holds: ("workers", their weights_version) after `refresh`, ("step", s) after `load_step`."""
        self.export_time_s = self.load_time_s = 0.0
        self.lock = threading.RLock()
        """Held while the sampler is used: an off-policy run's sampling thread and the evaluation share it."""

    def refresh(self) -> None:
        assert self.workers is not None, "attach the workers first"
        if self.loaded == ("workers", self.workers.weights_version):
            self.export_time_s = self.load_time_s = 0.0
            return
        start = time.perf_counter()
        tensors = self.workers.export_weights()
        exported = time.perf_counter()
        self.sampler.load(tensors)
        self.export_time_s, self.load_time_s = exported - start, time.perf_counter() - exported
        self.loaded = ("workers", self.workers.weights_version)

    def load_step(self, step: int, tensors: Any) -> float:
        """Load the weights the workers had at the start of optimizer step `step`; returns the load's time.

        The weights were exported then; nothing is loaded when the sampler holds them already."""
        if self.loaded == ("step", step):
            return 0.0
        start = time.perf_counter()
        self.sampler.load(tensors)
        self.loaded = ("step", step)
        return time.perf_counter() - start


def sample_groups(
    weights: Weights, prompts: Sequence[Prompt], reward: Reward, rl: Any, max_new_tokens: int,
) -> tuple[list[Rollout], list[Any], dict[str, Any]]:  # fmt: skip
    """Each prompt sampled rl.group_size times, rewarded and advantaged.

    Advantages by rl.advantage within each group. Returns the rollouts, the (prompt, sample) pairs and what was
    measured."""
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


def sampled_row(measured: Mapping[str, Any]) -> dict[str, Any]:
    """What sampling a batch measured, under the row's names."""
    return {
        "train/reward": measured["reward"],
        "train/reward_std": measured["reward_std"],
        "train/degenerate_groups": measured["degenerate_groups"],
        "train/zero_advantage_step": int(measured["all_degenerate"]),
        "train/response_length": measured["response_length"],
    }


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
        """The batch as JSON: ints and floats only.

        Python floats round-trip exactly through JSON (repr), so a resumed run trains on the same bits."""
        return {"first_step": self.first_step, "rollouts": [asdict(r) for r in self.rollouts], "measured": self.measured}

    @classmethod
    def from_json(cls, state: Mapping[str, Any]) -> "SampledBatch":
        return cls(int(state["first_step"]), [Rollout(**r) for r in state["rollouts"]], dict(state["measured"]))


class RLBatches:
    """The BatchSource of an RL run (train/protocols.py), with `rl.updates_per_batch` (K) optimizer steps per batch.

    A batch is sampled at each step that is a multiple of K (or when none is kept: a run branched from a batch's end
    with another K), and kept for the steps up to the next multiple."""

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
        row = sampled_row(measured)
        times = {"perf/sampling_s": measured["sampling_s"], "perf/weight_export_s": self.weights.export_time_s,
                 "perf/sampler_load_s": self.weights.load_time_s}  # fmt: skip
        if self.rl.uses_reference:
            start = time.perf_counter()
            rollouts = with_reference(self.weights.sampler, rollouts, self.rl.temperature)
            times["perf/reference_s"] = time.perf_counter() - start
        self.current = SampledBatch(step, rollouts, row)
        return Batch(rollouts, {**row, **times, "train/update": 0})

    def state(self) -> dict[str, Any]:
        """The prompt cursor and the sampler's random state; mid-batch, the batch too.

        Mid-batch: the next step trains on the kept batch."""
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

    def close(self) -> None:
        pass


class OffPolicyBatches(RLBatches):
    """The BatchSource of an off-policy run (rl.max_steps_off_policy = k >= 1).

    A sampling thread in the driver samples the next batches while the workers train on the current one.

    Step s's batch is sampled from the weights the workers had at the start of step v(s) = max(s - k, first), where
    `first` is the step the run (or a resume without batches in flight) started at: past its first k steps every
    batch is exactly k steps old (train/staleness = s - v(s)). The driver exports the workers' weights at the start
    of every step (before training on it) and hands them to the thread, which samples batch t as soon as the weights
    of step v(t) are there: up to k batches ahead. The staleness is a function of the step, not of timing, so a run
    is as deterministic as a synchronous one: the thread takes prompts and random draws in step order.

    A checkpoint after step s - 1 holds the batches in flight, s .. s + k - 1 (every one sampled from weights before
    the checkpoint's, which are not in it), with the prompt cursor and the sampler's random state after them; the
    save waits for the thread to have sampled them. A run resumed or branched there trains on those batches and
    samples batch s + k from the checkpoint's weights, as the uninterrupted run did."""

    def __init__(self, *args: Any, total_steps: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.k, self.total_steps = self.rl.max_steps_off_policy, total_steps
        self._changed = threading.Condition()
        self._exported: dict[int, Any] = {}
        """The workers' weights at the start of each step a batch still to sample is sampled from."""
        self._ready: dict[int, tuple[SampledBatch, dict[str, Any]]] = {}
        """Sampled batches by step, with what sampling them measured."""
        self._next: int | None = None
        """The next step whose batch the thread samples (None: not started)."""
        self._first = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    def _version(self, step: int) -> int:
        return max(step - self.k, self._first)

    def batch(self, step: int) -> Batch:
        self.next_step = step + 1
        if self._next is None:
            self._next, self._first = step, step
        export_s = 0.0
        if step + self.k < self.total_steps or step == self._first:  # wanted by batch step + k (the first: by step's)
            start = time.perf_counter()
            tensors = self.weights.workers.export_weights()  # type: ignore[union-attr]
            export_s = time.perf_counter() - start
            with self._changed:
                self._exported[step] = tensors
                self._changed.notify_all()
        self._start_thread()
        start = time.perf_counter()
        with self._changed:
            while step not in self._ready and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise self._error
            sampled, times = self._ready.pop(step)
        self.current = sampled
        return Batch(sampled.rollouts, {**sampled.measured, **times, "perf/weight_export_s": export_s,
                                        "perf/sample_wait_s": time.perf_counter() - start,
                                        "train/staleness": step - sampled.first_step})  # fmt: skip

    def _start_thread(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threads.start(self._sample_ahead, "rl-sampling")  # a reward's prints are its run's

    def _sample_ahead(self) -> None:
        try:
            while True:
                with self._changed:
                    while not self._stopping and self._next < self.total_steps and self._version(self._next) not in self._exported:
                        self._changed.wait()
                    if self._stopping or self._next >= self.total_steps:
                        return
                    step, version = self._next, self._version(self._next)
                    tensors = self._exported[version]
                sampled, times = self._sample(version, tensors)
                with self._changed:
                    self._ready[step] = (sampled, times)
                    self._next = step + 1
                    for old in [v for v in self._exported if v < self._version(self._next)]:
                        del self._exported[old]
                    self._changed.notify_all()
        except BaseException as e:  # a reward's error, a sampler's: raised in the loop's thread at its next batch
            with self._changed:
                self._error = e
                self._changed.notify_all()

    def _sample(self, version: int, tensors: Any) -> tuple[SampledBatch, dict[str, Any]]:
        with self.weights.lock:
            load_s = self.weights.load_step(version, tensors)
            prompts = [self._prompt(self.cursor + i) for i in range(self.rl.prompts_per_step)]
            self.cursor += len(prompts)
            rollouts, _, measured = sample_groups(self.weights, prompts, self.reward, self.rl, self.max_new_tokens)
            times = {"perf/sampling_s": measured["sampling_s"], "perf/sampler_load_s": load_s}
            if self.rl.uses_reference:
                start = time.perf_counter()
                rollouts = with_reference(self.weights.sampler, rollouts, self.rl.temperature)
                times["perf/reference_s"] = time.perf_counter() - start
        row = sampled_row(measured)
        return SampledBatch(version, rollouts, row), times

    def _in_flight_through(self, last: int) -> None:
        """Wait until the thread has sampled every batch up to step `last` (or the run's last)."""
        with self._changed:
            while self._next is not None and self._next <= min(last, self.total_steps - 1) and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise self._error

    def state(self) -> dict[str, Any]:
        """The prompt cursor and the sampler's random state after the batches in flight, and those batches.

        Each batch with the step of the weights it was sampled from; what sampling them measured is kept with them."""
        self._in_flight_through(self.next_step + self.k - 1)
        with self._changed, self.weights.lock:
            in_flight = [{"step": step, "batch": sampled.to_json(), "times": times}
                         for step, (sampled, times) in sorted(self._ready.items())]  # fmt: skip
            return {"prompt_cursor": self.cursor, "sampler_rng": self.weights.sampler.rng_state(), "in_flight": in_flight}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's state ({} at step 0).

        The thread stops (what it sampled is dropped) and starts again at the next batch, after the batches in
        flight."""
        self._stop_thread()
        self._exported, self._ready, self._next, self._error = {}, {}, None, None
        if state:
            self.cursor = int(state["prompt_cursor"])
            self.weights.sampler.set_rng_state(state["sampler_rng"])
            for entry in state.get("in_flight", []):
                self._ready[int(entry["step"])] = (SampledBatch.from_json(entry["batch"]), dict(entry["times"]))
            if self._ready:
                self._first, self._next = min(self._ready), max(self._ready) + 1

    def close(self) -> None:
        """The thread stops (a run stopped early, or failed, leaves it waiting for weights that never come)."""
        self._stop_thread()
        self._exported, self._ready = {}, {}

    def _stop_thread(self) -> None:
        if self._thread is not None:
            with self._changed:
                self._stopping = True
                self._changed.notify_all()
            self._thread.join()
            self._thread = None


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
        with self.weights.lock:  # an off-policy run's sampling thread waits (and reloads its weights after)
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

