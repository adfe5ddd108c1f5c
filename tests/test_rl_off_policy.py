"""Off-policy RL for real (rl.max_steps_off_policy=2, loss=stable_reinforce): verl's workers on 2 CPU gloo ranks
on the session's warm pool while the driver's sampling thread samples ahead. One 12-step run is read by every
test here: its staleness, its checkpoint's batches in flight, a resume of it from step 6 and a branch of it at step 6.
"""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import metrics_rows, planned, run_warm, trained_run

K, STEPS, AT = 2, 12, 6
COMMAND = ["env=digits", "loss=stable_reinforce", "+override=lr_cosine", f"trainer.steps={STEPS}",
           f"rl.max_steps_off_policy={K}", "checkpoint.every_steps=6", "checkpoint.keep_last=0", "logger=none"]  # fmt: skip
SAME = ("train/reward", "train/reward_std", "train/loss", "train/grad_norm", "train/mismatch", "train/response_length",
        "train/staleness", "train/clip_fraction")  # fmt: skip


@pytest.fixture(scope="module")
def off_policy_run(warm_pool, tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("off_policy_run"), warm_pool, *COMMAND)


def test_each_batch_is_sampled_k_steps_behind_and_every_override_is_applied(off_policy_run):
    rows = metrics_rows(off_policy_run)
    assert [row["train/step"] for row in rows] == list(range(STEPS))
    assert [row["train/staleness"] for row in rows] == [min(step, K) for step in range(STEPS)]
    assert [row["applied/lr"] for row in rows] == [row["requested/lr"] for row in rows] == planned(off_policy_run, "lr")
    assert all({"perf/sample_wait_s", "perf/sampling_s", "perf/weight_export_s", "train/clip_fraction"} <= row.keys() for row in rows)
    assert "sampled 2 steps off-policy" in (off_policy_run / "tinker_exp.log").read_text()
    # the checkpoint after step 5 holds batches 6 and 7, sampled from the weights at the start of steps 4 and 5
    state = json.loads((off_policy_run / "checkpoints" / f"step_{AT:08d}" / "loop.json").read_text())["batch_source"]
    assert [(entry["step"], entry["batch"]["first_step"]) for entry in state["in_flight"]] == [(6, 4), (7, 5)]
    assert state["prompt_cursor"] == (AT + K) * 4


def test_an_off_policy_run_resumed_mid_run_trains_bitwise_as_the_uninterrupted_one(off_policy_run, warm_pool, tmp_path):
    """The run's dir as it stood at its checkpoint 6 (copied), the same command again: it trains on the two batches
    in flight from the checkpoint, samples batch 8 from the checkpoint's weights, and every later row is the
    uninterrupted run's, bit for bit (evaluations included)."""
    uninterrupted = metrics_rows(off_policy_run)
    resumed_dir = tmp_path / "run"
    shutil.copytree(off_policy_run, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / f"step_{STEPS:08d}")
    lines = (resumed_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed_dir / "metrics.jsonl").write_text("".join(lines[:AT]))
    result = run_warm(warm_pool, *COMMAND, f"hydra.run.dir={resumed_dir}")
    assert f"at step {AT}" in result.stdout, result.stdout[-3000:]
    rows = metrics_rows(resumed_dir)
    assert [row["train/step"] for row in rows] == list(range(STEPS))
    assert [[row[key] for key in SAME] for row in rows] == [[row[key] for key in SAME] for row in uninterrupted]
    assert [row.get("eval/reward") for row in rows] == [row.get("eval/reward") for row in uninterrupted]


def test_a_branch_trains_on_the_trunks_batches_in_flight_then_its_own(off_policy_run, warm_pool, tmp_path):
    """branch.step=6 with a shorter cosine: steps 6 and 7 train on the trunk's batches in flight (the same rewards,
    bitwise; step 6 the same loss and gradient too, from the same weights), then the branch's own lr parts them."""
    branch = [*COMMAND[:3], "trainer.steps=9", f"rl.max_steps_off_policy={K}", "logger=none", "env.eval_prompts=null",
              f"branch.from={off_policy_run}", f"branch.step={AT}"]  # fmt: skip
    run_warm(warm_pool, *branch, f"hydra.run.dir={tmp_path}")
    rows, trunk = metrics_rows(tmp_path), metrics_rows(off_policy_run)
    assert [row["train/step"] for row in rows] == [6, 7, 8]
    assert [row["train/reward"] for row in rows[:2]] == [row["train/reward"] for row in trunk[AT : AT + 2]]
    assert [rows[0][key] for key in SAME] == [trunk[AT][key] for key in SAME]
    assert rows[1]["train/loss"] != trunk[AT + 1]["train/loss"]  # the branch's own lr at step 6 moved its weights
    assert [row["applied/lr"] for row in rows] == planned(tmp_path, "lr")[AT:]
