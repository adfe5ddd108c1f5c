"""PBT populations on population workers (hydra/sweeper=pbt hydra.launcher.workers=W): the P members in W Slurm jobs
that each start their workers once and claim members from a ledger in the sweep dir (tinker_exp/sweep/workers.py
`items_study`). The ledger's bookkeeping on a real journal file and the refused settings (pure, fast); a population
of LoRA members on 2 workers of 2 slots on the suite's Slurm cluster."""

from __future__ import annotations

import os
import re
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from helpers import run_main

# --- pure: the ledger of members ----------------------------------------------------------------------------------


def test_each_member_is_claimed_once_a_lost_one_again_and_a_new_launch_starts_a_new_ledger(tmp_path, caplog):
    """Two workers claim a population of 3: each member once, in order, the fourth claim told to look again (False)
    while all run. Member 1's worker is lost: failed with why, named as a member, and claimed again (the same member)
    before the sweep is done; what each member came to, as its job's return. A second launch of the sweep gets a
    new ledger; the members the first left running are failed there and their worker named, to be cancelled."""
    from hydra_plugins.tinker_exp_plugins.launchers import job_objective
    from hydra_plugins.tinker_exp_plugins.pbt_sweeper import LEDGER, member_line, member_return
    from tinker_exp.sweep.study import finished
    from tinker_exp.sweep.workers import ITEM, ask_item, items_study, lose, lost, settled, take, workers_of_earlier_launches

    ledger = items_study(tmp_path, 3, LEDGER)
    ask = lambda: ask_item(ledger, 3)  # noqa: E731
    claims = [take(ledger, 3, ask, worker, tmp_path) for worker in ("5_0", "5_1", "5_0")]
    assert [c.params[ITEM] for c in claims] == [0, 1, 2] and ledger.study_name == "population-0"
    assert take(ledger, 3, ask, "5_1", tmp_path) is False and len(ledger.trials) == 3

    ((trial, why),) = lost(ledger.get_trials(states=(TrialState.RUNNING,)), {"5_1": "NODE_FAIL"}, 0.0, stale_s=1e12)
    line = lose(ledger, trial, why, tmp_path, label=lambda t: f"member {t.params[ITEM]}")
    assert line == "member 1 failed: its worker job 5_1 ended (NODE_FAIL) while it ran; retried as trial 3"
    again = take(ledger, 3, ask, "5_0", tmp_path)
    assert again.params[ITEM] == 1 and again.number == 3
    for run, member, value in ((claims[0], 0, 5.5), (again, 1, 5.25)):
        run.set_user_attr("run_dir", str(tmp_path / str(member)))
        ledger.tell(run, value)
    assert [t.params[ITEM] for t in settled(ledger)] == [0, 1]  # the lost run does not count, its retry does
    with caplog.at_level("INFO"):
        for trial in finished(ledger):
            member_line(trial)  # as the sweep says each run's end; the lost run was said as it was lost (`lose`)
    assert [r.getMessage() for r in caplog.records if r.name.endswith("pbt_sweeper")] == [f"member 0: completed, objective 5.5; run dir {tmp_path / '0'}",
                                                        f"member 1: completed, objective 5.25; run dir {tmp_path / '1'}"]  # fmt: skip
    assert [job_objective(member_return(ledger, m, [f"m={m}"])) for m in range(3)] == [
        (5.5, None), (5.25, None), (None, "not run: every population worker ended first")
    ]  # fmt: skip

    second = items_study(tmp_path, 3, LEDGER)
    assert second.study_name == "population-1" and [t.state for t in second.trials] == [TrialState.WAITING] * 3
    assert workers_of_earlier_launches(tmp_path, LEDGER) == ["5_0"]  # member 2 still running under it
    assert ledger.trials[2].state == TrialState.FAIL and "cut off" in job_objective(member_return(ledger, 2, []))[1]
    assert workers_of_earlier_launches(tmp_path, LEDGER) == []  # failed once, not again


