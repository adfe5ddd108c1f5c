"""Slots (runtime/slots.py) on real verl workers: one LoRA group (2 Ray CPU gloo ranks, FSDP2) for the module.

First each trial trains alone through run.run on that group before it holds slots: trial A cold (the group's build),
the others on the pool's fresh start (a rebuild with their seed: bitwise a cold run, tests/test_pool.py). Then the
group holds 3 slots and the trials train through run.run again, each run in its own driver thread on a `Slot`, at
once (their steps packed when they wait for the same cycle): with different seeds, lr schedules, lrs and gradient
clips (B evaluating every 2 steps), every logged row is the trial's alone within `PACKED_RELATIVE` and the exported
adapter within `PACKED_ADAPTER_RELATIVE` (a packed step, runtime/packed.py; a time-shared one is bitwise). Three
trials packed in every step for 21 steps against each alone: the same bounds. A slot freed (A finished) takes trial
D while B is held mid-run and C trains on; a trial's run resumed on a slot from its checkpoint continues bitwise; one slot's state copied onto another (a PBT exploit)
trains on as the source does; a checkpoint another slot saved loads in place while its saver's state as saved is at
hand (live, or kept in a population's group), bitwise as its load from disk.
"""

from __future__ import annotations

import shutil
import threading

import pytest

from helpers import (
    PACKED_ADAPTER_RELATIVE,
    PACKED_RELATIVE,
    adapters_difference,
    assert_adapters_close,
    assert_rows_close,
    compose,
    read_jsonl,
    relative,
    without_timings,
)

LORA = ["lora=r8", "logger=none", "checkpoint.every_steps=2"]
TRIALS = {
    "A": ["trainer.eval_every=0", "trainer.seed=1", "trainer.steps=2", "+override.lr=5e-3"],
    "B": ["trainer.eval_every=2", "trainer.seed=2", "trainer.steps=4", "+override=lr_cosine", "optimizer.lr=4e-3"],
    "C": ["trainer.eval_every=0", "trainer.seed=3", "trainer.steps=3", "+override.lr=2e-3", "optimizer.clip_grad=0.05"],
    "D": ["trainer.eval_every=0", "trainer.seed=4", "trainer.steps=2", "+override.lr=1e-2"],
}
ADAPTER = "adapter/adapter_model.safetensors"
FIRST_STEP_RELATIVE = 1e-6
"""A packed first step's loss against alone's: one forward at the same weights, only the matrix products' sizes differ
(bitwise on some CPUs; 8.0e-8 on an AVX-512 AMD EPYC, 2026-12-07)."""
WAIT_S = 300  # a margin, never a pace: events end every wait


class Shared:
    """The module's one LoRA group: the TinkerWorkers run.run trains on (its shutdown left to the module), then the
    SlotGroup over them."""

    def __init__(self):
        self.workers = None
        self.slots = None

    def alone(self, cfg, plan, model_path, run_dir):
        """start_workers for a trial alone: the group built (cold) for the first, a fresh start for each next."""
        from tinker_exp.runtime.workers import TinkerWorkers

        if self.workers is None:
            class Kept(TinkerWorkers):
                def shutdown(self, timeout_s: float = 10.0) -> None:
                    """The run's end leaves the group to the module."""

                def free(self) -> None:
                    TinkerWorkers.shutdown(self)

            self.workers = Kept(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu", lora=cfg.lora)
            return self.workers
        self.workers.start_fresh(cfg.optimizer, cfg.trainer, plan.optimizer_values, self.workers.output)
        return self.workers

    def slot(self, cfg, plan, model_path, run_dir, index: int | None = None):
        """start_workers for a trial on a slot: the lowest free one, or `index`."""
        return self.slots.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values, index)


def run_trial(name: str, run_dir, start_workers, *extra: str):
    from tinker_exp.place import GivenWorkers
    from tinker_exp.run import run

    run(compose(*LORA, *TRIALS[name], *extra), run_dir, place=GivenWorkers(start_workers))
    return run_dir


