"""Slots: one worker group holding one base model with LoRA and K trials' adapters, each slot an independent trial.

The group builds the base model once. Each slot holds, on every rank, its own adapter weights (the rank's shards),
its own optimizer (state, param groups, lr scheduler), the optimizer config its clip comes from and its own torch
RNG. A slot's trial starts as a cold run of its seed does (runtime/lora.py `start_trial`: the one rule) and trains
by **time-sharing**: before a slot's call the group swaps its adapters, optimizer and RNG into the engine (nothing
when it is the slot already there), then verl's own forward_backward and optimizer_step run unchanged, so a slot's
step is bitwise the step its trial would take alone. The frozen base weights are never copied.

The driver sees a slot as a `Slot`: the calls the loop makes on a whole group (train/protocols.py `Workers`), so the
loop, the judges and the sinks do not know they share a model. Each trial's loop runs in its own driver thread;
the group's lock orders their calls (one slot's forward_backward and optimizer_step never interleave with
another's). A slot is freed (`Slot.shutdown`) and its index taken by the next trial (`SlotGroup.fill`) while the
others train; `SlotGroup.copy` copies one slot's whole state onto another's (a PBT exploit) in place.

Worker side: `WorkerSlots` (held by every rank's worker, runtime/workers.py `worker_extras`). Driver side:
`SlotGroup` and `Slot`. docs/slots.md says what is measured, and what is not wired yet.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinker_exp.config import OptimizerConfig, TrainerConfig
from tinker_exp.errors import ConfigError
from tinker_exp.train.protocols import StepResult


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


class WorkerSlots:
    """A rank's slots over its engine (verl's FSDP engine with LoRA). At most one slot is loaded: its adapters in
    the parameters, its optimizer, lr scheduler and config the engine's, its RNG torch's. Every other is parked in
    its `SlotState`."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.trained = [p for p in engine.module.parameters() if p.requires_grad]
        if not self.trained or not any("lora_" in n for n, _ in engine.module.named_parameters()):
            raise ValueError("slots need a LoRA model (lora.rank > 0): full fine-tuning keeps one trial per group")
        self.states: dict[int, SlotState] = {}
        self.loaded: int | None = None

    def fill(self, index: int, optimizer_config: Any, seed: int) -> None:
        """Slot `index` takes a new trial (`seed`, built with `optimizer_config`) and is loaded: its adapters and RNG
        as a cold run of `seed` starts, a new optimizer (no state) and lr scheduler."""
        from tinker_exp.runtime.lora import start_trial

        self.park()
        self.states.pop(index, None)
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

    def park(self) -> None:
        """The loaded slot's adapters, pending gradients and RNG moved into its state; the engine holds no slot
        after."""
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

    def copy(self, source: int, target: int) -> None:
        """Slot `target`'s trial becomes a copy of `source`'s: adapters, optimizer state and param groups, lr
        scheduler, optimizer config, RNG (a PBT exploit, in place: nothing goes through the driver or a disk)."""
        self.park()
        src = self.states[source]
        engine = self.engine
        optimizer = engine._build_optimizer(engine.module)
        optimizer.load_state_dict(copy.deepcopy(src.optimizer.state_dict()))  # deep: torch's load keeps aliases
        lr_scheduler = engine._build_lr_scheduler(optimizer)
        lr_scheduler.load_state_dict(copy.deepcopy(src.lr_scheduler.state_dict()))
        self.states[target] = SlotState(
            src.seed, [t.clone() for t in src.adapters], optimizer, lr_scheduler, src.optimizer_config,
            src.rng.clone(), copy.deepcopy(src.cuda_rng), None if src.grads is None else [g.clone() for g in src.grads],
        )

    def memory(self) -> dict[str, int]:
        """This rank's bytes per slot: its adapters' shards and its optimizer's state tensors (the base weights,
        shared, are not counted); the loaded slot's adapters are the parameters themselves."""
        import torch

        def size(tensors) -> int:
            local = (getattr(t, "_local_tensor", t) for t in tensors if isinstance(t, torch.Tensor))
            return sum(t.numel() * t.element_size() for t in local)

        sizes = {}
        for index, state in self.states.items():
            adapters = self.trained if index == self.loaded else state.adapters
            optimizer_state = [v for per_param in state.optimizer.state.values() for v in per_param.values()]
            sizes[index] = size(adapters) + size(optimizer_state) + size(state.grads or [])
        return sizes

    def _install(self, state: SlotState) -> None:
        engine = self.engine
        engine.optimizer, engine.lr_scheduler = state.optimizer, state.lr_scheduler
        engine.optimizer_config = state.optimizer_config
        engine.checkpoint_manager.optimizer, engine.checkpoint_manager.lr_scheduler = state.optimizer, state.lr_scheduler