def test_a_lost_member_waits_for_its_lost_runs_lock_to_be_free_to_take_over(tmp_path):
    """The lock a killed member's run left in its run dir: of a pid gone on this host, free at once; of another host,
    held while its heartbeat is fresh (the wait bounded), free once it is stale; no lock, free."""
    import json
    import socket

    from tinker_exp.sweep.workers import lost_lock_freed
    from tinker_exp.train.rundir_lock import LOCK_FILE, STALE_AFTER_S

    lock = tmp_path / LOCK_FILE
    assert lost_lock_freed(tmp_path, wait_s=0)

    def left_by(host: str, pid: int, age_s: float) -> None:
        lock.write_text(json.dumps({"host": host, "pid": pid, "started": None, "since": "then", "token": "t"}))
        os.utime(lock, (lock.stat().st_atime, lock.stat().st_mtime - age_s))

    gone = max(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()) + 100000  # no such process
    left_by(socket.gethostname(), gone, 0)
    assert lost_lock_freed(tmp_path, wait_s=0)
    left_by("another-node", os.getpid(), 1)
    assert not lost_lock_freed(tmp_path, wait_s=0.2, poll_s=0.1)
    left_by("another-node", os.getpid(), STALE_AFTER_S + 1)
    assert lost_lock_freed(tmp_path, wait_s=0)


# --- bad settings: one line, exit 2, before anything is written or submitted ---------------------------------------

POPULATION = [
    "-m", "hydra/sweeper=pbt", "hydra/launcher=slurm_local", "+override=lr_cosine", "logger=none",
    "override.lr.value=tag(log,interval(1e-4,3e-3))", "trainer.steps=8", "trainer.eval_every=2", "hydra.sweeper.interval=2",
]  # fmt: skip
REFUSED = [
    (["hydra.launcher.workers=2"], "hydra.launcher.workers=2 with hydra.launcher.slots=auto (1 here): 2 members train at "
     "once, and the population's 4 train side by side; set workers * slots >= 4 (slots hold LoRA members)"),  # full fine-tuning
    (["hydra.launcher.workers=3", "hydra.launcher.slots=1", "lora=r8"], "hydra.launcher.workers=3 with hydra.launcher.slots=1: "
     "3 members train at once, and the population's 4 train side by side; set workers * slots >= 4"),
    (["hydra.launcher.workers=2", "hydra.launcher.slots=2"], "4 of 4 sweep points are wrong; no job was started"),  # not LoRA
]  # fmt: skip


