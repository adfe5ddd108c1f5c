"""Real resumes on Ray CPU workers (2, where a run is compared with the shared 2-rank trunk; else 1), the driver killed
with SIGKILL mid-run (W&B, metrics.csv and TensorBoard continued), corrupt checkpoints, NaN policy. A 2-node Slurm job
preempted and resumed: test_sweeps' sweep of 2-node points."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pytest

from helpers import (
    COSINE_TRUNK,
    compose,
    metrics_rows,
    planned,
    read_jsonl,
    run_cli,
    start_cli,
    wait_until,
    wandb_history,
    wandb_records,
)
from test_loggers import read_csv, read_tensorboard, same_as_csv, same_as_tensorboard
from tinker_exp.errors import CheckpointError, NonFiniteError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run

STEPS = 12
# lr follows a cosine schedule, so a resumed run must continue the plan at the right step, not restart it.
COMMON = [f"trainer.steps={STEPS}", "checkpoint.every_steps=4", "+override=lr_cosine", "override.lr.warmup_steps=2"]


def launch(run_dir: Path, ray_address: str, *extra: str):
    return start_cli(*COMMON, f"hydra.run.dir={run_dir}", *extra, env={"RAY_ADDRESS": ray_address})


@pytest.fixture(scope="module")
def uninterrupted(cosine_trunk):
    """The suite's shared CLI run (conftest.py): COMMON, its checkpoints all kept (which changes no step)."""
    assert COSINE_TRUNK == [*COMMON[2:], *COMMON[:2], "checkpoint.keep_last=0"]
    return metrics_rows(cosine_trunk[0])


LOGGERS = "logger=[wandb,csv,tensorboard]"  # every logger (a list of the group's options) continues its own record


def test_sigkill_mid_run_then_rerun_continues_at_the_exact_step(ray_address, uninterrupted, tmp_path):
    driver = launch(tmp_path, ray_address, LOGGERS)
    try:
        # a checkpoint at 4 steps, and steps 4 and 5 logged after it. Not waited for: W&B's first part (W&B starts
        # beside the workers and no step waits for it: on a loaded machine the 12 steps can end before it has)
        wait_until(lambda: len(metrics_rows(tmp_path)) >= 6, 240, "the run never got to step 6", driver, poll=0.1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    killed_at = len(metrics_rows(tmp_path))
    assert 6 <= killed_at < STEPS and (tmp_path / "checkpoints" / "step_00000004" / "MANIFEST.json").exists()
    first_parts = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the killed run's, if W&B had started

    result = run_cli(*COMMON, LOGGERS, f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": ray_address})  # the same command
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_from = int(result.stdout.split("at step ")[1].split()[0])
    assert 4 <= resumed_from <= killed_at
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(STEPS))  # each step exactly once
    assert [row["applied/lr"] for row in rows] == planned(tmp_path, "lr")  # the plan continued
    # Same seed, same data order, model + optimizer + RNG restored: CPU gloo runs are bitwise equal.
    assert len(rows) == len(uninterrupted) == STEPS
    for got, want in zip(rows, uninterrupted):
        assert (got["train/loss"], got["train/grad_norm"]) == (want["train/loss"], want["train/grad_norm"])

    # W&B: one run id, resumed; offline the rerun's is one more part (W&B appends them when synced)
    parts = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert parts[:-1] == first_parts and len(parts) in (1, 2), (first_parts, parts)
    assert all(part.name == f"run-{run_id}.wandb" for part in parts)
    second = [row["train/step"] for row in wandb_history(wandb_records(parts[-1])) if "train/loss" in row]
    assert second == list(range(resumed_from, STEPS))

    # metrics.csv and TensorBoard, each read back with its own reader: metrics.jsonl's rows, each step once
    columns, cells = read_csv(tmp_path / "metrics.csv")
    assert [int(row["train/step"]) for row in cells] == list(range(STEPS))
    for logged, read in zip(rows, cells):
        same_as_csv(logged, read, columns)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the killed run's, the rerun's
    same_as_tensorboard(rows, read_tensorboard(tmp_path / "tensorboard"))


def test_a_checkpoint_that_does_not_load_is_a_clear_error(ray_address, cosine_trunk, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(cosine_trunk[0], run_dir)  # a copy of the shared run (12 steps, checkpoints at 4, 8 and 12)
    for step in (8, 12):  # as if killed after step 11 with step 4's checkpoint its newest
        (run_dir / "checkpoints" / f"step_{step:08d}").rename(tmp_path / f"elsewhere_{step}")
    shard = run_dir / "checkpoints" / "step_00000004" / "workers" / "model_world_size_2_rank_0.pt"
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # same size: passes the manifest's size check
    # In this process (joining the shared Ray): the CLI prints `tinker_exp: <label>: <message>` and exits with the
    # error's exit_code, as for every stop (tinker_exp.errors).
    with pytest.raises(CheckpointError) as info:
        run(compose(*COMMON, "logger=none"), run_dir)
    assert (info.value.exit_code, info.value.label) == (5, "checkpoint error")
    assert str(info.value).startswith(f"{shard.parent.parent}: verl could not load it"), str(info.value)
    assert [row["train/step"] for row in metrics_rows(run_dir)] == list(range(STEPS))  # nothing logged is lost


def test_non_finite_steps_stop_the_run_keeping_the_last_good_checkpoint(ray_address, tmp_path):
    # lr jumps to 1e30 for step 4: its update blows the weights up, so step 5's gradients are not finite.
    with pytest.raises(NonFiniteError) as info:  # in this process, joining the shared Ray (the CLI: exit 4, one line)
        run(compose("trainer.steps=10", "checkpoint.every_steps=2", "logger=none", "backend.num_workers=1",
                    "+override.lr={schedule:keyframes,points:{0:0.001,3:0.001,4:1e30,9:1e30}}"), tmp_path)  # fmt: skip
    assert (info.value.exit_code, info.value.label) == (4, "stopped on non-finite values")
    assert re.match(r"step 5: loss=\S+, grad_norm=nan; 1 non-finite", str(info.value)), str(info.value)
    rows = metrics_rows(tmp_path)
    assert [row["train/nonfinite_steps"] for row in rows] == [0, 0, 0, 0, 0, 1]
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000004"]  # nothing saved after the failure
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "loop.json").read_text())
    assert state["step"] == 4 and state["nonfinite_steps"] == 0