@pytest.fixture(scope="module")
def trained(ray_address, tmp_path_factory):
    from tinker_exp.runtime.slots import SlotGroup

    shared = Shared()
    root = tmp_path_factory.mktemp("slots")
    try:
        alone = {name: run_trial(name, root / f"alone_{name}", shared.alone) for name in TRIALS}
        shared.slots = SlotGroup(shared.workers, 3)

        d_filled, b_held, errors = threading.Event(), threading.Event(), []
        slot_of: dict[str, int] = {}

        def on_slot(name: str):
            def start(cfg, plan, model_path, run_dir):
                slot = shared.slot(cfg, plan, model_path, run_dir, slot_of["A"] if name == "D" else None)
                slot_of[name] = slot.index
                if name == "D":
                    slot_of["D while"] = sorted(shared.slots.slots)  # the slots holding a trial as D takes its own
                    d_filled.set()
                if name == "B":  # held after its second step until D holds a slot: D fills while B is mid-run
                    step, train_step = [0], slot.train_step

                    def held(examples, params):
                        if step[0] == 2:
                            b_held.set()
                            assert d_filled.wait(WAIT_S), "trial D never took a slot"
                        step[0] += 1
                        return train_step(examples, params)

                    slot.train_step = held
                return slot

            return start

        def trial(name: str, then: str | None = None):
            try:
                run_trial(name, root / f"slot_{name}", on_slot(name))
                if then is not None:  # A's slot, freed as its run ended, takes the next trial
                    run_trial(then, root / f"slot_{then}", on_slot(then))
            except BaseException as e:  # noqa: BLE001  (raised in the test's thread below)
                errors.append(e)
                d_filled.set()

        threads = [threading.Thread(target=trial, args=args) for args in (("A", "D"), ("B",), ("C",))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads)
        yield {"root": root, "alone": alone, "slot_of": slot_of, "b_held": b_held.is_set(), "shared": shared}
    finally:
        if shared.workers is not None:
            shared.workers.free()


def test_trials_on_slots_at_once_are_each_trained_alone(trained):
    root, alone = trained["root"], trained["alone"]
    for name in "ABC":
        assert_rows_close(read_jsonl(root / f"slot_{name}" / "metrics.jsonl"), read_jsonl(alone[name] / "metrics.jsonl"))
        assert_adapters_close(root / f"slot_{name}" / ADAPTER, alone[name] / ADAPTER)
    assert {trained["slot_of"][name] for name in "ABC"} == {0, 1, 2}
    assert ["val/loss" in row for row in read_jsonl(root / "slot_B" / "metrics.jsonl")] == [False, True, False, True]
    losses = [read_jsonl(alone[name] / "metrics.jsonl")[1]["train/loss"] for name in "ABC"]
    assert len(set(losses)) == 3  # different trials: the equality above is each trial's own


def test_a_freed_slot_takes_a_new_trial_while_the_others_train(trained):
    root, slot_of = trained["root"], trained["slot_of"]
    assert slot_of["D"] == slot_of["A"] and trained["b_held"]
    assert slot_of["B"] in slot_of["D while"]  # B mid-run (held there) as D took A's slot
    assert_rows_close(read_jsonl(root / "slot_D" / "metrics.jsonl"), read_jsonl(trained["alone"]["D"] / "metrics.jsonl"))
    assert_adapters_close(root / "slot_D" / ADAPTER, trained["alone"]["D"] / ADAPTER)


