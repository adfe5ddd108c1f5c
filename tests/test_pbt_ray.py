"""Real populations on verl's workers (2 Ray CPU gloo workers), through the PBT sweeper (`hydra/sweeper=pbt`): 4
members, boundaries at steps 2, 4 and 6 of 8, on the local launcher's slots (LoRA: every member a thread of the
sweep's process on a slot of one group) and on the local Slurm cluster (full fine-tuning, a process a member). An
exploit loads another member's checkpoint into the running workers (its slot); the printed replay command, and a
plain run of any member's override/realized.yaml from step 0 (a process of its own), give its lineage bitwise. One
population on the local launcher serves every assertion about it (members one at a time: it is the costly part),
and its members' checkpoints, written on slots, are the donor's in the smoke test of benchmarks/pbt_boundary.py (a
process member that loads one). The in-place exploit (a donor still at its boundary on the same group) is
tests/test_slots.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import metrics_rows, read_jsonl, run_cli, run_warm, wandb_records, wandb_run_file, wandb_run_record
from tinker_exp.sweep.jobs import sweep_group
from tinker_exp.sweep.pbt import POPULATION_ENV, POPULATION_FILE, lineage_rows, realized_values
from tinker_exp.sweep.pbt_report import replay_command

K = 2
POPULATION = [
    "-m", "hydra/sweeper=pbt", "+override=lr_cosine", "override.lr.value=tag(log,interval(1e-4,3e-3))", "trainer.steps=8",
    "trainer.eval_every=2", "trainer.batch_size=4", "hydra.sweeper.population=4", f"hydra.sweeper.interval={K}",
]  # fmt: skip
LOCAL_FORCED = {"member": 3, "step": 6, "donor": 2}
"""Test-only, on the local launcher: the last member takes, at the last boundary, the checkpoint of member 2, which
exploited member 1 at step 2 by itself (hydra.sweeper.seed=1 starts member 2 at the space's lowest lr, 1.0e-4):
a lineage over three run dirs. Members launched one after another rank against those before them only."""


def force(forced: dict) -> str:
    return "hydra.sweeper.force_exploit={" + ",".join(f"{k}:{v}" for k, v in forced.items()) + "}"


ON_SLOTS = ["lora=r8", "hydra.launcher.slots=4", "hydra.launcher.max_parallel=1"]
"""The local population's members on slots of one LoRA group in the sweep's process, one at a time: the order the
assertions below rely on (each member ranks against the ones before it), and one group built for all."""


@pytest.fixture(scope="module")
def local_population(ray_address, tmp_path_factory) -> tuple[Path, str]:
    """The population on the local launcher's slots, W&B offline, explored by PB2 (the Slurm one perturbs): (its
    sweep dir, what the sweeper printed)."""
    sweep = tmp_path_factory.mktemp("pbt") / "sweep"
    result = run_cli_population(
        *POPULATION, *ON_SLOTS, "logger=wandb", "hydra.sweeper.seed=1", force(LOCAL_FORCED), "hydra/launcher=local",
        "hydra.sweeper.explore=pb2", f"hydra.sweep.dir={sweep}", env={"RAY_ADDRESS": ray_address},
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return sweep, out


@pytest.fixture(scope="module")
def members(local_population) -> list[Path]:
    sweep, _ = local_population
    return [sweep / str(member) for member in range(4)]


def test_the_local_population_ends_with_its_summary_results_and_replay_line(local_population):
    check_population(*local_population, LOCAL_FORCED)


def test_every_member_decides_at_each_boundary_and_some_exploit_by_themselves(members, local_population):
    rows = {member: read_jsonl(run_dir / POPULATION_FILE) for member, run_dir in enumerate(members)}
    exploits = [(member, r) for member, member_rows in rows.items() for r in member_rows if r["exploit"]]
    forced = (LOCAL_FORCED["member"], LOCAL_FORCED["step"], LOCAL_FORCED["donor"])
    assert forced in [(m, r["step"], r["exploit"]["member"]) for m, r in exploits]
    assert len(exploits) >= 2, "only the forced exploit: the ranking never chose one"
    for member, row in exploits:  # whose checkpoint it took: the donor's, saved at that step and kept
        assert Path(row["exploit"]["checkpoint"]) == members[row["exploit"]["member"]] / "checkpoints" / f"step_{row['step']:08d}"
        assert (Path(row["exploit"]["checkpoint"]) / "MANIFEST.json").is_file()
    assert all(r["of"] == 1 for r in rows[0])  # the first member alone at each boundary: it carries on
    # PB2 proposed the values of an exploit from the improvements of the members before it (the first perturbs).
    logs = "".join((run_dir / "tinker_exp.log").read_text() for run_dir in members)
    assert "explored by pb2" in local_population[1] and "(pb2: proposed from " in logs, logs[-3000:]


def test_every_member_trains_on_a_slot_of_one_group_and_says_how_it_took_each_donors_state(members, local_population):
    """One group built (for member 0), each later member on a slot of it; each exploit's line in the member's log says
    the donor's checkpoint was read from disk: the donor, which ran before, had freed its slot."""
    import re

    logs = {run_dir: (run_dir / "tinker_exp.log").read_text() for run_dir in members}
    built = [re.search(r"slot \d of 4 on this process's group, built for (this|an earlier) trial", text).group(1) for text in logs.values()]
    assert built == ["this", "an earlier", "an earlier", "an earlier"]
    assert "4 local jobs, 1 at a time on the slots of one group" in local_population[1]
    for run_dir, text in logs.items():
        said = re.findall(r"\] - (checkpoint \S+: (?:loaded from disk|taken in place).*)$", text, re.MULTILINE)
        exploits = [row["exploit"] for row in read_jsonl(run_dir / POPULATION_FILE) if row["exploit"]]
        assert said == [f"checkpoint {e['checkpoint']}: loaded from disk (no other slot of this group holds its state now)" for e in exploits]


