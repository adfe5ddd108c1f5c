"""Real branches: verl's workers (2 Ray CPU gloo workers) load another run's checkpoint and go on with a plan.

One trunk per module, every branch from it: with the trunk's config a branch is the trunk from step N on, bitwise;
with another plan it starts from the very same state (its first step is the trunk's, bitwise) and then applies its
own plan. The trunk is the suite's shared CLI run (conftest.py cosine_trunk); a LoRA branch is in test_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import COSINE_TRUNK, metrics_rows, planned, read_jsonl, run_cli, run_warm, wandb_run_file, wandb_records, wandb_run_record

STEPS, AT = 12, 4
BASE = [f"trainer.steps={STEPS}", "checkpoint.every_steps=4", "checkpoint.keep_last=0"]
TRUNK = COSINE_TRUNK  # "+override=lr_cosine", "override.lr.warmup_steps=2", *BASE
KEYS = ("train/loss", "train/grad_norm", "applied/lr", "applied/beta1")


def values(rows: list[dict]) -> list[list]:
    return [[row.get(key) for key in KEYS] for row in rows]


def cli(run_dir: Path, pool: dict, *args: str):
    """A branch's run, on the session's warm pool (the trunk is a cold run: warm and cold are bitwise the same)."""
    return run_warm(pool, *args, f"hydra.run.dir={run_dir}")


@pytest.fixture(scope="module")
def trunk(cosine_trunk) -> Path:
    """The suite's shared CLI run (conftest.py), W&B offline: its run id is the branches' lineage."""
    assert TRUNK[-3:] == BASE
    return cosine_trunk[0]


def test_a_branch_with_the_trunks_config_is_the_trunk_from_step_n_on_bitwise(trunk, warm_pool, tmp_path):
    cli(tmp_path, warm_pool, *TRUNK, "logger=none", f"branch.from={trunk}", f"branch.step={AT}")
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(AT, STEPS))
    assert values(rows) == values(metrics_rows(trunk)[AT:])


def test_a_branch_with_another_plan_starts_from_the_trunks_state_then_applies_its_own(trunk, warm_pool, tmp_path):
    trunk_files = {p: p.stat().st_mtime_ns for p in trunk.rglob("*") if p.is_file()}
    branch = ["+override=lr_wsd", "override.lr.decay_steps=6", *BASE, "trainer.steps=14", f"branch.from={trunk}", f"branch.step={AT}"]
    result = cli(tmp_path, warm_pool, *branch)
    rows, trunk_rows = metrics_rows(tmp_path), metrics_rows(trunk)
    assert [row["train/step"] for row in rows] == list(range(AT, 14))
    # the very same state: step N's forward and backward are the trunk's, before any value of the new plan acts
    assert (rows[0]["train/loss"], rows[0]["train/grad_norm"]) == (trunk_rows[AT]["train/loss"], trunk_rows[AT]["train/grad_norm"])
    assert [row["applied/lr"] for row in rows] == [row["requested/lr"] for row in rows] == planned(tmp_path, "lr")[AT:]
    assert planned(tmp_path, "lr")[AT:STEPS] != planned(trunk, "lr")[AT:]
    assert rows[1]["train/loss"] != trunk_rows[AT + 1]["train/loss"]
    assert {p: p.stat().st_mtime_ns for p in trunk.rglob("*") if p.is_file()} == trunk_files  # only read

    trunk_id = (trunk / "wandb_run_id").read_text().strip()
    checkpoint = str(trunk / "checkpoints" / f"step_{AT:08d}")
    assert result.stdout.splitlines()[0].endswith(
        f"branch of {trunk} at step {AT} (its checkpoint {checkpoint}, trunk W&B run {trunk_id}); this run's own plan from step {AT}"
    )
    lineage = {"from": str(trunk), "step": AT, "checkpoint": checkpoint, "trunk_wandb_run_id": trunk_id}
    assert json.loads((tmp_path / "plan.json").read_text())["branch"] == lineage
    assert json.loads((tmp_path / "job.json").read_text())["branch"] == lineage
    run_record = wandb_run_record(wandb_records(wandb_run_file(tmp_path)))
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert (config["branch.from"], config["branch.step"], config["branch.trunk_wandb_run_id"]) == (str(trunk), AT, trunk_id)
    assert run_record.run_id != trunk_id


def branch_sweep(trunk: Path, sweep_dir: Path, env: dict) -> None:
    """The shipped preset, narrowed to 2 branches: decays of 4 steps at steps 4 and 8 of the trunk; checks every
    branch and the summary."""
    result = run_cli(
        "-m", "branch_sweep=wsd_decay", f"branch.from={trunk}", "branch.step=4,8", "override.lr.decay_steps=4",
        "override.lr.decay_shape=1-sqrt", "checkpoint.every_steps=4", "logger=none", f"hydra.sweep.dir={sweep_dir}",
        env=env, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_jsonl(sweep_dir / "summary.jsonl")
    assert [(row["status"], row["steps"]) for row in summary] == [("COMPLETED", 4), ("COMPLETED", 4)]
    trunk_rows = metrics_rows(trunk)
    ats = []
    for job in summary:  # sorted by objective
        run_dir = Path(job["run_dir"])
        at = json.loads((run_dir / "job.json").read_text())["branch"]["step"]
        ats.append(at)
        assert f"branch.step={at}" in job["overrides"]
        rows = metrics_rows(run_dir)
        assert [row["train/step"] for row in rows] == list(range(at, at + 4))
        assert (rows[0]["train/loss"], rows[0]["train/grad_norm"]) == (trunk_rows[at]["train/loss"], trunk_rows[at]["train/grad_norm"])
        assert [row["applied/lr"] for row in rows] == planned(run_dir, "lr")[at:]
        lrs = [row["applied/lr"] for row in rows]
        assert lrs[0] <= 1e-3 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 3e-4  # each trains its decay
    assert sorted(ats) == [4, 8]


def test_a_sweep_of_decay_branches_on_the_presets_local_launcher(trunk, ray_address, tmp_path):
    """The one real branch sweep, on the preset's own launcher (local; that it is the preset's is a compose test in
    test_branch.py). It ran on the local Slurm cluster too: the same jobs, whose Slurm side (a job per point, its own
    Ray in its allocation) the Slurm sweep, study, population and preemption tests hold."""
    branch_sweep(trunk, tmp_path, {"RAY_ADDRESS": ray_address})