def test_a_trial_resumed_on_a_slot_continues_bitwise(trained, tmp_path):
    """Trial B's run alone (time-shared steps: bitwise whatever the group's other trials do), stopped before its last
    save and resumed on a slot: it continues bitwise."""
    whole = trained["alone"]["B"]
    resumed = tmp_path / "resumed_B"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")  # as if stopped before its last save
    run_trial("B", resumed, trained["shared"].slot)
    rows = read_jsonl(resumed / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == [0, 1, 2, 3]
    assert without_timings(rows) == without_timings(read_jsonl(whole / "metrics.jsonl"))
    assert (resumed / ADAPTER).read_bytes() == (whole / ADAPTER).read_bytes()


def test_a_trial_trained_beside_others_resumes_from_its_checkpoint(trained, tmp_path):
    """Trial B as it trained at once with A and C (its steps packed with theirs when they waited together), stopped
    before its last save and resumed on a slot alone: its step-2 checkpoint holds what its packed steps left (the
    format a run alone writes), and its last step is the original's within a packed step's bounds."""
    whole = trained["root"] / "slot_B"
    resumed = tmp_path / "resumed_slot_B"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run_trial("B", resumed, trained["shared"].slot)
    rows = read_jsonl(resumed / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == [0, 1, 2, 3]
    assert_rows_close(rows, read_jsonl(whole / "metrics.jsonl"))
    assert_adapters_close(resumed / ADAPTER, whole / ADAPTER)


def test_a_slot_copied_onto_another_trains_on_as_the_source(trained, tmp_path):
    """A PBT exploit in place: the target's adapter, optimizer state and RNG become the source's."""
    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.train.data import dataset_rows

    group = trained["shared"].slots
    cfg = config.load(compose(*LORA, *TRIALS["B"]))  # 4 planned steps
    plan = validate(cfg)
    examples = load_examples(cfg.data, model_dir(cfg.model), dataset_rows(cfg.data)[0], [])[0].examples[:8]
    source = group.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values)
    other = config.load(compose(*LORA, *TRIALS["C"]))
    target = group.fill(other.optimizer, other.trainer, validate(other).optimizer_values)
    try:
        for step in range(2):
            source.train_step(examples, plan[step])
            target.train_step(examples[::-1], plan[step])
        group.copy(source, target)
        after = [slot.train_step(examples, plan[2]) for slot in (source, target)]
        assert after[0].loss == after[1].loss and after[0].grad_norm == after[1].grad_norm
        for slot in (source, target):
            slot.export_adapter(tmp_path / f"adapter_{slot.index}")
        read = lambda slot: (tmp_path / f"adapter_{slot.index}" / "adapter_model.safetensors").read_bytes()  # noqa: E731
        assert read(source) == read(target)
        assert group.memory()[source.index] == group.memory()[target.index] > 0
    finally:
        source.shutdown()
        target.shutdown()


@pytest.mark.parametrize("keep_saved", [False, True], ids=["live", "kept"])
def test_a_checkpoint_another_slot_saved_loads_in_place_and_bitwise_as_from_disk(trained, tmp_path, caplog, keep_saved):
    """A PBT exploit between trials of one group: the member's slot loads the donor's boundary checkpoint (written
    aside and renamed into place, as the loop saves it). The donor's state as saved is at hand while its slot has not
    been called since (live), or, in a group that keeps each slot's state at its last save (a population's), while it
    trains on (kept): then it is copied in place (the checkpoint's files zeroed meanwhile: none is read). Once
    it is not (the donor's next step; kept: the donor freed), the files are read. The two members, trained apart
    before, then train bitwise alike (each keeps its own clip, as a load does: a checkpoint holds none)."""
    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.train.checkpoints import WORKERS, begin_save, commit_save
    from tinker_exp.train.data import dataset_rows

    group = trained["shared"].slots
    group.keep_saved = keep_saved
    member = [o if not o.startswith("trainer.steps=") else "trainer.steps=4" for o in TRIALS["C"]]  # 2 steps after the load
    cfg, member_cfg = config.load(compose(*LORA, *TRIALS["B"])), config.load(compose(*LORA, *member))
    plan, member_plan = validate(cfg), validate(member_cfg)
    examples = load_examples(cfg.data, model_dir(cfg.model), dataset_rows(cfg.data)[0], [])[0].examples[:8]
    donor = group.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values)
    in_place, from_disk = (group.fill(member_cfg.optimizer, member_cfg.trainer, member_plan.optimizer_values) for _ in range(2))
    try:
        for step in range(2):
            donor.train_step(examples, plan[step])
            in_place.train_step(examples[::-1], member_plan[step])  # the members apart: each load must give all of their state
            from_disk.train_step(examples[1:] + examples[:1], member_plan[step])
        partial = begin_save(tmp_path / "checkpoints", 2)
        donor.save_checkpoint(partial / WORKERS, 2)
        saved = commit_save(partial, 2, {}) / WORKERS
        files = {path: path.read_bytes() for path in saved.rglob("*") if path.is_file()}
        moves_on = (donor.train_step, (examples, plan[2])) if not keep_saved else (donor.shutdown, ())  # its state as saved gone
        with caplog.at_level("INFO", logger="tinker_exp.runtime.slots"):
            if keep_saved:
                donor.train_step(examples, plan[2])  # kept: the donor trains on, its state as saved still at hand
            for path, data in files.items():  # the checkpoint's files zeroed in place (the folder itself untouched):
                path.write_bytes(bytes(len(data)))  # an in-place load reads none of them
            in_place.load_checkpoint(saved)
            for path, data in files.items():
                path.write_bytes(data)
            moves_on[0](*moves_on[1])
            from_disk.load_checkpoint(saved)
        said = [r.getMessage() for r in caplog.records if r.name == "tinker_exp.runtime.slots"]
        assert said[-2:] == [
            f"checkpoint {saved.parent}: taken in place from slot {donor.index + 1}, which saved it (nothing read from disk)",
            f"checkpoint {saved.parent}: loaded from disk (no other slot of this group holds its state now)",
        ]  # fmt: skip
        for step in (2, 3):
            a, b = (member.train_step(examples, member_plan[step]) for member in (in_place, from_disk))
            assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm), step
        for member in (in_place, from_disk):
            member.export_adapter(tmp_path / f"adapter_{member.index}")
        read = lambda slot: (tmp_path / f"adapter_{slot.index}" / "adapter_model.safetensors").read_bytes()  # noqa: E731
        assert read(in_place) == read(from_disk)
    finally:
        group.keep_saved = False
        for slot in (donor, in_place, from_disk):
            slot.shutdown()