@pytest.mark.parametrize("args, line", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_workers_that_cannot_train_the_members_side_by_side_are_refused(monkeypatch, capsys, tmp_path, args, line):
    """A population's members rank against each other at every boundary: workers that cannot hold them all at once
    (or slots that cannot hold a full fine-tuning member) are one line, exit 2, nothing written, nothing submitted."""
    code, out, err = run_main(monkeypatch, capsys, *POPULATION, f"hydra.sweep.dir={tmp_path / 'sweep'}", *args)
    assert code == 2 and err.startswith(f"tinker_exp: config error: {line}"), err
    assert "Traceback" not in out + err and not (tmp_path / "sweep").exists()
    if "slots=2" in " ".join(args):  # every member named with why
        assert "hydra.launcher.slots=2: " in err and "slots hold LoRA trials" in err, err
    else:
        assert len(err.strip().splitlines()) == 1, err
    assert "TINKER_EXP_POPULATION" not in os.environ


# --- real: the suite's Slurm cluster --------------------------------------------------------------------------------

STEPS, FORCED = 12, {"member": 3, "step": 2, "donor": 0}
"""Member 3 takes member 0's checkpoint at the first boundary (test-only: the tiny model's scores may tie), wherever
each of them trains: a worker's other slot (in place) or the other worker (from disk)."""


def test_a_population_on_two_workers_of_two_slots_survives_a_killed_worker(slurm_env, tmp_path):
    """4 LoRA members on 2 worker jobs of 2 slots (one sbatch, one group built a worker), boundaries every 2 steps of
    12. Once member 3 has exploited member 0 at step 2, its worker's process is killed with kill -9: the sweep sees
    its job end, fails the members it trained (why, named as members: member 3 and its slot-mate, unless that one had
    already completed) and enqueues them again; the other worker, as its
    own members end, runs them on in their run dirs from their newest checkpoints. Every member completes once (the
    lost ones: once after their lost run); each member's rows and board posts are each step once; the forced exploit
    stands in member 3's population.jsonl; the summary, population_results.yaml and the replay line agree; the
    queue is empty at the end."""
    import sys

    from omegaconf import OmegaConf

    from helpers import job_json, read_jsonl, squeue, wait_until
    from test_study_workers import kill_a_worker_midway
    from tinker_exp.sweep.study import open_storage
    from tinker_exp.sweep.workers import ITEM, ITEMS_JOURNAL

    command = [
        sys.executable, "-m", "tinker_exp", "-m", "hydra/sweeper=pbt", "hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}",
        "+override=lr_cosine", "override.lr.value=tag(log,interval(1e-4,3e-3))", f"trainer.steps={STEPS}", "trainer.eval_every=2",
        "trainer.batch_size=4", "hydra.sweeper.population=4", "hydra.sweeper.interval=2", "backend.num_workers=1", "logger=none",
        "lora=r8", "hydra.launcher.workers=2", "hydra.launcher.slots=2",
        "hydra.sweeper.force_exploit={" + ",".join(f"{k}:{v}" for k, v in FORCED.items()) + "}",
    ]  # fmt: skip
    run_3 = tmp_path / "3"
    rows = lambda run_dir, name: read_jsonl(run_dir / name) if (run_dir / name).exists() else []  # noqa: E731
    env = {**slurm_env, "TINKER_EXP_POPULATION": None}
    ready = lambda: rows(run_3, "population.jsonl")  # noqa: E731  (its first boundary decided: the forced exploit)
    output, worker = kill_a_worker_midway(command, env, tmp_path / "population.log", ready, run_3, "member 3 reached no boundary")
    ended_on = {m: "{array_job_id}_{array_task_id}".format(**job_json(tmp_path / str(m))["slurm"]) for m in range(4)}
    lost = sorted(m for m in range(4) if any(f"member {m} failed: its worker job {worker} ended" in line for line in output.splitlines()))
    # The killed worker's two members: 3, and its slot-mate unless that one had already completed there (member 3 may
    # wait at its first boundary for its donor, trained on the other worker, while its slot-mate trains to the end).
    completed_there = [m for m in range(4) if ended_on[m] == worker]
    killed_at = output.index(f"failed: its worker job {worker} ended")
    assert 3 in lost and len(lost) + len(completed_there) == 2, output[-3000:]
    assert all(output.index(f"member {m}: completed") < killed_at for m in completed_there), output[-3000:]
    assert all(ended_on[m] != worker for m in lost)  # the lost ones completed on the other worker

    ledger = optuna.load_study(study_name="population-0", storage=open_storage(f"journal://{tmp_path / ITEMS_JOURNAL}"))
    runs = {m: [t.state for t in ledger.trials if t.params[ITEM] == m] for m in range(4)}
    assert runs == {m: ([TrialState.FAIL] if m in lost else []) + [TrialState.COMPLETE] for m in range(4)}  # each completed once

    summary = read_jsonl(tmp_path / "summary.jsonl")
    assert sorted((row["member"], row["status"]) for row in summary) == [(m, "COMPLETED") for m in range(4)]
    for row in summary:
        run_dir = tmp_path / str(row["member"])
        assert [r["train/step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(STEPS))  # each row once
        boundaries = rows(run_dir, "population.jsonl")
        assert [b["step"] for b in boundaries] == list(range(2, STEPS, 2))
        assert row["exploits"] == [{"donor": b["exploit"]["member"], "step": b["step"]} for b in boundaries if b["exploit"]]
        posts = sorted(int(p.stem) for p in (tmp_path / "population" / str(row["member"])).iterdir())
        assert posts == list(range(2, STEPS, 2))
    assert rows(run_3, "population.jsonl")[0]["exploit"]["member"] == FORCED["donor"]
    # member 3 runs on from the newest checkpoint its lost run saved (a boundary's: 2 or later); its slot-mate too,
    # or from step 0 where it had saved none yet (each row once all the same: above)
    resumed = re.search(r"resuming from \S+/checkpoints/step_(\d+) at step (\d+)", (run_3 / "tinker_exp.log").read_text())
    assert resumed and int(resumed.group(1)) == int(resumed.group(2)) >= 2, output[-3000:]
    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "population_results.yaml"))
    assert saved["n_completed"] == 4 and saved["best_member"] == min(summary, key=lambda r: r["objective"])["member"]
    assert f"replay the best member from step 0: {saved['replay_command']}" in output
    # one group built a worker (for its first member; the lost members ran on after on the other's, built earlier)
    assert sum("built for this trial" in (tmp_path / str(m) / "tinker_exp.log").read_text() for m in range(4)) == 2
    wait_until(lambda: not squeue(slurm_env).strip(), 120, "worker jobs left in the queue", poll=1)  # COMPLETING a while