def test_an_exploit_continues_from_the_donors_state_in_the_same_job(members):
    """The first step after an exploit starts from the donor's weights: its loss and grad norm are the donor's at
    that step (computed before any value of the new plan acts) wherever the donor carried on there."""
    checked = 0
    for run_dir in members:
        for row in read_jsonl(run_dir / POPULATION_FILE):
            exploit = row["exploit"]
            donor = members[exploit["member"]] if exploit else None
            if donor is None or read_jsonl(donor / POPULATION_FILE)[row["step"] // K - 1]["exploit"]:
                continue
            own, theirs = metrics_rows(run_dir)[row["step"]], metrics_rows(donor)[row["step"]]
            assert (own["train/loss"], own["train/grad_norm"]) == (theirs["train/loss"], theirs["train/grad_norm"])
            checked += 1
    assert checked >= 1


def test_the_best_members_printed_replay_and_a_three_run_lineage_replay_bitwise(local_population, members, warm_pool, tmp_path):
    """The printed replay command of the best member, and the same command for the member whose lineage spans three
    run dirs (forced), run as ordinary runs from step 0: bitwise their lineages' losses, grad norms, val losses and
    requested and applied values at every step. They train on the session's warm pool, as a user's replay would with
    a pool up."""
    from omegaconf import OmegaConf

    sweep, _ = local_population
    saved = OmegaConf.to_container(OmegaConf.load(sweep / "population_results.yaml"))
    best = sweep / str(saved["best_member"])
    assert compared(replay(saved["replay_command"], tmp_path / "best", warm_pool)) == compared(lineage_rows(best))
    member, donor = members[LOCAL_FORCED["member"]], members[LOCAL_FORCED["donor"]]
    assert any(r["exploit"] and r["step"] < LOCAL_FORCED["step"] for r in read_jsonl(donor / POPULATION_FILE)), "a lineage of two"
    lineage = lineage_rows(member)
    assert compared(replay(replay_command(str(member), saved["replay_overrides"]), tmp_path / "forced", warm_pool)) == compared(lineage)
    assert len(set(realized_values(member)["lr"][2:])) > 1


def test_each_members_wandb_run_holds_its_place_and_its_exploits(members):
    member = members[LOCAL_FORCED["member"]]
    records = wandb_records(wandb_run_file(member))
    run = wandb_run_record(records)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["population.member"] == int(member.name)
    assert run.run_group == sweep_group(str(member.parent))  # the sweep's group, as any sweep job's
    summary = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "summary" for u in r.summary.update}
    table = summary["population/exploits"]
    assert table["_type"] == "table-file" and table["ncols"] == 4
    exploits = [r for r in read_jsonl(member / POPULATION_FILE) if r["exploit"]]
    assert table["nrows"] == len(exploits) >= 2
    (path,) = (member / "wandb").glob(f"offline-run-*/files/{table['path']}")
    data = json.loads(path.read_text())
    assert data["columns"] == ["step", "donor", "donor step", "values"]
    assert data["data"] == [[r["step"], r["exploit"]["member"], r["exploit"]["step"], json.dumps(r["values"])] for r in exploits]


def test_the_pbt_boundary_benchmark_runs_tiny_on_a_members_checkpoints(members, ray_address, tmp_path):
    """benchmarks/pbt_boundary.py with one round of 4 steps (one boundary, at step 2), a member of the population its
    donor (`--donor`: its checkpoint at step 2, instead of a run trained for it): a plain run, a member that carries on
    and one that exploits the donor's checkpoint (the script checks each member's decisions); no figure is asserted."""
    import subprocess

    from helpers import REPO, environment

    donor = next(m for m in members if (m / "checkpoints" / "step_00000002" / "MANIFEST.json").is_file())
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pbt_boundary.py"), "--rounds", "1", "--steps", "4", "--interval", "2",
         "--set", "trainer.batch_size=4", "--set", "lora=r8", "--donor", str(donor), "--keep", str(tmp_path)],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address, POPULATION_ENV: None}), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "round 0 (plain then carry on then exploit): between steps at the boundaries: plain " in result.stdout
    for line in ("medians: one training step ", "a boundary that carries on: ", "a boundary that exploits: "):
        assert line in result.stdout, result.stdout
    assert not (tmp_path / "donor").exists()  # none trained
    exploit = read_jsonl(tmp_path / "exploit_0" / "0" / "population.jsonl")
    assert [(row["step"], row["rank"], row["of"], row["exploit"]["member"]) for row in exploit] == [(2, 2, 2, 1)]
    assert exploit[0]["exploit"]["checkpoint"] == str(donor / "checkpoints" / "step_00000002")