def test_packed_steps_are_each_trial_alone_within_the_bound(trained, tmp_path):
    """Trials A, B and C (their seeds, lrs, schedules, clips; 21 planned steps, each its own batches) step by step:
    each alone on a slot (time-shared: bitwise a run alone), then the three again on fresh slots, packed in every
    step: 20 steps in the group's cycle (`train_steps`), the 21st through each trial's `Slot.train_step` in its own
    thread, the three waiting for one cycle. The first step's losses within FIRST_STEP_RELATIVE, every loss and grad
    norm within PACKED_RELATIVE, the exported adapters within PACKED_ADAPTER_RELATIVE, the applied values equal; the group counts
    21 packed steps of 3. Each row's first token is in the loss, so a slot's last label counts (a mutation that drops
    `roll_within` fails it, and so does one that normalises a slot's loss by all slots' tokens). Then each trial's
    evaluation of its own batch, alone and then the three packed in one forward: each within PACKED_RELATIVE."""
    from dataclasses import replace

    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.train.data import dataset_rows

    group, steps = trained["shared"].slots, 21
    cfgs = [config.load(compose(*LORA, *TRIALS[name], f"trainer.steps={steps}")) for name in "ABC"]
    plans = [validate(cfg) for cfg in cfgs]
    examples = load_examples(cfgs[0].data, model_dir(cfgs[0].model), dataset_rows(cfgs[0].data)[0], [])[0].examples
    # every row's first token in the loss too, and not the same token in every row (the template's): the label of a
    # slot's last token in a packed micro-batch then counts (runtime/packed.py `roll_within`)
    examples = [replace(e, input_ids=e.input_ids[i % 3 :], loss_mask=[1, *e.loss_mask[i % 3 + 1 :]]) for i, e in enumerate(examples)]
    batch = lambda k, step: [examples[(8 * (k + step) + i) % len(examples)] for i in range(8)]  # noqa: E731

    def fill():
        return [group.fill(cfg.optimizer, cfg.trainer, plan.optimizer_values) for cfg, plan in zip(cfgs, plans, strict=True)]

    def export(slots, name):
        for k, slot in enumerate(slots):
            slot.export_adapter(tmp_path / f"{name}_{k}")
            slot.shutdown()

    held_out = lambda k: batch(k, steps + 2 * k)  # noqa: E731  (each trial's own evaluation batch)
    slots = fill()
    alone = [[group.train_steps([(slot, batch(k, step), plans[k][step])])[0] for step in range(steps)] for k, slot in enumerate(slots)]
    evaluated_alone = [group.evaluations([(slot, held_out(k))])[0] for k, slot in enumerate(slots)]
    export(slots, "alone")
    before = group.packed[3]
    slots = fill()
    packed = [group.train_steps([(slot, batch(k, step), plans[k][step]) for k, slot in enumerate(slots)]) for step in range(steps - 1)]
    results = in_one_cycle(group, [(s, batch(k, steps - 1), plans[k][steps - 1]) for k, s in enumerate(slots)])
    packed.append([results[s.index] for s in slots])
    evaluations_before = group.packed_evaluations[3]
    evaluated_packed = group.evaluations([(slot, held_out(k)) for k, slot in enumerate(slots)])
    export(slots, "packed")
    assert group.packed[3] - before == steps and group.packed_evaluations[3] - evaluations_before == 1
    assert len(set(evaluated_alone)) == 3  # three trials' own losses
    for mine, theirs in zip(evaluated_packed, evaluated_alone, strict=True):  # a packed evaluation: each its own
        assert relative(mine, theirs) <= PACKED_RELATIVE, (evaluated_packed, evaluated_alone)
    worst = {"loss": 0.0, "grad_norm": 0.0, "adapter": 0.0}
    for k in range(3):
        # the first step's forward: the same weights, only the products' sizes differ (bitwise on some CPUs; 8e-8 on
        # an AVX-512 AMD EPYC, whose kernels block a longer product otherwise)
        assert relative(packed[0][k].loss, alone[k][0].loss) <= FIRST_STEP_RELATIVE, (packed[0][k].loss, alone[k][0].loss)
        for step in range(steps):
            mine, theirs = packed[step][k], alone[k][step]
            assert mine.applied == theirs.applied, (k, step)
            for key in ("loss", "grad_norm"):
                worst[key] = max(worst[key], relative(getattr(mine, key), getattr(theirs, key)))
        adapter = adapters_difference(*(tmp_path / f"{side}_{k}" / "adapter_model.safetensors" for side in ("packed", "alone")))
        worst["adapter"] = max(worst["adapter"], adapter)
    assert max(worst["loss"], worst["grad_norm"]) <= PACKED_RELATIVE and worst["adapter"] <= PACKED_ADAPTER_RELATIVE, worst
    print(f"largest relative differences, packed against alone over {steps} steps of 3 trials: {worst}")


