"""A real population: 4 members on verl's workers (2 Ray CPU gloo workers each), launched by the ordinary grid
sweeper with the population's environment set by the test, 3 boundaries each. An exploit loads another member's
checkpoint into the running workers; a plain run of a member's override/realized.yaml from step 0 is its lineage,
bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optuna.distributions import FloatDistribution, distribution_to_json

from helpers import metrics_rows, read_jsonl, run_cli, wandb_records, wandb_run_file, wandb_run_record
from tinker_exp.sweep.jobs import sweep_group
from tinker_exp.sweep.pbt import POPULATION_ENV, POPULATION_FILE, lineage_rows, realized_values

STEPS, K = 8, 2
FIXED = ["+override=lr_cosine", "override.lr.warmup_steps=2", f"trainer.steps={STEPS}", f"trainer.eval_every={K}",
         "checkpoint.every_steps=0", "data.val_fraction=0.04"]  # fmt: skip
"""What every member shares (a tiny validation set: 4 evaluations a member)."""
FORCED = {"member": 3, "step": 6, "donor": 2}
"""The last member takes, at the last boundary, the checkpoint of one that has exploited before: a lineage of three
run dirs (members launched one after another rank against those before them, so the first one is always the best
so far and every natural exploit takes its checkpoint)."""
KEYS = ("train/loss", "train/grad_norm", "applied/lr", "applied/beta1", "applied/beta2", "applied/weight_decay", "val/loss")


def values(rows: list[dict]) -> list[list]:
    return [[row["train/step"], *(row.get(key) for key in KEYS)] for row in rows]


@pytest.fixture(scope="module")
def population(ray_address, tmp_path_factory) -> list[Path]:
    sweep = tmp_path_factory.mktemp("pbt") / "sweep"
    told = {"board": str(sweep / "population"), "population": 4, "interval": K, "quantile": 0.25, "perturb": [0.8, 1.2],
            "resample_probability": 0.25, "seed": 0, "space": {"override.lr.value": distribution_to_json(FloatDistribution(1e-4, 3e-3, log=True))},
            "force_exploit": FORCED}  # fmt: skip
    result = run_cli(
        "-m", "hydra/launcher=local", *FIXED, "override.lr.value=3e-3,1e-3,3e-4,1e-4", f"hydra.sweep.dir={sweep}",
        env={"RAY_ADDRESS": ray_address, POPULATION_ENV: json.dumps(told)}, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [sweep / str(member) for member in range(4)]


def test_every_member_decides_at_each_boundary_and_some_exploit(population):
    rows = {member: read_jsonl(run_dir / POPULATION_FILE) for member, run_dir in enumerate(population)}
    assert all([r["step"] for r in member_rows] == [2, 4, 6] for member_rows in rows.values())
    exploits = [(member, r) for member, member_rows in rows.items() for r in member_rows if r["exploit"]]
    assert (3, 6, 2) in [(m, r["step"], r["exploit"]["member"]) for m, r in exploits]
    assert len(exploits) >= 2, "only the forced exploit: the ranking never chose one"
    for member, row in exploits:  # whose checkpoint it took: the donor's, saved at that step and kept
        assert Path(row["exploit"]["checkpoint"]) == population[row["exploit"]["member"]] / "checkpoints" / f"step_{row['step']:08d}"
        assert (Path(row["exploit"]["checkpoint"]) / "MANIFEST.json").is_file()
    assert all(r["of"] == 1 for r in rows[0])  # the first member alone at each boundary: it carries on
    board = population[0].parent / "population"
    assert sorted(p.relative_to(board).as_posix() for p in board.rglob("*.json")) == [f"{m}/{s}.json" for m in range(4) for s in (2, 4, 6)]


def test_an_exploit_continues_from_the_donors_state_in_the_same_job(population):
    """The first step after an exploit starts from the donor's weights: its loss and grad norm are the donor's at
    that step (computed before any value of the new plan acts) wherever the donor carried on there."""
    checked = 0
    for run_dir in population:
        for row in read_jsonl(run_dir / POPULATION_FILE):
            exploit = row["exploit"]
            donor = population[exploit["member"]] if exploit else None
            if donor is None or read_jsonl(donor / POPULATION_FILE)[row["step"] // K - 1]["exploit"]:
                continue
            own, theirs = metrics_rows(run_dir)[row["step"]], metrics_rows(donor)[row["step"]]
            assert (own["train/loss"], own["train/grad_norm"]) == (theirs["train/loss"], theirs["train/grad_norm"])
            checked += 1
        assert len(json.loads((run_dir / "job.json").read_text())["overrides"]) == len(FIXED) + 1  # one job per member
    assert checked >= 1


def test_the_realized_schedule_replays_the_lineage_bitwise(population, ray_address, tmp_path):
    member = population[FORCED["member"]]
    donor_rows = read_jsonl(population[FORCED["donor"]] / POPULATION_FILE)
    assert any(r["exploit"] and r["step"] < FORCED["step"] for r in donor_rows), "the donor's lineage is its own only"
    result = run_cli("--config-dir", str(member), "+override=realized", *FIXED[2:], "logger=none", f"hydra.run.dir={tmp_path}",
                     env={"RAY_ADDRESS": ray_address})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lineage = lineage_rows(member)
    assert [row["train/step"] for row in lineage] == list(range(STEPS))
    assert values(metrics_rows(tmp_path)) == values(lineage)
    assert [row["requested/lr"] for row in metrics_rows(tmp_path)] == realized_values(member)["lr"]
    assert len(set(realized_values(member)["lr"][2:])) > 1


def test_each_members_wandb_run_holds_its_place_and_its_exploits(population):
    member = next(d for d in population if any(r["exploit"] for r in read_jsonl(d / POPULATION_FILE)))
    records = wandb_records(wandb_run_file(member))
    run = wandb_run_record(records)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["population.member"] == int(member.name)
    assert run.run_group == sweep_group(str(member.parent))  # the sweep's group, as any sweep job's
    summary = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "summary" for u in r.summary.update}
    table = summary["population/exploits"]
    assert table["_type"] == "table-file" and table["ncols"] == 4
    exploits = [r for r in read_jsonl(member / POPULATION_FILE) if r["exploit"]]
    assert table["nrows"] == len(exploits)
    (path,) = (member / "wandb").glob(f"offline-run-*/files/{table['path']}")
    data = json.loads(path.read_text())
    assert data["columns"] == ["step", "donor", "donor step", "values"]
    assert data["data"] == [[r["step"], r["exploit"]["member"], r["exploit"]["step"], json.dumps(r["values"])] for r in exploits]