COMPARED = ("train/loss", "train/grad_norm", "val/loss", "requested/", "applied/")  # what a replay must give bitwise


def compared(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k == "train/step" or k.startswith(COMPARED)} for row in rows]


def check_population(sweep, out: str, forced: dict) -> dict:
    """What every finished population of POPULATION holds: 4 completed members, 3 boundaries each posted on the
    board, the forced exploit (`forced`: member, step, donor), the summary ranked by final objective with each member's
    exploits as its population.jsonl says, population_results.yaml's best and the replay line printed."""
    from omegaconf import OmegaConf

    from tinker_exp.sweep.pbt import realized_override, sent_values

    summary = read_jsonl(sweep / "summary.jsonl")
    assert [row["status"] for row in summary] == ["COMPLETED"] * 4, summary
    objectives = [row["objective"] for row in summary]
    assert objectives == sorted(objectives) and sorted(row["member"] for row in summary) == [0, 1, 2, 3]
    for row in summary:
        run_dir = sweep / str(row["member"])
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["train/step"] for r in rows] == list(range(8)) and rows[-1]["val/loss"] == row["objective"]
        boundaries = read_jsonl(run_dir / "population.jsonl")
        assert [b["step"] for b in boundaries] == [2, 4, 6]
        assert row["exploits"] == [{"donor": b["exploit"]["member"], "step": b["step"]} for b in boundaries if b["exploit"]]
        assert row["n_exploits"] == len(row["exploits"]) and row["final"] == boundaries[-1]["values"]
        assert sorted(p.name for p in (sweep / "population" / str(row["member"])).iterdir()) == ["2.json", "4.json", "6.json"]
        lineage = lineage_rows(run_dir)  # the realized schedule: what the lineage sent at every step, exactly
        assert [r["train/step"] for r in lineage] == list(range(8))
        realized = OmegaConf.to_container(OmegaConf.load(run_dir / "override" / "realized.yaml"))
        assert realized == realized_override(sent_values(lineage))
    forced_member = next(row for row in summary if row["member"] == forced["member"])
    assert {"donor": forced["donor"], "step": forced["step"]} in forced_member["exploits"]
    table = out[out.index("population summary"):]
    printed = {line.split()[0].lstrip("*"): line.split() for line in table.splitlines()[3:] if line.split()[:1]}
    assert all(printed[str(row["member"])][2] == str(row["n_exploits"]) for row in summary)  # the exploits column
    saved = OmegaConf.to_container(OmegaConf.load(sweep / "population_results.yaml"))
    assert saved["best_member"] == summary[0]["member"] and saved["best_objective"] == objectives[0]
    assert saved["best_run_dir"] == str(sweep / str(summary[0]["member"])) and saved["n_completed"] == 4
    assert f"replay the best member from step 0: {saved['replay_command']}" in out
    return saved


def replay(command: str, run_dir, pool: dict) -> list[dict]:
    """A printed replay command run as an ordinary run (no population in its environment), from step 0, on `pool`."""
    import shlex

    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "tinker_exp"]
    run_warm({**pool, POPULATION_ENV: None}, *args[3:], f"hydra.run.dir={run_dir}")
    assert "boundary" not in (run_dir / "tinker_exp.log").read_text()  # an ordinary run
    return read_jsonl(run_dir / "metrics.jsonl")


def test_a_population_on_the_local_slurm_cluster(slurm_env, tmp_path):
    """The same population as one Slurm job array over both nodes (a worker a member: each node has one CPU):
    every member completes, the board is shared through the sweep dir, member 3 exploits member 0 in flight, the
    summary and results agree."""
    from helpers import job_json

    sweep = tmp_path / "sweep"
    # Test-only: the tiny model's scores may not put member 3 in the bottom at step 4. Its donor, member 0, has posted
    # there before: the cluster's two 1-CPU nodes run members 0 and 1 first, then 2 and 3.
    forced = {"member": 3, "step": 4, "donor": 0}
    result = run_cli_population(*POPULATION, "logger=none", "backend.num_workers=1", force(forced), "hydra/launcher=slurm_local",
                                f"hydra.sweep.dir={sweep}", env=slurm_env)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    check_population(sweep, out, forced)
    jobs = [job_json(sweep / str(m))["slurm"] for m in range(4)]
    assert len({job["array_job_id"] for job in jobs}) == 1 and len({job["nodelist"] for job in jobs}) == 2


def run_cli_population(*args: str, env: dict):
    return run_cli(*args, env={**env, POPULATION_ENV: None}, timeout=900)