class FakeSlotWorkers:
    """Bookkeeping only: a LoRA group's workers as SlotGroup calls them, each call recorded. A packed step's loss for
    a slot is its index, its grad norm the lr it was sent; a time-shared step's the same."""

    def __init__(self, refused: str | None = None, ranks: int = 2):
        from types import SimpleNamespace

        self.lora, self.averaged, self.calls, self.fail = object(), False, [], None
        self.backend = self.model_path = None
        self.group = SimpleNamespace(
            world_size=ranks,
            enable_slots=lambda: [refused] * ranks,
            slot_fill=lambda index, optimizer_config, seed: None,
            slot_load=lambda index: [],
            slots_forward_backward=self.slots_forward_backward,
            slots_optimizer_step=self.slots_optimizer_step,
        )

    def _worker_config(self, *args):
        from types import SimpleNamespace

        return SimpleNamespace(optimizer_config=None)

    def optimizer_config_of(self, worker_config):
        return worker_config.optimizer_config

    def _batch(self, rows: list) -> dict:
        return {"rows": rows}

    def slots_forward_backward(self, batch: dict):
        from types import SimpleNamespace

        if self.fail is not None:
            raise self.fail
        owners = list(dict.fromkeys(batch["slot"].tolist()))
        self.calls.append(("packed", owners, batch["rows"]))
        losses = {index: float(index) for index in owners}
        return SimpleNamespace(get=lambda: SimpleNamespace(get_non_tensor=lambda key: losses))

    def slots_optimizer_step(self, steps: list) -> list:
        return [[{"grad_norm": params["lr"], "param_groups": []} for _, params in steps] for _ in range(self.group.world_size)]

    def train_step(self, examples: list, optim_step_params: dict):
        from tinker_exp.train.protocols import StepResult

        self.calls.append(("alone", len(examples)))
        return StepResult(loss=float(examples[0][0]), grad_norm=optim_step_params["lr"], applied=[])

    def evaluate(self, examples: list) -> float:
        self.calls.append(("alone", examples))
        return float(examples[0][0])


def fake_group(k: int, **kwargs):
    from tinker_exp import config
    from tinker_exp.runtime.slots import SlotGroup

    cfg = config.load(compose(*LORA))
    group = SlotGroup(FakeSlotWorkers(**kwargs), k)
    return group, [group.fill(cfg.optimizer, cfg.trainer, {}) for _ in range(k)]


