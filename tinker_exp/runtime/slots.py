"""Slots: one worker group holding one base model with LoRA and K trials' adapters, each slot an independent trial.

The group builds the base model once. Each slot holds, on every rank, its own adapter weights (the rank's shards),
its own optimizer (state, param groups, lr scheduler), the optimizer config its clip comes from and its own torch
RNG. A slot's trial starts as a cold run of its seed does (runtime/lora.py `start_trial`: the one rule). The steps
waiting at once train **packed** (runtime/packed.py: their rows through the base model in one forward and backward,
each row through its own slot's adapter, then each slot's own optimizer step), within a stated tolerance of each
trial alone; a step alone, and every call but a step, is **time-shared**: the group swaps the slot's adapters,
optimizer and RNG into the engine (nothing when it is the slot already there), then verl's own calls run unchanged,
bitwise the trial's alone. The frozen base weights are never copied.

The driver sees a slot as a `Slot`: the calls the loop makes on a whole group (train/protocols.py `Workers`), so the
loop, the judges and the sinks do not know they share a model. Each trial's loop runs in its own driver thread;
the group's lock orders their calls (one slot's forward_backward and optimizer_step never interleave with another's
call), and whichever thread takes it runs every step waiting then as one cycle (`SlotGroup.train_step`). A slot is freed (`Slot.shutdown`) and its index taken by the next trial (`SlotGroup.fill`) while the
others train; `SlotGroup.copy` copies one slot's whole state onto another's in place, and a slot told to load a
checkpoint another slot saved takes that slot's state as saved in place instead of reading the files, while that
state is at hand (`SlotGroup.load`: a PBT exploit between members of one group; a population's group keeps each
slot's state at its last save).

Worker side: `WorkerSlots` (held by every rank's worker, runtime/workers.py `worker_extras`). Driver side:
`SlotGroup` and `Slot`. docs/slots.md says what is measured, and what is not wired yet.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinker_exp.config import OptimizerConfig, TrainerConfig
from tinker_exp.errors import ConfigError
from tinker_exp.train.protocols import StepResult

log = logging.getLogger(__name__)

GATHER_FRACTION = 0.5
"""A cycle waits for the trials the last one served at most this fraction of the last cycle's time ..."""
GATHER_MAX_S = 0.05
"""... and at most this long (their driver work between steps is a metrics row and a progress bar, not a step)."""


def gather_s(last_cycle_s: float) -> float:
    """How long a cycle waits for the trials the last cycle served before it runs without them.

    The trials (or the Tinker server's models) are back in a moment with their next call; one that misses a cycle costs
    a cycle of its own."""
    return min(GATHER_FRACTION * last_cycle_s, GATHER_MAX_S)
ARRIVAL_GAP_S = 1.0
"""Trials filled less than this apart arrive together (a sweep's first K, each started in turn): while they arrive
and a slot is free, a cycle waits for the next of them, at most this long after the last, so that they step in
lock-step (their evaluations, checkpoints and ends then share cycles) and not a cycle or more apart each."""


@dataclass
class SlotState:
    """One slot's trial on one rank, while another slot's is in the engine."""

    seed: int
    """The trial's seed: its initial adapters and RNG (runtime/lora.py `start_trial`)."""
    adapters: list
    """A copy of every trainable parameter (the rank's shards), in the module's order."""
    optimizer: Any
    """The trial's own optimizer over the module's parameters: its state and param groups."""
    lr_scheduler: Any
    """verl's (constant) lr scheduler of that optimizer: its state joins the trial's checkpoints."""
    optimizer_config: Any
    """verl's optimizer config the trial was built with: the clip its steps use when none is sent."""
    rng: Any
    """torch's CPU RNG state of the trial (and `cuda_rng`, its GPUs'), as it left them."""
    cuda_rng: Any = None
    grads: list | None = None
    """Gradients a forward_backward left and no optimizer_step has taken yet (a served client's calls come one at
    a time, another client's between them): the very tensors, put back when the slot is loaded again."""


@dataclass
class StepRequest:
    """A slot's step or evaluation waiting for the group's next cycle (`SlotGroup.train_step`, `evaluate`)."""

    slot: "Slot"
    examples: Sequence[Any]
    """A step's batch; an evaluation's batches."""
    optim_step_params: dict[str, Any] | None
    evaluation: bool = False
    """An evaluation of each batch of `examples` (their losses the result), not a step."""
    done: bool = False
    """Its cycle has run: `result` or `error` is set."""
    result: StepResult | None = None
    error: BaseException | None = None


