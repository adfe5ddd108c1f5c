"""RL for real: verl's TinkerActorRolloutRefWorker (role "actor") on 2 CPU gloo ranks, the driver sampling from the
weights the workers export after every optimizer step.

One CLI run on the session's warm pool (README's RL command: env=digits loss=importance_sampling +override=lr_cosine
trainer.steps=40, with the objective eval/reward maximised and the best checkpoint kept, every checkpoint kept) is
read by every test here; a copy of it at step 30 is resumed, killed with SIGKILL after its next checkpoint and resumed again (cold: a process of
its own, its Ray cluster the session's); one run branches it at step 10.
"""

from __future__ import annotations

import json
import re
import shutil
import signal

import pytest

from helpers import metrics_rows, planned, read_jsonl, run_cli, run_warm, start_cli, wait_until, wandb_train_rows, without_timings

RL_COMMAND = ["env=digits", "loss=importance_sampling", "+override=lr_cosine", "trainer.steps=40"]
EXTRA = ["trainer.objective=eval/reward", "trainer.objective_mode=max", "checkpoint.keep_best=true", "checkpoint.keep_last=0"]
STEPS = 40


@pytest.fixture(scope="module")
def rl_run(warm_pool, tmp_path_factory):
    """(run dir, finished process) of the one real RL run, on the session's warm pool."""
    run_dir = tmp_path_factory.mktemp("rl_run")
    return run_dir, run_warm(warm_pool, *RL_COMMAND, *EXTRA, f"hydra.run.dir={run_dir}")


def test_the_toy_task_learns_through_verls_actor_worker_with_every_override_applied(rl_run):
    run_dir, _ = rl_run
    rows = metrics_rows(run_dir)
    assert [row["train/step"] for row in rows] == list(range(STEPS))
    assert "workers: TinkerActorRolloutRefWorker (role actor), loss importance_sampling" in (run_dir / "tinker_exp.log").read_text()
    rewards = [row["train/reward"] for row in rows]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 > 0.5, rewards
    # the sampler's log-probs are the trainer's: fp32 on CPU, nothing between the logits and the sampled token
    assert max(abs(row["train/mismatch"]) for row in rows) < 1e-5
    assert [row["applied/lr"] for row in rows] == [row["requested/lr"] for row in rows] == planned(run_dir, "lr")


def test_every_step_logs_reward_groups_lengths_loss_mismatch_grad_norm_and_the_time_split(rl_run):
    run_dir, _ = rl_run
    rows = metrics_rows(run_dir)
    keys = {"train/reward", "train/reward_std", "train/degenerate_groups", "train/zero_advantage_step", "train/response_length",
            "train/loss", "train/pg_loss", "train/ppo_kl", "train/mismatch", "train/grad_norm", "perf/sampling_s",
            "perf/weight_export_s", "perf/sampler_load_s", "perf/forward_backward_s", "perf/optimizer_step_s"}  # fmt: skip
    assert all(keys <= row.keys() for row in rows)
    assert all(1 <= row["train/response_length"] <= 8 and 0 <= row["train/degenerate_groups"] <= 4 for row in rows)
    # the engine's loss (float32) is the RL loss's token sum (its metric, float64)
    assert all(row["train/loss"] == pytest.approx(row["train/pg_loss"], rel=1e-5, abs=1e-5) for row in rows)
    wandb = wandb_train_rows(run_dir)
    assert [row["train/reward"] for row in wandb] == [row["train/reward"] for row in rows]


def test_a_step_with_zero_advantage_everywhere_runs_with_the_plans_values_and_a_zero_gradient(rl_run):
    """The run ends on all-digit responses: every group's rewards equal. Such a step still runs forward_backward and
    optimizer_step with the plan's values (docs/rl.md): its loss and gradient are exactly 0."""
    rows = metrics_rows(rl_run[0])
    zero = [row for row in rows if row["train/zero_advantage_step"]]
    assert zero and all(row["train/degenerate_groups"] == 4 for row in zero)
    assert all(row["train/grad_norm"] == 0.0 and row["train/loss"] == 0.0 for row in zero)
    assert all(row["applied/lr"] == row["requested/lr"] for row in zero)
    assert all(row["train/grad_norm"] > 0 for row in rows if not row["train/zero_advantage_step"] and row["train/degenerate_groups"] < 4)