def calls_in_one_cycle(group, calls: dict) -> dict:
    """Each of `calls` (key -> a slot's call) in its own thread, all waiting before the group's lock is let go, so one
    cycle takes them: key -> its result, or the error it raised."""
    results: dict = {}

    def call(key, made):
        try:
            results[key] = made()
        except Exception as e:  # noqa: BLE001  (the test reads it)
            results[key] = e

    with group.lock:
        threads = [threading.Thread(target=call, args=each) for each in calls.items()]
        for thread in threads:
            thread.start()
        with group.waiting_changed:
            assert group.waiting_changed.wait_for(lambda: len(group.waiting) == len(calls), WAIT_S)
    for thread in threads:
        thread.join(WAIT_S)
    return results


def in_one_cycle(group, steps: list) -> dict:
    """Each (slot, examples, params) of `steps` through Slot.train_step, in one cycle: slot index -> its result, or
    the error it raised."""
    return calls_in_one_cycle(group, {slot.index: (lambda s=slot, e=examples, p=params: s.train_step(e, p)) for slot, examples, params in steps})


def rows(index: int, n: int) -> list[str]:
    """Slot `index`'s batch of n rows (named by slot and row)."""
    return [f"{index}{row}" for row in range(n)]


def test_a_cycle_packs_every_step_waiting_and_hands_each_its_own_result():
    """Three trials' steps waiting at once: one packed step whose batch is, rank after rank, each slot's chunk of its
    own batch as that rank would take it alone; each trial gets its own slot's result."""
    group, slots = fake_group(3)
    results = in_one_cycle(group, [(slot, rows(slot.index, 4), {"lr": slot.index + 1}) for slot in slots])
    [(kind, order, packed)] = group.workers.calls
    assert kind == "packed" and sorted(order) == [0, 1, 2]  # in the order the steps waited
    assert packed == [r for rank in range(2) for i in order for r in rows(i, 4)[2 * rank : 2 * rank + 2]]
    assert [(results[i].loss, results[i].grad_norm) for i in range(3)] == [(0.0, 1), (1.0, 2), (2.0, 3)]
    assert group.packed == {3: 1}
    slots[1].train_step(rows(1, 4), {"lr": 5})  # nothing else waiting: its step alone
    assert group.workers.calls[-1] == ("alone", 4) and group.packed == {3: 1}


def test_the_next_cycle_gathers_the_trials_the_last_one_served(monkeypatch):
    """After a packed cycle, the first trial back waits for the others the cycle served (their driver work between
    steps) instead of running its step alone, until each is back or makes another call (a checkpoint)."""
    from tinker_exp.runtime import slots as slots_module

    monkeypatch.setattr(slots_module, "GATHER_FRACTION", 10 * WAIT_S)
    monkeypatch.setattr(slots_module, "GATHER_MAX_S", 10 * WAIT_S)  # so only the trials' arrivals end a gathering
    group, slots = fake_group(3)
    group.last_cycle_s = 1.0
    in_one_cycle(group, [(slot, rows(slot.index, 2), {"lr": 1.0}) for slot in slots])
    assert group.expected == {0, 1, 2}

    def back(slot) -> threading.Thread:
        thread = threading.Thread(target=slot.train_step, args=(rows(slot.index, 2), {"lr": 1.0}))
        thread.start()
        return thread

    def gathering(waiting: int) -> bool:
        with group.waiting_changed:
            return group.waiting_changed.wait_for(lambda: group.cycling and len(group.waiting) == waiting, WAIT_S)

    first = back(slots[2])
    assert gathering(1)  # its cycle waits for slots 0 and 1
    others = [back(slots[0]), back(slots[1])]
    for thread in [first, *others]:
        thread.join(WAIT_S)
    assert group.workers.calls[-1][:2] == ("packed", [2, 0, 1]) and group.packed == {3: 2}

    first = back(slots[0])
    assert gathering(1)
    group._on(slots[1], lambda: None)  # slot 1 saves a checkpoint: the cycle goes on without it
    second = back(slots[2])
    for thread in (first, second):
        thread.join(WAIT_S / 10)
    assert not first.is_alive() and not second.is_alive()  # not the gathering's bound: the call ended it
    assert group.workers.calls[-1][:2] == ("packed", [0, 2])


