"""Real runs of the optimizer families: verl's workers (FSDP2) on Ray CPU gloo workers (2 for AdamW and Muon, whose
resumes restore sharded optimizer state; 1 for SGD and RMSprop), sharing one Ray cluster.

Each optimizer trains 6 steps with a scheduled value (applied == requested in every group of every sub-optimizer, at
every step: the loop checks it and stops otherwise; schedule-free's applied/lr is logged with its own warmup), then resumes from its step-3 checkpoint bitwise. Before the
workers are freed, every rank reports each sub-optimizer's param-group keys and value types, held to the table.

The CPU defaults' exactness (docs/devices.md#throughput-knobs): one 2-rank group lent, as a pool lends it, to every
torch family with foreach and with the for loop (bitwise where CPU_FOREACH_EXACT says so), and to schedule-free AdamW
with and without evaluations between its steps; every fresh start but the first follows an evaluation.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import compose, planned, read_jsonl, wandb_finished_records, wandb_history
from tinker_exp.config.schema import CPU_FOREACH_EXACT
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run
from tinker_exp.optim.optimizers import AUTO, CHOICE, COEFFS, FLAG, FLOAT, INT, OPTIMIZERS, PAIR, STATE

KIND_TYPES = {FLOAT: "float", PAIR: "tuple", FLAG: "bool", INT: "int", COEFFS: "tuple", CHOICE: "str", AUTO: "NoneType", STATE: "float"}
COMMON = ["trainer.steps=6", "checkpoint.every_steps=3", "trainer.eval_every=0"]
KEYS = ("train/step", "train/loss", "train/grad_norm")


def group_types_probed(seen: dict):
    """A start for run()'s `GivenWorkers`: verl's workers that, before they are freed, report every rank's param groups per
    sub-optimizer as {key: type name} (the groups verl's own _iter_optimizer_param_groups flattens)."""
    from tinker_exp.runtime.workers import TinkerWorkers

    class ProbedWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, register

            class GroupTypes(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def group_types(self):
                    optimizer = self.engine.optimizer
                    parts = getattr(optimizer, "optimizers_dict", None) or {type(optimizer).__name__: optimizer}
                    return {
                        name: [{k: type(v).__name__ for k, v in g.items() if k not in ("params", "initial_lr")}
                               for g in part.param_groups]
                        for name, part in parts.items()
                    }

            return GroupTypes

        def shutdown(self, timeout_s: float = 10.0) -> None:
            if self.group is not None and "types" not in seen:
                seen["types"] = self.group.group_types()
            super().shutdown(timeout_s)

    def start(cfg, plan, model_path, run_dir):
        return ProbedWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu")

    return start


def whole_and_resumed(tmp_path_factory, name: str, *overrides: str) -> dict:
    """A 6-step run, then a copy of it resumed from its step-3 checkpoint (as if killed before its last save)."""
    whole = tmp_path_factory.mktemp(name)
    seen: dict = {}
    run(compose(*COMMON, *overrides), whole, place=GivenWorkers(group_types_probed(seen)))
    resumed = whole.with_name(whole.name + "-resumed")
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    run(compose(*COMMON, *overrides), resumed)
    return {"dir": whole, "rows": read_jsonl(whole / "metrics.jsonl"), "resumed": read_jsonl(resumed / "metrics.jsonl"),
            "types": seen["types"]}


@pytest.fixture(scope="module")
def sgd(ray_address, tmp_path_factory):
    return whole_and_resumed(
        tmp_path_factory, "sgd", "optimizer=sgd", "+override.momentum={schedule: linear, start: 0.5, end: 0.9}",
        "+override.lr=0.05", "logger=wandb", "backend.num_workers=1",  # one rank: adamw and muon resume sharded
    )


@pytest.fixture(scope="module")
def rmsprop(ray_address, tmp_path_factory):
    return whole_and_resumed(
        tmp_path_factory, "rmsprop", "optimizer=rmsprop", "+override.alpha={schedule: linear, start: 0.9, end: 0.99}",
        "+override.momentum=0.5", "+override.eps=1e-6", "logger=none", "backend.num_workers=1",
    )


@pytest.fixture(scope="module")
def muon(ray_address, tmp_path_factory):
    return whole_and_resumed(tmp_path_factory, "muon", "optimizer=muon", "+override=lr_cosine", "logger=none")


@pytest.fixture(scope="module")
def adamw(ray_address, tmp_path_factory):
    # an evaluation at step 3, right before the step-3 checkpoint the resume starts from (on CPU a forward keeps the
    # parameters gathered: backend.reshard_after_forward's default; the workers reshard after an evaluation)
    return whole_and_resumed(
        tmp_path_factory, "adamw", "+override=[lr_cosine,beta2_warmup]", "override.lr.warmup_steps=2", "logger=none",
        "trainer.eval_every=3",
    )


@pytest.fixture(scope="module")
def schedule_free(ray_address, tmp_path_factory):
    """Evaluated every 2 steps (at its averaged weights, the training point restored bitwise after each), resumed
    from step 3: between an evaluation and the next one, as a branch or a pool's run would start."""
    return whole_and_resumed(
        tmp_path_factory, "schedule_free", "optimizer=adamw_schedulefree", "trainer.eval_every=2", "logger=none",
        "+override.lr={schedule: linear, start: 2e-3, end: 1e-3}", "+override.warmup_steps=2",
    )


def assert_trains_and_applies(result: dict, scheduled: str, constants: dict[str, float], kept: dict[str, float],
                              warmup_steps: float = 0.0) -> None:  # fmt: skip
    """`scheduled` and `constants` are sent; `kept` are not, and the groups keep the optimizer's own values.
    `warmup_steps`: the optimizer's own lr warmup (schedule-free's): the lr step k applied is the one sent times
    min(1, (k + 1) / warmup_steps), as the package computes it."""
    rows = result["rows"]
    assert [row["train/step"] for row in rows] == list(range(6))
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    values = planned(result["dir"], scheduled)
    assert len(set(values)) > 1  # really scheduled
    warmed = [value * min(1.0, (k + 1) / warmup_steps) for k, value in enumerate(values)] if warmup_steps else values
    assert [row[f"requested/{scheduled}"] for row in rows] == values and [row[f"applied/{scheduled}"] for row in rows] == warmed
    for key, value in constants.items():
        assert all(row[f"requested/{key}"] == row[f"applied/{key}"] == value for row in rows)
    for key, value in kept.items():
        assert all(f"requested/{key}" not in row and row[f"applied/{key}"] == value for row in rows)


def assert_resumes_bitwise(result: dict) -> None:
    """Model, optimizer state (momentum buffers, Muon's too) and RNG restored: CPU gloo runs are bitwise equal."""
    assert [[row[k] for k in KEYS] for row in result["resumed"]] == [[row[k] for k in KEYS] for row in result["rows"]]


def assert_groups_match_the_table(result: dict, name: str) -> None:
    """Every rank's groups hold exactly the table's keys and types, sub-optimizer by sub-optimizer (an AUTO key the
    run's optimizer kernel sets, foreach on cpu: a bool)."""
    from tinker_exp.config import BackendConfig
    from tinker_exp.runtime.device import throughput

    spec = OPTIMIZERS[name]
    kernel = throughput(BackendConfig(), "cpu", name).optimizer_kernel
    expected = {part: {key: "bool" if key in kernel else KIND_TYPES[kind] for key, kind in sub.keys.items()}
                for part, sub in spec.parts.items()}  # fmt: skip
    if len(spec.parts) == 1:  # a plain optimizer reports its class name
        expected = {name: next(iter(expected.values()))}
    for rank in result["types"]:
        assert set(rank) == set(expected)
        for part, groups in rank.items():
            assert groups and all(group == expected[part] for group in groups)


def test_sgd_with_a_scheduled_momentum(sgd):
    assert_trains_and_applies(sgd, "momentum", {"lr": 0.05}, {"weight_decay": 0.0, "dampening": 0.0})
    assert_resumes_bitwise(sgd)
    assert_groups_match_the_table(sgd, "SGD")
    history = [row for row in wandb_history(wandb_finished_records(sgd["dir"])) if "train/loss" in row]
    momentum = planned(sgd["dir"], "momentum")
    assert [row["requested/momentum"] for row in history] == momentum == [row["applied/momentum"] for row in history]


def test_rmsprop_with_a_scheduled_alpha(rmsprop):
    assert_trains_and_applies(rmsprop, "alpha", {"momentum": 0.5, "eps": 1e-6}, {"lr": 1e-3, "weight_decay": 0.0})
    assert_resumes_bitwise(rmsprop)


def test_muon_and_adamw_with_a_scheduled_lr(muon):
    assert_trains_and_applies(muon, "lr", {}, {"weight_decay": 0.01, "momentum": 0.95, "eps": 1e-7})  # Muon's group
    assert not any(key.startswith("requested/") and key != "requested/lr" for key in muon["rows"][0])
    assert_resumes_bitwise(muon)
    assert_groups_match_the_table(muon, "Muon")


def test_adamw_groups_match_the_table(adamw):
    assert_groups_match_the_table(adamw, "AdamW")
    assert_resumes_bitwise(adamw)


def test_a_checkpoint_saved_right_after_an_evaluation_resumes_bitwise(adamw):
    """2 ranks, the CPU defaults (reshard_after_forward off): the step-3 checkpoint follows step 3's evaluation, and
    the run resumed from it logs every value of the whole run, bitwise."""
    rows, resumed = adamw["rows"], adamw["resumed"]
    assert [row["train/step"] for row in rows if "val/loss" in row] == [2, 5]  # evaluated after steps 3 and 6
    keys = (*KEYS, "val/loss", "applied/lr", "applied/beta2")
    assert [[row.get(k) for k in keys] for row in resumed] == [[row.get(k) for k in keys] for row in rows]


# --- the CPU defaults' exactness: foreach against the for loop, a fresh start after an evaluation -------------------
KERNEL_STEPS = 3


@dataclass(frozen=True)
class Tokens:
    """A training example as the loop hands it to the workers (tinker_exp.train.data.Example's two fields)."""

    input_ids: list
    loss_mask: list


def digest_probed():
    """TinkerWorkers whose ranks also report a digest of their parameter shards (read through state_dict, whose
    FSDP2 hook reshards gathered parameters), how many parameters are gathered, and what verl's own forward-only
    path leaves gathered."""
    from tinker_exp.runtime.workers import TinkerWorkers

    class DigestWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, register

            class Digest(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def parameter_digest(self) -> str:
                    import hashlib

                    import torch

                    digest = hashlib.sha256()
                    for name, tensor in self.engine.module.state_dict().items():
                        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                        digest.update(name.encode() + local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                    return digest.hexdigest()

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def gathered_parameters(self) -> int:
                    """Parameters registered unsharded (whole tensors, not DTensor shards)."""
                    return sum(not hasattr(p, "to_local") for p in self.engine.module.parameters())

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def gathered_by_a_bare_forward(self, data) -> int:
                    """What verl's own forward-only path (no reshard after it) leaves gathered; then resharded."""
                    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

                    from tinker_exp.runtime.workers import reshard

                    TinkerTrainingWorker.infer_batch(self, data)  # verl's, not ours
                    gathered = sum(not hasattr(p, "to_local") for p in self.engine.module.parameters())
                    reshard(self.engine.module)
                    return gathered

            return Digest

    return DigestWorkers


def families_with_foreach() -> dict[str, str]:
    """optimizer.name -> its conf/optimizer option, for every torch optimizer whose foreach is a choice."""
    from omegaconf import OmegaConf

    from helpers import CONF_DIR

    names = {OmegaConf.load(path).name: path.stem for path in sorted((CONF_DIR / "optimizer").glob("*.yaml"))}
    return {name: option for name, option in names.items()
            if OPTIMIZERS[name].impl == "torch.optim" and all("foreach" in part.keys for part in OPTIMIZERS[name].parts.values())}


@pytest.fixture(scope="module")
def kernels(ray_address):
    """One worker group of 2 ranks with the CPU defaults (parameters kept gathered from each forward to its backward)
    lent, as a pool lends its group, to every optimizer family whose foreach is a choice, with foreach and then the
    for loop: each from the group's fresh start (fresh_state), KERNEL_STEPS steps of a cosine lr with an evaluation
    after the first and after the last. So every fresh start but the first follows an evaluation; the first runs
    once more at the end. Per run: losses, grad norms, evaluation losses, every rank's parameter digest, and the
    parameters left gathered after the last evaluation; and once, what verl's own forward-only path leaves."""
    import random

    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import model_dir

    tokens = random.Random(0)
    examples = [Tokens([tokens.randrange(3, 200) for _ in range(24)], [0] * 8 + [1] * 16) for _ in range(4)]
    options = families_with_foreach()
    runs = [(name, kernel) for name in options for kernel in ("foreach", "for_loop")]
    configs = {
        (name, kernel): config.load(compose(f"optimizer={options[name]}", f"backend.optimizer_kernel={kernel}",
                                            f"trainer.steps={KERNEL_STEPS}", "+override=lr_cosine", "override.lr.warmup_steps=1"))
        for name, kernel in runs
    }  # fmt: skip
    first = configs[runs[0]]
    workers = digest_probed()(first.backend, first.optimizer, first.trainer, str(model_dir(first.model)),
                              validate(first).optimizer_values, "cpu")  # fmt: skip
    results = {}
    try:
        workers.ready()
        workers.keep_initial_state()
        results["bare forward"] = workers.group.gathered_by_a_bare_forward(workers._batch(examples))
        for index, (name, kernel) in enumerate([*runs, runs[0]]):
            cfg = configs[name, kernel]
            plan = validate(cfg)
            workers.backend = cfg.backend  # the kernel: a per-run choice in this test (a pool keys its group by it)
            workers.start_fresh(cfg.optimizer, cfg.trainer, plan.optimizer_values, workers.output)
            steps, evaluations = [], []
            for step in range(KERNEL_STEPS):
                result = workers.train_step(examples, plan[step])
                steps.append((result.loss, result.grad_norm))
                if step == 0:
                    evaluations.append(workers.evaluate(examples))
            digests = workers.group.parameter_digest()  # before the last evaluation: "gathered" is what that one leaves
            evaluations.append(workers.evaluate(examples))
            results[name, kernel, index == len(runs)] = {
                "steps": steps, "evaluations": evaluations, "digests": digests, "gathered": workers.group.gathered_parameters(),
            }
        schedule_free = config.load(compose("optimizer=adamw_schedulefree", f"trainer.steps={KERNEL_STEPS}"))
        plan = validate(schedule_free)
        for evaluated in (True, False):  # its evaluations move the parameters to its averaged weights and back
            workers.backend = schedule_free.backend
            workers.start_fresh(schedule_free.optimizer, schedule_free.trainer, plan.optimizer_values, workers.output)
            steps = []
            for step in range(KERNEL_STEPS):
                result = workers.train_step(examples, plan[step])
                steps.append((result.loss, result.grad_norm))
                if evaluated:
                    workers.evaluate(examples)
            results["schedule-free", evaluated] = steps
    finally:
        workers.shutdown()
    return results


def test_foreach_steps_bitwise_as_the_for_loop_for_the_families_auto_gives_it_on_cpu(kernels):
    """CPU_FOREACH_EXACT is what the workers show: foreach's losses, grad norms, evaluations and parameters are the for
    loop's, bitwise, for exactly those families; for the others (NAdam, RAdam) the parameters differ (float rounding:
    the losses agree within 1e-5)."""
    exact, rounding = set(), {}
    for name in families_with_foreach():
        foreach, for_loop = kernels[name, "foreach", False], kernels[name, "for_loop", False]
        assert len(foreach["steps"]) == KERNEL_STEPS and len(set(foreach["digests"])) == 2  # two ranks, two shards
        if foreach == for_loop:
            exact.add(name)
            continue
        losses = [a for a, _ in foreach["steps"]], [b for b, _ in for_loop["steps"]]
        rounding[name] = max(abs(a / b - 1) for a, b in zip(*losses))
        assert rounding[name] < 1e-5, (name, foreach, for_loop)
    print(f"foreach bitwise for {sorted(exact)}; not for the others (largest relative loss difference): {rounding}")
    assert exact == set(CPU_FOREACH_EXACT)


def test_schedule_free_trains_bitwise_with_evaluations_between_its_steps(kernels):
    """Its evaluation writes its averaged weights into the shards and its training point back after: a step after an
    evaluation must see the training point, not what the evaluation's forward left gathered."""
    assert kernels["schedule-free", True] == kernels["schedule-free", False]


def test_a_fresh_start_after_an_evaluation_is_the_first_start(kernels):
    """verl's forward-only path leaves the parameters gathered (reshard_after_forward off), which a pool's fresh
    start could not copy the kept shards into (`aten.copy_.default got mixed torch.Tensor and DTensor`): our
    evaluation reshards after it, and a fresh start after an evaluation restores the group's start exactly (the
    first run, done again last, is bitwise the first: losses, grad norms, evaluations, parameters); the runs
    between trained (the loss falls)."""
    runs = {key: result for key, result in kernels.items() if len(key) == 3}
    first = next(key for key in runs if not key[2])
    again = (*first[:2], True)
    assert kernels["bare forward"] == [20, 20]  # verl's forward-only path leaves every parameter of both ranks gathered
    assert all(result["gathered"] == [0, 0] for result in runs.values())  # ours reshards: a fresh start writes shards
    assert runs[again] == runs[first]
    for result in runs.values():
        assert result["steps"][-1][0] < result["steps"][0][0]


def test_adamw_follows_the_plan_on_lr_and_betas(adamw):
    """Two schedules composed (test_schedules.py plans them; here verl's workers apply them): every step's requested
    and applied lr, beta1 and beta2 are the plan's."""
    rows = adamw["rows"]
    for key in ("lr", "beta1", "beta2"):
        assert [row[f"requested/{key}"] for row in rows] == planned(adamw["dir"], key) == [row[f"applied/{key}"] for row in rows]
    assert rows[0]["applied/lr"] == 0.0 and rows[2]["applied/lr"] == 1e-3
    assert rows[0]["applied/beta2"] < rows[-1]["applied/beta2"] < 0.999
    assert not math.isnan(rows[-1]["train/loss"])


def test_schedule_free_adamw_applies_its_values_evaluates_and_resumes_bitwise(schedule_free):
    """optimizer=adamw_schedulefree on 2 ranks: the scheduled lr and its own warmup_steps sent and read back at every
    step, its other values kept, and the lr each step applied logged with that warmup (its first step: half the lr
    sent); training and validation losses of the resumed run are the whole run's, bitwise (the checkpoint holds the
    training point, the evaluations between never moved it)."""
    assert_trains_and_applies(schedule_free, "lr", {"warmup_steps": 2.0}, {"weight_decay": 0.0, "r": 0.0, "weight_lr_power": 2.0},
                              warmup_steps=2.0)  # fmt: skip
    assert schedule_free["rows"][0]["applied/lr"] == schedule_free["rows"][0]["requested/lr"] / 2
    assert_resumes_bitwise(schedule_free)
    assert_groups_match_the_table(schedule_free, "AdamWScheduleFree")
    evaluated = [(row["train/step"], row["val/loss"]) for row in schedule_free["rows"] if "val/loss" in row]
    assert [step for step, _ in evaluated] == [1, 3, 5]
    assert evaluated[-2:] == [(row["train/step"], row["val/loss"]) for row in schedule_free["resumed"] if "val/loss" in row][-2:]
    assert evaluated[-1][1] < evaluated[0][1]


def test_muon_on_two_workers_steps_as_on_one(muon, tmp_path: Path):
    """FSDP2 shards Muon's matrices over the ranks; its Newton-Schulz step sees the whole matrix (DTensor): 1 and 2
    workers agree within float tolerance (the order of the gradient sums differs, and torch's Muon orthogonalises in
    bf16, so the gap grows a little with each step: tighter over the first steps)."""
    run(compose(*COMMON, "optimizer=muon", "+override=lr_cosine", "backend.num_workers=1", "logger=none",
                "checkpoint.every_steps=0", "checkpoint.at_end=false"), tmp_path)
    one = read_jsonl(tmp_path / "metrics.jsonl")
    two = muon["rows"]
    gaps = [(abs(a["train/loss"] / b["train/loss"] - 1), abs(a["train/grad_norm"] / b["train/grad_norm"] - 1))
            for a, b in zip(one, two)]
    assert len(gaps) == 6 and [a["applied/lr"] for a in one] == [b["applied/lr"] for b in two]
    assert all(loss < 1e-5 and norm < 1e-4 for loss, norm in gaps[:3]), gaps  # two Muon updates (step 0's lr is 0)
    assert all(loss < 1e-4 and norm < 1e-3 for loss, norm in gaps), gaps


def test_clip_grad_0_is_no_clipping_and_the_model_trains(ray_address, tmp_path: Path):
    """optimizer.clip_grad=0 (Tinker's grad_clip_norm=0, HF's max_grad_norm=0): no clipping. verl clips with the
    max_norm it is given, and 0 would zero every gradient (Adam's update is then 0: the loss would not move); given
    no clip (inf), the run is bitwise the one built with a clip of 0.5 whose every step is sent grad_clip_norm=0
    (the per-step clip replaces the built one exactly), its loss falls and it reports the grad norm."""
    common = ["trainer.steps=3", "trainer.eval_every=0", "logger=none", "checkpoint.every_steps=0", "checkpoint.at_end=false",
              "backend.num_workers=1"]  # the per-step clip over ranks: the test below
    runs = {"0": ["optimizer.clip_grad=0"], "sent 0": ["optimizer.clip_grad=0.5", "+override.grad_clip_norm=0"]}
    rows = {}
    for name, overrides in runs.items():
        run(compose(*common, *overrides), tmp_path / name.replace(" ", "_"))
        rows[name] = read_jsonl(tmp_path / name.replace(" ", "_") / "metrics.jsonl")
    pairs = {name: [(row["train/loss"], row["train/grad_norm"]) for row in r] for name, r in rows.items()}
    assert pairs["0"] == pairs["sent 0"] and len(pairs["0"]) == 3
    losses, norms = zip(*pairs["0"])
    assert losses[2] < losses[1] < losses[0] and all(0 < norm < float("inf") for norm in norms)
    assert all(row["requested/grad_clip_norm"] == row["applied/grad_clip_norm"] == 0.0 for row in rows["sent 0"])
    assert not any("applied/grad_clip_norm" in row for row in rows["0"])  # nothing sent: no new keys


def fed_norms_probed(seen: dict):
    """A start for run()'s `GivenWorkers`: verl's workers that record, on every rank, the norm of the gradients the optimizer
    steps with (after the engine's clip), and report them before they are freed."""
    from tinker_exp.runtime.workers import TinkerWorkers

    class ProbedWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, register

            class FedNorms(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def optimizer_step(self, optim_step_params=None) -> dict:
                    import torch

                    optimizer, fed = self.engine.optimizer, getattr(self, "fed", [])
                    self.fed = fed

                    def step(*args, **kwargs):
                        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                        squares = sum(float(g.full_tensor().double().pow(2).sum()) for g in grads)  # every rank calls it
                        fed.append(squares ** 0.5)
                        return type(optimizer).step(optimizer, *args, **kwargs)

                    optimizer.step = step
                    try:
                        return base.optimizer_step(self, optim_step_params)
                    finally:
                        del optimizer.step

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def fed_norms(self):
                    return self.fed

            return FedNorms

        def shutdown(self, timeout_s: float = 10.0) -> None:
            if self.group is not None and "fed" not in seen:
                seen["fed"] = self.group.fed_norms()
            super().shutdown(timeout_s)

    def start(cfg, plan, model_path, run_dir):
        return ProbedWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu")

    return start


def test_grad_clip_norm_sent_per_step_is_the_clip_of_that_step(ray_address, tmp_path: Path):
    """+override.grad_clip_norm as keyframes (0: no clip, then 0.01, then 1e9) on an engine built with clip 1e-3: each
    step's requested == applied clip in metrics.jsonl, and on every rank the gradients the optimizer steps with have
    the norm min(grad norm, clip) of that step (the grad norm itself where the clip is 0)."""
    clips = [0.0, 0.01, 1e9]
    seen: dict = {}
    overrides = ["trainer.steps=3", "trainer.eval_every=0", "logger=none", "checkpoint.every_steps=0", "optimizer.clip_grad=1e-3",
                 "checkpoint.at_end=false", "+override.grad_clip_norm={schedule: keyframes, points: {0: 0.0, 1: 0.01, 2: 1e9}}"]
    run(compose(*overrides), tmp_path, place=GivenWorkers(fed_norms_probed(seen)))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["requested/grad_clip_norm"] for row in rows] == clips == [row["applied/grad_clip_norm"] for row in rows]
    norms = [row["train/grad_norm"] for row in rows]
    assert min(norms) > 0.01  # the built clip would clip every step, and the middle step's clip clips
    for fed in seen["fed"]:  # each rank
        assert len(fed) == 3
        for step, (got, norm, clip) in enumerate(zip(fed, norms, clips)):
            want = norm if clip == 0 else min(norm, clip)
            assert math.isclose(got, want, rel_tol=1e-5), (step, got, norm, clip)