def test_held_out_prompts_give_eval_reward_and_the_best_checkpoint_is_the_highest(rl_run):
    run_dir, _ = rl_run
    rows = metrics_rows(run_dir)
    evaluated = {row["train/step"] + 1: row["eval/reward"] for row in rows if "eval/reward" in row}
    assert sorted(evaluated) == [10, 20, 30, 40]
    assert evaluated[40] > evaluated[10] + 0.5
    best_step = max(evaluated, key=evaluated.get)
    objective = read_jsonl(run_dir / "objective.json")[0]
    assert (objective["metric"], objective["mode"], objective["value"]) == ("eval/reward", "max", evaluated[best_step])
    assert objective["best_checkpoint"]["step"] == best_step


def test_a_run_killed_with_sigkill_after_its_checkpoint_resumes_bitwise(rl_run, ray_address, tmp_path):
    """The shared run's dir as it stood at its checkpoint 30 (copied: the first 30 steps are not trained again), then
    the same command with a checkpoint every 5 steps (checkpoint keys may change on a resume: they train nothing):
    it resumes at 30, saves step 35 and is killed with SIGKILL right after; the same command again resumes from that
    checkpoint. The steps after 35 sample the same prompts and responses (prompt cursor and sampler RNG from it) and
    train to the uninterrupted run's rewards, losses, grad norms, mismatch and eval/reward, bit for bit."""
    run_dir, _ = rl_run
    uninterrupted = metrics_rows(run_dir)
    resumed_dir = tmp_path / "run"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000040")
    (resumed_dir / "objective.json").unlink()
    lines = (resumed_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed_dir / "metrics.jsonl").write_text("".join(lines[:30]))
    command = [*RL_COMMAND, *EXTRA, "checkpoint.every_steps=5", f"hydra.run.dir={resumed_dir}"]

    driver = start_cli(*command, env={"RAY_ADDRESS": ray_address})
    try:
        saved = resumed_dir / "checkpoints" / "step_00000035" / "MANIFEST.json"
        wait_until(saved.exists, 600, "the resumed run never saved step 35", driver, poll=0.05)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        driver.kill()
    killed_at = len(metrics_rows(resumed_dir))
    assert 35 <= killed_at < STEPS and not (resumed_dir / "checkpoints" / "step_00000040").exists()
    state = json.loads((saved.parent / "loop.json").read_text())["batch_source"]
    assert state["prompt_cursor"] == 35 * 4 and state["sampler_rng"]

    result = run_cli(*command, env={"RAY_ADDRESS": ray_address}, timeout=600)  # the same command again
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 35" in result.stdout, result.stdout[-3000:]
    rows = metrics_rows(resumed_dir)
    assert [row["train/step"] for row in rows] == list(range(STEPS))
    same = ("train/reward", "train/reward_std", "train/loss", "train/grad_norm", "train/mismatch", "train/response_length")
    assert [[row[key] for key in same] for row in rows] == [[row[key] for key in same] for row in uninterrupted]
    assert [row.get("eval/reward") for row in rows] == [row.get("eval/reward") for row in uninterrupted]


def test_a_branch_of_an_rl_run_starts_from_its_checkpoint_bitwise_then_applies_its_own_plan(rl_run, warm_pool, tmp_path):
    """branch.step=10 with a shorter cosine (12 steps, no evaluation): the branch's step 10 samples the trunk's
    prompts and responses from the trunk's weights (sampler RNG and prompt cursor from the checkpoint), so its
    reward, loss and grad norm are the trunk's bit for bit; from there its own plan's lr is applied and the runs part."""
    trunk, _ = rl_run
    at, steps = 10, 12
    branch = [*RL_COMMAND[:-1], f"trainer.steps={steps}", "logger=none", "env.eval_prompts=null", f"branch.from={trunk}", f"branch.step={at}"]
    run_warm(warm_pool, *branch, f"hydra.run.dir={tmp_path}")
    rows, trunk_rows = metrics_rows(tmp_path), metrics_rows(trunk)
    assert [row["train/step"] for row in rows] == list(range(at, steps))
    same = ("train/reward", "train/reward_std", "train/loss", "train/grad_norm", "train/mismatch", "train/response_length")
    assert [rows[0][key] for key in same] == [trunk_rows[at][key] for key in same]
    assert [row["applied/lr"] for row in rows] == [row["requested/lr"] for row in rows] == planned(tmp_path, "lr")[at:]
    assert planned(tmp_path, "lr")[at] != planned(trunk, "lr")[at]
    assert rows[1]["train/loss"] != trunk_rows[at + 1]["train/loss"]