def test_a_trials_evaluation_of_several_batches_is_one_cycle_each_round_packing_every_trials_next_batch(monkeypatch):
    """Two trials evaluating at once, one of 3 batches and one of 2: one cycle, its rounds each a packed forward of
    every trial's next batch (the last batch, one trial's alone, time-shared); each trial gets its batches' losses in
    order, as evaluating each batch alone gives them."""
    from verl.utils import tensordict_utils

    monkeypatch.setattr(tensordict_utils, "assign_non_tensor", lambda batch, **values: batch.update(values))
    group, slots = fake_group(2)
    batches = {0: [rows(0, 2), rows(0, 2), rows(0, 2)], 1: [rows(1, 2), rows(1, 2)]}
    cycles = []
    rounds_of = group._evaluation_rounds
    monkeypatch.setattr(group, "_evaluation_rounds", lambda requests: (cycles.append(len(requests)), rounds_of(requests))[1])
    results = calls_in_one_cycle(group, {slot.index: (lambda s=slot: s.evaluate_batches(batches[s.index])) for slot in slots})
    assert cycles == [2]  # one cycle for both whole evaluations
    assert [call[:2] for call in group.workers.calls] == [("packed", [0, 1]), ("packed", [0, 1]), ("alone", rows(0, 2))]
    assert results == {0: [0.0, 0.0, 0.0], 1: [1.0, 1.0]}
    assert group.packed_evaluations == {2: 2}
    assert slots[1].evaluate(rows(1, 2)) == 1.0 and group.workers.calls[-1] == ("alone", rows(1, 2))


def test_trials_arriving_together_take_their_first_step_in_one_cycle(monkeypatch):
    """Trials filled one after another (a sweep's first K): the first one's step waits for the others while they
    arrive, until the group is full and each has asked, then all step in one packed cycle (lock-step from there);
    a trial filled alone, with none before it, does not wait."""
    from tinker_exp import config
    from tinker_exp.runtime import slots as slots_module

    monkeypatch.setattr(slots_module, "ARRIVAL_GAP_S", 10 * WAIT_S)  # so only the trials' arrivals end the wait
    group, [first] = fake_group(1)
    first.train_step(rows(0, 2), {"lr": 1.0})  # alone in the group, and no trial arriving: at once
    assert group.workers.calls == [("alone", 2)]
    group.workers.calls.clear()
    group.capacity = 3
    cfg = config.load(compose(*LORA))
    second = group.fill(cfg.optimizer, cfg.trainer, {})  # a second trial right after: trials arrive
    results: dict = {}

    def step(slot) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.setdefault(slot.index, slot.train_step(rows(slot.index, 2), {"lr": 1.0})))
        thread.start()
        return thread

    def waiting(n: int) -> bool:
        with group.waiting_changed:
            return group.waiting_changed.wait_for(lambda: len(group.waiting) == n, WAIT_S)

    threads = [step(first), step(second)]
    assert waiting(2) and group.workers.calls == []  # both asked; a slot is free and trials arrive: no cycle yet
    third = group.fill(cfg.optimizer, cfg.trainer, {})
    assert waiting(2) and group.workers.calls == []  # full, but the third has not asked
    threads.append(step(third))
    for thread in threads:
        thread.join(WAIT_S)
    assert [call[:2] for call in group.workers.calls] == [("packed", [0, 1, 2])] and sorted(results) == [0, 1, 2]


def test_a_packed_steps_error_is_raised_in_every_waiting_trial():
    """A packed call that fails: every trial whose step it held raises it in its own thread."""
    group, slots = fake_group(2)
    group.workers.fail = RuntimeError("a rank died")
    results = in_one_cycle(group, [(slot, rows(slot.index, 2), {"lr": 1.0}) for slot in slots])
    assert [str(results[i]) for i in range(2)] == ["a rank died", "a rank died"]