# --- two round trips a step: no optimizer_zero_grad, no log-probs back -----------------------------------------------
ROUND_TRIPS = ["trainer.steps=6", "checkpoint.every_steps=3", "trainer.eval_every=2", "logger=none", "+override=lr_cosine", "backend.num_workers=1"]


def grad_probed(seen: dict, explicit_zero_grad: bool = False):
    """A start for run()'s `GivenWorkers`: verl's workers that count, on every rank, the parameters holding a gradient as each
    forward_backward begins; `explicit_zero_grad`: the loop as it was (optimizer_zero_grad first, a third round
    trip). Before they are freed: those counts, and what one more forward_backward hands the driver."""
    from tinker_exp.runtime.workers import TinkerWorkers

    class GradProbedWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register

            class GradProbe(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
                def forward_backward(self, data):
                    held = sum(p.grad is not None for p in self.engine.module.parameters())
                    self.held = [*getattr(self, "held", []), held]
                    return base.forward_backward(self, data)

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def grads_held_at_each_forward_backward(self):
                    return getattr(self, "held", [])

            return GradProbe

        def train_step(self, examples, optim_step_params):
            self.last_examples = examples
            if explicit_zero_grad:
                self.group.optimizer_zero_grad()
            return super().train_step(examples, optim_step_params)

        def shutdown(self, timeout_s: float = 10.0) -> None:
            if self.group is not None and getattr(self, "last_examples", None):
                seen["held"] = self.group.grads_held_at_each_forward_backward()
                seen["returned"] = self.group.forward_backward(self._batch(self.last_examples)).get()
            super().shutdown(timeout_s)

    def start(cfg, plan, model_path, run_dir):
        return GradProbedWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu")

    return start


def test_every_step_starts_from_no_gradient_without_zero_grad_and_trains_bitwise_as_with_it(ray_address, tmp_path):
    """verl's optimizer_step zeroes the grads on exit, and reset, load_checkpoint and infer_batch (evaluations between
    steps here) leave none: so every forward_backward starts from none, after a resume too, and the loop without
    optimizer_zero_grad trains bitwise as the loop with it. forward_backward hands back its metrics, no log-probs."""
    import pickle


    keys = ("train/step", "train/loss", "train/grad_norm", "applied/lr", "val/loss")

    def rows(run_dir):
        return [[row.get(k) for k in keys] for row in read_jsonl(run_dir / "metrics.jsonl")]

    whole: dict = {}
    run(compose(*ROUND_TRIPS), tmp_path / "whole", place=GivenWorkers(grad_probed(whole)))
    assert whole["held"] == [[0] * 6]  # per rank (one here), per step: no parameter held a gradient
    returned = whole["returned"]
    assert list(returned.keys()) == ["metrics"] and returned.get_non_tensor("metrics")["loss"]  # no log_probs
    print(f"forward_backward's reply to the driver: {len(pickle.dumps(returned))} bytes")

    with_zero_grad: dict = {}
    run(compose(*ROUND_TRIPS), tmp_path / "zero_grad", place=GivenWorkers(grad_probed(with_zero_grad, explicit_zero_grad=True)))
    assert rows(tmp_path / "zero_grad") == rows(tmp_path / "whole")  # losses, grad norms, val losses: bitwise

    resumed = tmp_path / "resumed"  # as if killed after step 5, before its last save: continues from step 3
    shutil.copytree(tmp_path / "whole", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    again: dict = {}
    run(compose(*ROUND_TRIPS), resumed, place=GivenWorkers(grad_probed(again)))
    assert again["held"] == [[0] * 3]  # steps 3, 4, 5 on freshly loaded workers
    assert rows(resumed) == rows(tmp_path / "whole")