class SlotGroup:
    """K slots on one LoRA worker group (runtime/workers.py `TinkerWorkers`, built and ready): `fill` gives a trial a
    `Slot`. Every call of every slot goes through `lock`, which also keeps the loaded slot: a slot's call swaps it
    in (one round trip) only when another slot's trial is there."""

    def __init__(self, workers: Any, capacity: int, on_free: Callable[[], None] | None = None):
        """`workers`: a ready LoRA group, owned by this group from now on (`shutdown` frees it); `capacity`: K;
        `on_free`: called once a slot is freed (a waiting trial may take it)."""
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
        self.loading: list = []  # a swap asked and not yet checked (runtime/workers.py slot_load)
        workers.group.enable_slots()

    def fill(
        self, optimizer: OptimizerConfig, trainer: TrainerConfig, optimizer_values: dict[str, Any], index: int | None = None,
        stop: threading.Event | None = None, kind: type["Slot"] | None = None,
    ) -> "Slot":
        """A new trial (its optimizer, its seed trainer.seed) on a free slot (the lowest, or `index`) while the others
        train; it starts as a cold run of the same config does. `stop`: once set, the slot's next step or evaluation
        raises KeyboardInterrupt in its trial (a cancelled trial stops as a Ctrl-C'd run stops). `kind`: the Slot
        class (a served client's: runtime/serve_workers.py `ServedSlot`)."""
        from tinker_exp.optim.optimizers import spec_of

        with self.lock:
            free = [i for i in range(self.capacity) if i not in self.slots]
            if index is None and not free:
                raise RuntimeError(f"all {self.capacity} slots hold a trial: free one first")
            index = free[0] if index is None else index
            if index in self.slots or not 0 <= index < self.capacity:
                raise RuntimeError(f"slot {index} is not free (slots 0..{self.capacity - 1}, free: {free})")
            config = self.workers._worker_config(self.workers.backend, optimizer, trainer, self.workers.model_path, optimizer_values)
            self.workers.group.slot_fill(index, config.optimizer_config, trainer.seed)
            self.loaded = index
            slot = (kind or Slot)(self, index, spec_of(optimizer.name.value).averaged, stop)
            self.slots[index] = slot
            return slot

    def copy(self, source: "Slot", target: "Slot") -> None:
        """`target`'s trial becomes `source`'s state, in place on every rank (a PBT exploit): its next steps are
        bitwise the ones `source` would take with the same batches and values."""
        with self.lock:
            self.workers.group.slot_copy(source.index, target.index)
            self.loaded = None
            target.averaged = source.averaged

    def memory(self) -> dict[int, int]:
        """Bytes each slot holds on rank 0 (adapters and optimizer state)."""
        with self.lock:
            return self.workers.group.slot_memory()[0]

    def _use(self, slot: "Slot") -> None:
        """Under the lock: `slot`'s trial in the engine."""
        if self.slots.get(slot.index) is not slot:
            raise RuntimeError(f"slot {slot.index} was freed: its trial has ended")
        if self.loaded != slot.index:
            self.loading = self.workers.group.slot_load(slot.index)  # each rank's ref; the slot's call runs after it
            self.loaded = slot.index
        self.workers.averaged = slot.averaged

    def _on(self, slot: "Slot", call: Callable[[], Any]) -> Any:
        """`call` (a group call) on `slot`'s trial, under the lock; a swap it needed is checked after it."""
        with self.lock:
            self._use(slot)
            try:
                return call()
            finally:
                loading, self.loading = self.loading, []
                if loading:
                    import ray

                    ray.get(loading)

    def _free(self, slot: "Slot") -> None:
        with self.lock:
            if self.slots.get(slot.index) is slot:
                self.workers.group.slot_free(slot.index)
                del self.slots[slot.index]
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
    """One trial on a `SlotGroup`: the calls the loop makes on a whole group (train/protocols.py `Workers`), each
    on this slot's adapters, optimizer and RNG alone. `shutdown` frees the slot, not the group."""

    def __init__(self, group: SlotGroup, index: int, averaged: bool, stop: threading.Event | None = None):
        self.group, self.index = group, index
        self.averaged = averaged
        """Schedule-free: evaluations and exports at the averaged weights (as runtime/workers.py's)."""
        self.stop = stop or threading.Event()
        """Set: the trial is cancelled; its next step or evaluation raises KeyboardInterrupt."""

    def _stopped(self) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt

    def ready(self) -> None:
        """A slot is filled on a ready group."""

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult:
        self._stopped()
        return self.group._on(self, lambda: self.group.workers.train_step(examples, optim_step_params))

    def evaluate(self, examples: Sequence[Any]) -> float:
        self._stopped()
        return self.group._on(self, lambda: self.group.workers.evaluate(examples))

    def save_checkpoint(self, folder: Path, step: int) -> None:
        """The trial's checkpoint, as a run alone writes it (its adapters, optimizer, lr scheduler, RNG)."""
        self.group._on(self, lambda: self.group.workers.save_checkpoint(folder, step))

    def load_checkpoint(self, folder: Path) -> None:
        """A checkpoint (this trial's, another's, or a run's alone with the same LoRA shape) into this slot."""
        self.group._on(self, lambda: self.group.workers.load_checkpoint(folder))

    def export_adapter(self, folder: Path) -> int:
        return self.group._on(self, lambda: self.group.workers.export_adapter(folder))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """The trial ends: its slot is free for the next (the group and the other slots go on)."""
        self.group._free(self)