def test_steps_that_cannot_pack_are_time_shared_and_said_once(caplog):
    """A batch that does not split over the ranks: its step time-shared after the others' packed step (said once for
    that size); a cycle with one packable step left: each alone; workers that refuse packing: every step alone (said
    once, as the group is made)."""
    with caplog.at_level("INFO", logger="tinker_exp.runtime.slots"):
        group, slots = fake_group(3, ranks=2)
        group.train_steps([(slot, rows(slot.index, 3 if slot.index == 0 else 4), {"lr": 1.0}) for slot in slots])
        group.train_steps([(slot, rows(slot.index, 3 if slot.index == 0 else 4), {"lr": 1.0}) for slot in slots[:2]])
        refused, refused_slots = fake_group(2, refused="sequence parallel 2 (a micro-batch's tokens are split over ranks)")
        refused.train_steps([(slot, rows(slot.index, 4), {"lr": 1.0}) for slot in refused_slots])
    assert [call[:2] for call in group.workers.calls] == [("packed", [1, 2]), ("alone", 3), ("alone", 3), ("alone", 4)]
    assert refused.workers.calls == [("alone", 4), ("alone", 4)] and not refused.packed
    said = [r.getMessage() for r in caplog.records if r.name == "tinker_exp.runtime.slots"]
    assert said == [
        "slots: a batch of 3 rows does not split over 2 ranks: its steps time-shared",
        "slots: steps time-shared, not packed: sequence parallel 2 (a micro-batch's tokens are split over ranks)",
    ]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"lora_dropout": 0.1}, "has LoRA dropout"),
        ({"use_dora": True}, "is a LoRA variant (DoraLinearVariant: DoRA)"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "is a LoRA Embedding (only Linear layers mix adapters)"),
    ],
    ids=["linear", "dropout", "dora", "embedding"],
)
def test_packing_is_refused_where_rows_cannot_be_mixed(change, why):
    """runtime/packed.py `refusal` on the tiny model with peft's adapters as verl builds them (and with what cannot
    be packed), and on a loss that is not SFT's, the padded layout or sequence parallel."""
    from dataclasses import replace
    from functools import partial
    from types import SimpleNamespace

    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.workers.utils.losses import ppo_loss, sft_loss

    from tinker_exp import config
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.lora import peft_config
    from tinker_exp.runtime.packed import refusal

    cfg = config.load(compose(*LORA))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(cfg.model)))
    module = get_peft_model(model, replace(peft_config(cfg.lora), **change))
    engine = SimpleNamespace(module=module, ulysses_sequence_parallel_size=1, pad_to_length=False)
    said = refusal(engine, partial(sft_loss, config=None), True)
    assert said == why if why is None else why in said
    if why is None:
        assert refusal(engine, partial(ppo_loss, config=None), True).startswith("the loss is ppo_loss, not SFT's")
        assert refusal(engine, partial(sft_loss, config=None), False).startswith("the padded layout")
        engine.ulysses_sequence_parallel_size = 2
        assert refusal(engine, partial(sft_loss, config=None), True).startswith("sequence parallel 2")


def test_a_slots_swap_is_waited_for_on_every_worker_class_as_the_rl_worker_is_an_asyncio_actor():
    """verl's RL worker has an async method (update_weights), so Ray makes it an asyncio actor, whose calls it does not
    run in the order they were sent: a slot's swap sent ahead of the slot's call ran after that call now and then (an
    RL trial on slots sampled one step from another slot's adapter). So every worker class's `slot_load` is a blocking
    call (SlotGroup's `_use` asks the slot's call once it returns). The behaviour itself is tested end to end by
    tests/test_rl_ray.py's RL trials on slots, each bitwise its run alone; the race is too narrow to hit on demand."""
    import inspect

    from verl.single_controller.base.decorator import MAGIC_ATTR

    from tinker_exp.runtime.rl_workers import _rl_worker_class
    from tinker_exp.runtime.serve_workers import _serve_worker_class
    from tinker_exp.runtime.workers import _worker_class

    asyncio_methods = [name for name, method in inspect.getmembers(_rl_worker_class()) if inspect.iscoroutinefunction(method)]
    assert asyncio_methods, "the RL worker has no async method any more: Ray would order its calls"
    for worker_class in (_worker_class(), _rl_worker_class(), _serve_worker_class()):
        assert getattr(worker_class.slot_load, MAGIC_ATTR)["blocking"] is True, worker_class.__name__