RL_LORA = [*RL_COMMAND[:2], "lora=r8", "trainer.steps=6", "rl.log_kl_ref=true", "logger=none"]
"""6 RL steps on digits with a rank-8 adapter, the reference model's KL logged."""


@pytest.fixture(scope="module")
def rl_lora_run(ray_address, tmp_path_factory):
    """The run dir of RL_LORA's cold run (seed 0)."""
    run_dir = tmp_path_factory.mktemp("rl_lora")
    result = run_cli(*RL_LORA, f"hydra.run.dir={run_dir}", env={"RAY_ADDRESS": ray_address}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_rl_with_lora_samples_from_the_base_model_with_each_steps_adapter_merged(rl_lora_run):
    """lora=r8 on digits: after each step the workers export the adapter and the driver's sampler merges it into the
    base weights, so the sampler's log-probs are the trainer's (mismatch below 1e-5 at every step) while the policy
    moves away from the initial model by orders of magnitude more (train/kl_ref, against the base model): a sampler
    left on the base weights would differ from the trainer by that much. The run's adapter is rank 8."""
    run_dir = rl_lora_run
    rows = metrics_rows(run_dir)
    assert [row["train/step"] for row in rows] == list(range(6))
    assert max(abs(row["train/mismatch"]) for row in rows) < 1e-5, [row["train/mismatch"] for row in rows]
    assert rows[0]["train/kl_ref"] < 1e-6 and rows[-1]["train/kl_ref"] > 1e-3, [row["train/kl_ref"] for row in rows]
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["r"] == 8


def test_lora_rl_trials_train_at_once_on_slots_each_bitwise_its_run_alone(rl_lora_run, ray_address, tmp_path):
    """A grid of two LoRA RL trials (seeds 0 and 7) on 2 slots of one group in the sweep's process
    (hydra.launcher.slots=2): each samples in its own thread from its own slot's adapter (runtime/slots.py
    `Slot.export_weights`), and their steps are time-shared (an RL loss is not packed, said once), so the trial of the
    cold run's command logs every row and exports its adapter bitwise as the cold run, while the other trains beside
    it on the other slot from its own seed."""
    result = run_cli("-m", "hydra/launcher=local", "hydra.launcher.slots=2", *RL_LORA, "trainer.seed=0,7",
                     f"hydra.sweep.dir={tmp_path}", env={"RAY_ADDRESS": ray_address}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    said = {point: (tmp_path / point / "tinker_exp.log").read_text() for point in "01"}
    assert {re.search(r"slot (\d) of 2 on this process's group", text).group(1) for text in said.values()} == {"1", "2"}, said
    assert "slots: steps time-shared, not packed: the loss is" in said["0"] + said["1"]
    alone, on_slot = without_timings(metrics_rows(rl_lora_run)), without_timings(metrics_rows(tmp_path / "0"))
    assert on_slot == alone, [(i, sorted(k for k in {**a, **b} if a.get(k) != b.get(k))) for i, (a, b) in enumerate(zip(alone, on_slot))]
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "0" / adapter).read_bytes() == (rl_lora_run / adapter).read_bytes()
    other = metrics_rows(tmp_path / "1")
    assert len(other) == 6 and max(abs(row["train/mismatch"]) for row in other) < 1e-5  # its sampler on its own adapter
    assert (tmp_path / "1" / adapter).read_bytes() != (rl_lora_run / adapter).read_bytes()