class WorkerSlots:
    """A rank's slots over its engine (verl's FSDP engine with LoRA).

    At most one slot is loaded: its adapters in the parameters, its optimizer, lr scheduler and config the engine's, its
    RNG torch's. Every other is parked in its `SlotState`."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.trained = [p for p in engine.module.parameters() if p.requires_grad]
        if not self.trained or not any("lora_" in n for n, _ in engine.module.named_parameters()):
            raise ValueError("slots need a LoRA model (lora.rank > 0): full fine-tuning keeps one trial per group")
        self.states: dict[int, SlotState] = {}
        self.kept: dict[int, SlotState] = {}  # a slot's state as it saved its last checkpoint (`keep`)
        self.loaded: int | None = None

    def fill(self, index: int, optimizer_config: Any, seed: int) -> None:
        """Slot `index` takes a new trial (`seed`, built with `optimizer_config`) and is loaded.

        Its adapters and RNG as a cold run of `seed` starts, a new optimizer (no state) and lr scheduler."""
        from tinker_exp.runtime.lora import start_trial

        self.park()
        self.states.pop(index, None)
        self.kept.pop(index, None)
        engine = self.engine
        engine.optimizer_config = optimizer_config
        start_trial(engine.module, seed)
        optimizer = engine._build_optimizer(engine.module)
        state = SlotState(seed, [], optimizer, engine._build_lr_scheduler(optimizer), optimizer_config, None)
        self.states[index] = state
        self._install(state)
        self.loaded = index

    def load(self, index: int) -> None:
        """Slot `index`'s trial into the engine, the loaded one parked first (nothing when it is loaded)."""
        if self.loaded == index:
            return
        state = self.states[index]  # a KeyError: the driver asked for a slot it never filled
        self.park()
        import torch

        with torch.no_grad():
            for parameter, kept in zip(self.trained, state.adapters, strict=True):
                parameter.copy_(kept)
        if state.grads is not None:
            for parameter, grad in zip(self.trained, state.grads, strict=True):
                parameter.grad = grad
            state.grads = None
        torch.set_rng_state(state.rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state_all(state.cuda_rng)
        self._install(state)
        self.loaded = index

    def packed_forward_backward(self, worker: Any, loss_fn: Any, data: Any, forward_only: bool = False,
                                log_probs: bool = False) -> dict[int, tuple[float, Any]]:
        """One packed forward and backward of the slots whose rows `data` holds (runtime/packed.py).

        Each slot's gradients left pending in its state (added to any it had, as FSDP accumulates), the engine holding
        no slot after. Returns slot index -> its loss metric and, with `log_probs`, its rows' log-probs (else None).
        `forward_only`: an evaluation (verl's infer_batch), no gradient."""
        from tinker_exp.runtime import packed

        self.park()
        shards = {i: s.adapters for i, s in self.states.items()}
        done = packed.forward_backward(worker, self.engine, loss_fn, shards, self.trained, data, forward_only, log_probs)
        for index, (grads, _, _) in done.items():
            if grads is not None:
                state = self.states[index]
                state.grads = grads if state.grads is None else [old + new for old, new in zip(state.grads, grads, strict=True)]
        return {index: (loss, rows) for index, (_, loss, rows) in done.items()}

    def park(self) -> None:
        """The loaded slot's adapters, pending gradients and RNG moved into its state.

        The engine holds no slot after."""
        if self.loaded is None:
            return
        import torch

        state = self.states[self.loaded]
        if any(p.grad is not None for p in self.trained):
            # a forward_backward whose optimizer_step has not come: its gradients are this trial's alone
            state.grads = [p.grad for p in self.trained]
            for parameter in self.trained:
                parameter.grad = None
        with torch.no_grad():
            state.adapters = [p.detach().clone() for p in self.trained]
        state.rng = torch.get_rng_state()
        state.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        state.optimizer_config = self.engine.optimizer_config
        self.loaded = None

    def free(self, index: int) -> None:
        """Slot `index`'s trial dropped: its adapters, optimizer state and pending gradients freed."""
        if self.loaded == index:
            for parameter in self.trained:  # the next slot loaded must not find them
                parameter.grad = None
            self.loaded = None
        self.states.pop(index, None)
        self.kept.pop(index, None)

    def copy(self, source: int, target: int, keep_config: bool = False, kept: bool = False) -> None:
        """Slot `target`'s trial becomes a copy of `source`'s: adapters, optimizer, lr scheduler, optimizer config, RNG.

        The copy holds its adapters, optimizer state and param groups, lr scheduler, optimizer config, RNG (a PBT
        exploit, in place: nothing goes through the driver or a disk). `keep_config`: the target keeps its own optimizer
        config (its clip when none is sent), as a checkpoint's load leaves it (a checkpoint holds none); `kept`: from
        the state `source` kept at its last save."""
        self.park()
        src = (self.kept if kept else self.states)[source]
        self.states[target] = self._copied(src, self.states[target].optimizer_config if keep_config else src.optimizer_config)

    def keep(self, index: int) -> None:
        """Slot `index`'s state now (it has just saved a checkpoint) kept aside until its next save, while it trains on.

        Another slot's load of that checkpoint copies it in place (`copy(..., kept=True)`)."""
        self.park()
        self.kept[index] = self._copied(self.states[index], self.states[index].optimizer_config)

    def _copied(self, src: SlotState, optimizer_config: Any) -> SlotState:
        engine = self.engine
        optimizer = engine._build_optimizer(engine.module)
        optimizer.load_state_dict(copy.deepcopy(src.optimizer.state_dict()))  # deep: torch's load keeps aliases
        lr_scheduler = engine._build_lr_scheduler(optimizer)
        lr_scheduler.load_state_dict(copy.deepcopy(src.lr_scheduler.state_dict()))
        return SlotState(
            src.seed, [t.clone() for t in src.adapters], optimizer, lr_scheduler, optimizer_config,
            src.rng.clone(), copy.deepcopy(src.cuda_rng), None if src.grads is None else [g.clone() for g in src.grads],
        )

    def memory(self) -> dict[str, int]:
        """This rank's bytes per slot: its adapters' shards, its optimizer's state tensors, and those of its kept state.

        Its kept state is the one at its last save. The base weights, shared, are not counted; the loaded slot's
        adapters are the parameters themselves."""
        import torch

        def size(tensors) -> int:
            local = (getattr(t, "_local_tensor", t) for t in tensors if isinstance(t, torch.Tensor))
            return sum(t.numel() * t.element_size() for t in local)

        sizes = {}
        for index, state in self.states.items():
            adapters = self.trained if index == self.loaded else state.adapters
            held = [state] + ([self.kept[index]] if index in self.kept else [])  # its state, and as kept at its last save
            optimizer_state = [v for each in held for per_param in each.optimizer.state.values() for v in per_param.values()]
            sizes[index] = size(adapters) + sum(size(each.adapters) for each in held[1:]) + size(optimizer_state) + size(state.grads or [])
        return sizes

    def _install(self, state: SlotState) -> None:
        engine = self.engine
        engine.optimizer, engine.lr_scheduler = state.optimizer, state.lr_scheduler
        engine.optimizer_config = state.optimizer_config
        engine.checkpoint_manager.optimizer, engine.checkpoint_manager.lr_scheduler = state.optimizer, state.lr_scheduler


class SlotGroup:
    """K slots on one LoRA worker group (runtime/workers.py `TinkerWorkers`, built and ready).

    `fill` gives a trial a `Slot`. Every call of every slot goes through `lock`, which also keeps the loaded slot: a
    slot's call swaps it in (one round trip) only when another slot's trial is there."""

    def __init__(self, workers: Any, capacity: int, on_free: Callable[[], None] | None = None, keep_saved: bool = False):
        """A group of `capacity` slots over `workers`.

        `workers`: a ready LoRA group, owned by this group from now on (`shutdown` frees it); `capacity`: K; `on_free`:
        called once a slot is freed (a waiting trial may take it); `keep_saved`: each slot keeps its state as it saved
        its last checkpoint (as much memory again as the slot's), so that another slot's load of that checkpoint is an
        in-place copy whatever the saver did since (a population's members)."""
        if workers.lora is None:
            raise ConfigError("slots: lora.rank=0 (full fine-tuning) keeps one trial per group; slots need lora.rank > 0")
        if capacity < 1:
            raise ConfigError(f"slots: {capacity} slots; a group holds at least 1")
        self.workers, self.capacity = workers, capacity
        self.lock = threading.RLock()
        self.slots: dict[int, Slot] = {}
        self.loaded: int | None = None
        self.built_averaged = workers.averaged
        self.on_free = on_free
        self.keep_saved = keep_saved
        self.holding: dict[int, tuple[int, int, int]] = {}
        """Slot index -> the checkpoint folder (its identity, `folder_identity`) that slot saved last, while its state
        as saved is at hand: kept (`keep_saved`), else while no call has changed the slot since. A load of the
        folder copies that state in place."""
        self.waiting: list[StepRequest] = []
        """Steps asked and not yet taken by a cycle (under `waiting_changed`, notified as one joins)."""
        self.waiting_changed = threading.Condition()
        self.cycling = False
        """A trial's thread runs the next cycle (or gathers it, or waits for the lock to run it): the other steps
        wait for it on `waiting_changed`."""
        self.expected: set[int] = set()
        """The slots the last cycle served, while their trials make no other call: the next cycle waits a moment for
        them (`gather_s`)."""
        self.last_cycle_s = 0.0
        """How long the last cycle ran."""
        self.fresh: set[int] = set()
        """Slots filled whose trial has made no call yet: the next cycle waits for them while trials arrive."""
        self.last_fill = float("-inf")
        self.arriving_until = float("-inf")
        """While trials arrive together (filled less than ARRIVAL_GAP_S apart): the last fill's time plus that gap."""
        self.packed: Counter[int] = Counter()
        """How many packed steps of n slots the group has run (n -> count): a cycle of one slot is not packed."""
        self.packed_evaluations: Counter[int] = Counter()
        """How many packed evaluations of n slots it has run."""
        self.refused = next((why for why in workers.group.enable_slots() if why), None)
        """Why the slots' steps cannot be packed on these workers (runtime/packed.py `refusal`): then time-shared."""
        if self.refused:
            log.info(f"slots: steps time-shared, not packed: {self.refused}")
        self.unpacked: set[int] = set()  # batch sizes already said not to pack (one line each)

    def fill(
        self, optimizer: OptimizerConfig, trainer: TrainerConfig, optimizer_values: dict[str, Any], index: int | None = None,
        stop: threading.Event | None = None, kind: type["Slot"] | None = None,
    ) -> "Slot":
        """A new trial (its optimizer, its seed trainer.seed) on a free slot while the others train.

        The slot: the lowest free one, or `index`. It starts as a cold run of the same config does. `stop`: once set,
        the slot's next step or evaluation raises KeyboardInterrupt in its trial (a cancelled trial stops as a Ctrl-C'd
        run stops). `kind`: the Slot class (a served client's: runtime/serve_workers.py `ServedSlot`)."""
        from tinker_exp.optim.optimizers import spec_of

        # Before the lock (it reads the model's config and tokenizer): the other slots' cycles do not wait for it.
        config = self.workers._worker_config(self.workers.backend, optimizer, trainer, self.workers.model_path, optimizer_values)
        with self.lock:
            free = [i for i in range(self.capacity) if i not in self.slots]
            if index is None and not free:
                raise RuntimeError(f"all {self.capacity} slots hold a trial: free one first")
            index = free[0] if index is None else index
            if index in self.slots or not 0 <= index < self.capacity:
                raise RuntimeError(f"slot {index} is not free (slots 0..{self.capacity - 1}, free: {free})")
            self.workers.group.slot_fill(index, self.workers.optimizer_config_of(config), trainer.seed)
            self.loaded = index
            self.holding.pop(index, None)
            slot = (kind or Slot)(self, index, spec_of(optimizer.name.value).averaged, stop)
            self.slots[index] = slot
            with self.waiting_changed:
                now = time.monotonic()
                if now - self.last_fill < ARRIVAL_GAP_S:
                    self.arriving_until = now + ARRIVAL_GAP_S
                self.last_fill = now
                self.fresh.add(index)
                self.waiting_changed.notify_all()
            return slot

    def copy(self, source: "Slot", target: "Slot", keep_config: bool = False, kept: bool = False) -> None:
        """`target`'s trial becomes `source`'s state, in place on every rank (a PBT exploit).

        Its next steps are bitwise the ones `source` would take with the same batches and values. `keep_config`: the
        target keeps its own optimizer config (its clip when none is sent), as a checkpoint's load does; `kept`:
        `source`'s state as it saved its last checkpoint (`keep_saved`)."""
        with self.lock:
            self.workers.group.slot_copy(source.index, target.index, keep_config, kept)
            self.loaded = None
            if not self.keep_saved:  # a kept state is the target's own last save's still
                self.holding.pop(target.index, None)
            target.averaged = source.averaged

    def load(self, slot: "Slot", folder: Path) -> str:
        """The checkpoint's worker state at `folder` into `slot`; returns the line that says how.

        Copied in place from the slot that saved it when that slot holds its state as saved (kept, or not changed since:
        a PBT donor on this group), else loaded from the files."""
        self._elsewhere(slot)
        with self.lock:
            found = folder_identity(folder)
            holder = next((i for i, held in self.holding.items() if held == found and i != slot.index and i in self.slots), None)
            if holder is not None:
                self.copy(self.slots[holder], slot, keep_config=True, kept=self.keep_saved)
                return f"{folder.parent}: taken in place from slot {holder + 1}, which saved it (nothing read from disk)"
            self._on(slot, lambda: self.workers.load_checkpoint(folder))
            return f"{folder.parent}: loaded from disk (no other slot of this group holds its state now)"

    def save(self, slot: "Slot", folder: Path, step: int) -> None:
        """`slot`'s checkpoint into `folder`; the slot holds that folder's state until its next call."""

        def save() -> None:
            self.workers.save_checkpoint(folder, step)
            if self.keep_saved:
                self.workers.group.slot_keep(slot.index)
                self.loaded = None
            identity = folder_identity(folder)
            for index in [i for i, held in self.holding.items() if held == identity]:  # an older folder's, gone
                del self.holding[index]
            self.holding[slot.index] = identity

        self._on(slot, save)

    def memory(self) -> dict[int, int]:
        """Bytes each slot holds on rank 0 (adapters and optimizer state)."""
        with self.lock:
            return self.workers.group.slot_memory()[0]

    def train_step(self, slot: "Slot", examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult:
        """`slot`'s step in the group's next cycle (Tinker's clock cycle).

        The step waits for the lock; whichever trial's thread takes it runs every step waiting then, its own among them,
        as one packed step (`train_steps`), and each waiting thread takes its own result. The cycle first waits a moment
        for the trials the last cycle served (`gather_s`); no other timer: a cycle packs what is waiting."""
        return self._cycle(StepRequest(slot, examples, optim_step_params))

    def evaluate(self, slot: "Slot", batches: Sequence[Sequence[Any]]) -> list[float]:
        """`slot`'s evaluation of each of `batches` (their losses) in the group's next cycle, packed as steps are.

        Packed with the other evaluations waiting then: the cycle's r-th round packs every evaluation's r-th batch
        (`evaluations`), so a trial's whole evaluation costs it one cycle, not one a batch."""
        return self._cycle(StepRequest(slot, batches, None, evaluation=True))

    def _cycle(self, request: StepRequest) -> Any:
        # A step waits on `waiting_changed` for the cycle running, not on the lock: the lock's waiters wake one at a
        # time, so a trial whose step a cycle had just run would queue for the lock behind a step that came after
        # that cycle, and that step would run alone (time-shared) while the others were still waking.
        with self.waiting_changed:
            self.waiting.append(request)
            self.fresh.discard(request.slot.index)
            self.waiting_changed.notify_all()
            self.waiting_changed.wait_for(lambda: request.done or not self.cycling)
            if request.done:
                return self._outcome(request)
            self.cycling = True  # this thread runs the next cycle
            if not self.refused:
                self._gather()
        try:
            self._run_cycle()
        finally:
            with self.waiting_changed:
                self.cycling = False
                self.waiting_changed.notify_all()
        return self._outcome(request)

    @staticmethod
    def _outcome(request: StepRequest) -> Any:
        if request.error is not None:
            raise request.error
        return request.result

    def _run_cycle(self) -> None:
        """One cycle of every request waiting once this thread has the lock: each its result, or the error raised."""
        with self.lock:
            with self.waiting_changed:
                taken, self.waiting = self.waiting, []
            began = time.monotonic()
            steps = [r for r in taken if not r.evaluation]
            evaluations = [r for r in taken if r.evaluation]
            try:
                results = self.train_steps([(r.slot, r.examples, r.optim_step_params) for r in steps]) if steps else []
                results += self._evaluation_rounds(evaluations) if evaluations else []
            except BaseException as e:  # noqa: BLE001  (each waiting trial raises it in its own thread)
                for each in taken:
                    each.error, each.done = e, True
            else:
                for each, result in zip(steps + evaluations, results, strict=True):
                    each.result, each.done = result, True
            with self.waiting_changed:
                self.expected = {r.slot.index for r in taken}
                self.last_cycle_s = time.monotonic() - began

    def _gather(self) -> None:
        """Under `waiting_changed`, before a cycle: wait for the trials the last cycle served, and for arriving ones.

        The trials the last cycle served are back from their driver work in a moment (at most `gather_s`); while trials
        arrive together, wait for the rest of them (until the group is full and each has asked, or `arriving_until`)."""
        served_until = time.monotonic() + self.gather_s()
        while True:
            now = time.monotonic()
            here = {r.slot.index for r in self.waiting}
            deadlines = []
            if now < served_until and not self.expected <= here:
                deadlines.append(served_until)
            if now < self.arriving_until and (len(self.slots) < self.capacity or not self.fresh <= here):
                deadlines.append(self.arriving_until)
            if not deadlines:
                return
            self.waiting_changed.wait(min(deadlines) - now)

    def gather_s(self) -> float:
        """How long a cycle waits for the trials the last one served: `gather_s` of the last cycle's time.

        The trials do their driver work between steps: a metrics row, a progress bar."""
        return gather_s(self.last_cycle_s)

    def _elsewhere(self, slot: "Slot") -> None:
        """`slot`'s trial makes a call that is not a cycle's (a checkpoint, an export, its end): no cycle waits for it."""
        with self.waiting_changed:
            if slot.index in self.expected or slot.index in self.fresh:
                self.expected.discard(slot.index)
                self.fresh.discard(slot.index)
                self.waiting_changed.notify_all()

    def _evaluation_rounds(self, requests: Sequence[StepRequest]) -> list[list[float]]:
        """Under the lock: each evaluation request's batches' losses, round r packing every request's r-th batch."""
        losses: list[list[float]] = [[] for _ in requests]
        for r in range(max(len(request.examples) for request in requests)):
            live = [k for k, request in enumerate(requests) if r < len(request.examples)]
            for k, loss in zip(live, self.evaluations([(requests[k].slot, requests[k].examples[r]) for k in live]), strict=True):
                losses[k].append(loss)
        return losses

    def evaluations(self, evaluations: Sequence[tuple["Slot", Sequence[Any]]]) -> list[float]:
        """Each (slot, examples)'s evaluation loss, at once.

        The slots' rows through the base model together (one packed forward, verl's infer_batch's settings), each loss
        as the slot's evaluation alone reports it. A schedule-free slot (evaluated at its averaged weights), a batch
        that does not split over the ranks, a cycle of one, and every evaluation where packing is refused: the slot's
        alone, in turn."""
        ranks = self.workers.group.world_size
        with self.lock:
            packable = [] if self.refused else [i for i, (slot, examples) in enumerate(evaluations) if len(examples) % ranks == 0 and not slot.averaged]
            results = dict(zip(packable, self._packed_evaluation([evaluations[i] for i in packable]))) if len(packable) > 1 else {}
            for i, (slot, examples) in enumerate(evaluations):
                if i not in results:
                    results[i] = self._on(slot, lambda: self.workers.evaluate(examples))
            return [results[i] for i in range(len(evaluations))]

    def _packed_evaluation(self, evaluations: Sequence[tuple["Slot", Sequence[Any]]]) -> list[float]:
        """Under the lock: one packed forward of `evaluations` (2 or more slots, each batch a multiple of the ranks)."""
        from verl.utils import tensordict_utils as tu

        for slot, _ in evaluations:
            self._check(slot)
        batch = self._packed_batch(evaluations)
        tu.assign_non_tensor(batch, slots_forward_only=True)
        self.loaded = None  # each rank parks its loaded slot first
        losses = self.workers.group.slots_forward_backward(batch).get().get_non_tensor("slot_losses")
        self.packed_evaluations[len(evaluations)] += 1
        return [float(losses[slot.index]) for slot, _ in evaluations]

    def _packed_batch(self, pairs: Sequence[tuple["Slot", Sequence[Any]]], build: Callable[[list], Any] | None = None) -> Any:
        """One batch of every (slot, examples)'s rows, in `packed_rows`' order, with the `SLOT` column.

        `build(rows)`: the workers' batch of them, by default the SFT examples' `_batch`."""
        import torch

        from tinker_exp.runtime.packed import SLOT

        order = packed_rows([len(examples) for _, examples in pairs], self.workers.group.world_size)
        batch = (build or self.workers._batch)([pairs[k][1][i] for k, i in order])
        batch[SLOT] = torch.tensor([pairs[k][0].index for k, _ in order])
        return batch

    def train_steps(self, steps: Sequence[tuple["Slot", Sequence[Any], dict[str, Any] | None]]) -> list[StepResult]:
        """One step of each (slot, examples, optim_step_params), at once.

        The slots' rows through the base model together (one packed forward and backward, runtime/packed.py), then every
        slot's optimizer step at its own values in one round trip; each result as the slot's step alone reports it. A
        step whose batch does not split evenly over the ranks, a cycle of one slot, and every step where packing is
        refused (`refused`): the slot's step alone, in turn (time-sharing)."""
        ranks = self.workers.group.world_size
        with self.lock:
            packable = [] if self.refused else [i for i, (_, examples, _) in enumerate(steps) if len(examples) % ranks == 0]
            for _, examples, _ in steps:
                if not self.refused and len(examples) % ranks and len(examples) not in self.unpacked:
                    self.unpacked.add(len(examples))
                    log.info(f"slots: a batch of {len(examples)} rows does not split over {ranks} ranks: its steps time-shared")
            results = dict(zip(packable, self._packed([steps[i] for i in packable]))) if len(packable) > 1 else {}
            for i, (slot, examples, optim_step_params) in enumerate(steps):
                if i not in results:
                    results[i] = self._on(slot, lambda: self.workers.train_step(examples, optim_step_params))
            return [results[i] for i in range(len(steps))]

    def _packed(self, steps: Sequence[tuple["Slot", Sequence[Any], dict[str, Any] | None]]) -> list[StepResult]:
        """Under the lock: one packed step of `steps` (2 or more slots, each batch a multiple of the ranks)."""
        for slot, _, _ in steps:
            self._check(slot)
        batch = self._packed_batch([(slot, examples) for slot, examples, _ in steps])
        self.loaded = None  # each rank parks its loaded slot first (and, should a call fail, holds none known here)
        losses = self.workers.group.slots_forward_backward(batch).get().get_non_tensor("slot_losses")
        stepped = self._optimizer_steps([(slot, params) for slot, _, params in steps])
        self.packed[len(steps)] += 1
        return [StepResult(loss=float(losses[slot.index]), grad_norm=grad_norm, applied=applied)
                for (slot, _, _), (grad_norm, applied) in zip(steps, stepped, strict=True)]

    def _optimizer_steps(self, steps: Sequence[tuple["Slot", dict[str, Any] | None]]) -> list[tuple[float, list]]:
        """Under the lock: each (slot, optim_step_params)'s optimizer step at its own values, in one round trip.

        Each step at its own clip too. Each slot is swapped in with its pending gradients, in turn. Returns each step's
        grad norm and every rank's param groups."""
        per_rank = self.workers.group.slots_optimizer_step([(slot.index, params or None) for slot, params in steps])
        self.loaded = steps[-1][0].index
        return [(next((float(r[k]["grad_norm"]) for r in per_rank if "grad_norm" in r[k]), float("nan")),
                 [r[k]["param_groups"] for r in per_rank]) for k in range(len(steps))]

    def _check(self, slot: "Slot") -> None:
        """Under the lock: `slot` holds its trial still; a call changes its state (a save marks it again after)."""
        if self.slots.get(slot.index) is not slot:
            raise RuntimeError(f"slot {slot.index} was freed: its trial has ended")
        if not self.keep_saved:
            self.holding.pop(slot.index, None)

    def _use(self, slot: "Slot") -> None:
        """Under the lock: `slot`'s trial in the engine."""
        self._check(slot)
        if self.loaded != slot.index:
            self.workers.group.slot_load(slot.index)  # done on every rank before the slot's call is asked
            self.loaded = slot.index
        self.workers.averaged = slot.averaged

    def _on(self, slot: "Slot", call: Callable[[], Any]) -> Any:
        """`call` (a group call) on `slot`'s trial, under the lock."""
        self._elsewhere(slot)
        with self.lock:
            self._use(slot)
            return call()

    def _free(self, slot: "Slot") -> None:
        self._elsewhere(slot)
        with self.lock:
            if self.slots.get(slot.index) is slot:
                self.workers.group.slot_free(slot.index)
                del self.slots[slot.index]
                self.holding.pop(slot.index, None)
                if self.loaded == slot.index:
                    self.loaded = None
        if self.on_free is not None:
            self.on_free()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Every slot's trial ends with the workers."""
        with self.lock:
            self.slots.clear()
            self.workers.shutdown(timeout_s)


class Slot:
    """One trial on a `SlotGroup`.

    The calls the loop makes on a whole group (train/protocols.py `Workers`), each on this slot's adapters, optimizer
    and RNG alone. `shutdown` frees the slot, not the group."""

    def __init__(self, group: SlotGroup, index: int, averaged: bool, stop: threading.Event | None = None):
        self.group, self.index = group, index
        self.averaged = averaged
        """Schedule-free: evaluations and exports at the averaged weights (as runtime/workers.py's)."""
        self.stop = stop or threading.Event()
        """Set: the trial is cancelled; its next step or evaluation raises KeyboardInterrupt."""
        self.weights_version = 0
        """Changes whenever this trial's weights do (a step, a loaded checkpoint): an RL trial's sampler reloads then."""

    def _stopped(self) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt

    def ready(self) -> None:
        """A slot is filled on a ready group."""

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult:
        """The step in the group's next cycle, packed with the other slots' steps waiting then (`SlotGroup.train_step`)."""
        self._stopped()
        result = self.group.train_step(self, examples, optim_step_params)
        self.weights_version += 1
        return result

    def evaluate(self, examples: Sequence[Any]) -> float:
        return self.evaluate_batches([examples])[0]

    def evaluate_batches(self, batches: Sequence[Sequence[Any]]) -> list[float]:
        """The evaluation of every batch in the group's next cycle.

        Packed with the other slots' evaluations waiting then (`SlotGroup.evaluate`)."""
        self._stopped()
        return self.group.evaluate(self, batches)

    def save_checkpoint(self, folder: Path, step: int) -> None:
        """The trial's checkpoint, as a run alone writes it (its adapters, optimizer, lr scheduler, RNG)."""
        self.group.save(self, folder, step)

    def load_checkpoint(self, folder: Path) -> None:
        """A checkpoint (this trial's, another's, or a run's alone with the same LoRA shape) into this slot.

        In place from the slot that saved it while its state as saved is at hand, else from the files (`SlotGroup.load`;
        either way the same state). One log line says which (a PBT exploit's line in the member's run log)."""
        log.info(f"checkpoint {self.group.load(self, Path(folder))}")
        self.weights_version += 1

    def export_adapter(self, folder: Path) -> int:
        return self.group._on(self, lambda: self.group.workers.export_adapter(folder))

    def export_weights(self) -> Any:
        """An RL trial's weights for its driver's sampler, whenever `weights_version` has changed.

        Its adapter, as runtime/rl_workers.py `RLWorkers.export_weights` gives it; `weights_version`: train/rl.py
        `Weights`."""
        return self.group._on(self, self.group.workers.export_weights)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """The trial ends: its slot is free for the next (the group and the other slots go on)."""
        self.group._free(self)



def packed_rows(sizes: Sequence[int], ranks: int) -> list[tuple[int, int]]:
    """A packed batch's rows as (which of the batches of `sizes` rows, which of its rows).

    Rank after rank, batch after batch, each batch's r-th chunk as verl chunks that batch alone for rank r (each size a
    multiple of `ranks`)."""
    return [(k, rank * (size // ranks) + i) for rank in range(ranks) for k, size in enumerate(sizes) for i in range(size // ranks)]


def folder_identity(folder: Path) -> tuple[int, int, int]:
    """A folder's identity, kept through its parent's rename: its device, inode and change time.

    A checkpoint is written aside and renamed into place (train/checkpoints.py). A folder made later on a freed inode
    has another identity."""
    found = os.stat(folder)
    return found.st_dev, found.st_ino, found.st_ctime_ns
