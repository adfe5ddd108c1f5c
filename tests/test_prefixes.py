"""Shared plan prefixes in a grid (tinker_exp/sweep/prefixes.py): the planner on plain configs and plans, and a
point's start from its source's checkpoint with FakeWorkers (its rows, its lineage, a source that ended without the
checkpoint, a cancel while it waits). The real grid on verl's workers, bitwise its points run alone:
tests/test_sweeps.py `test_a_grid_trains_a_shared_plan_prefix_once_each_point_bitwise_its_run_alone`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fakes import fake_workers
from helpers import compose, job_json, metrics_rows, without_timings
from tinker_exp import config
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run, validate
from tinker_exp.sweep import prefixes
from tinker_exp.sweep.prefixes import MIN_SHARED_STEPS, Share, common_prefix, keep_steps, plan_shares, shares_line
from tinker_exp.train.checkpoints import saved_steps, step_of
from tinker_exp.train.start import SHARED_FROM, SharedPrefix

WSD = ["+override=lr_wsd", "trainer.steps=12", "override.lr.warmup_steps=2"]


def point(*overrides: str):
    """A grid point's checked config and its plan, as the sweeper has them before launch."""
    cfg = config.load(compose(*overrides))
    return cfg, validate(cfg)


def shares_of(*points: tuple[str, ...], min_steps: int = MIN_SHARED_STEPS) -> list[Share | None]:
    configs, plans = zip(*(point(*overrides) for overrides in points))
    return plan_shares(configs, plans, min_steps)


def test_a_wsd_grid_shares_its_stable_phase_each_point_from_the_earlier_point_it_shares_most_with():
    """decay_steps 2, 6, 4 of 12: the decays start at 10, 6 and 8, and a decay's first value is the held one."""
    grid = [point(*WSD, f"override.lr.decay_steps={d}") for d in (2, 6, 4)]
    configs, plans = zip(*grid)
    lr = [plan.column("lr") for plan in plans]
    assert common_prefix(plans[0], plans[1]) == 7 and (lr[0][:7] == lr[1][:7]).all() and lr[0][7] != lr[1][7]
    shares = plan_shares(configs, plans)
    assert shares == [None, Share(0, 7), Share(0, 9)]  # point 2 shares 9 with point 0, 7 with point 1
    assert keep_steps(shares) == {0: [7, 9]}
    assert shares_line(shares, plans).startswith(
        "shared prefixes: 2 of 3 points branch from another's checkpoint; 20 steps trained of the grid's 36")


def test_plans_that_differ_at_step_0_share_nothing():
    assert shares_of([*WSD], ["+override=lr_wsd", "trainer.steps=12", "override.lr.warmup_steps=3"]) == [None, None]
    a, b = point(*WSD)[1], point("+override=lr_wsd", "trainer.steps=12", "override.lr.warmup_steps=3")[1]
    assert common_prefix(a, b) == 1  # step 0's warmup value is the same; 1 < MIN_SHARED_STEPS
    assert shares_of(["optimizer.lr=1e-3"], ["optimizer.lr=2e-3"]) == [None, None]  # differ in the optimizer's values


def test_a_cosine_and_a_constant_lr_share_their_first_step_only():
    """A cosine without warmup starts at its peak, the constant's value: one step, too short a share to branch."""
    pair = (["+override=lr_cosine", "override.lr.warmup_steps=0", "trainer.steps=12"], ["+override.lr=1e-3", "trainer.steps=12"])
    (_, cosine), (_, constant) = point(*pair[0]), point(*pair[1])
    assert common_prefix(cosine, constant) == 1
    assert shares_of(*pair) == [None, None] and shares_of(*pair, min_steps=1) == [None, Share(0, 1)]


def test_longer_runs_of_one_constant_plan_share_all_but_the_shorter_runs_last_step():
    """The last step of a run is its own (its final evaluation and checkpoint): 8 steps share 7 with 12, 12 share 11."""
    runs = [["+override.lr=1e-3", f"trainer.steps={n}"] for n in (8, 12, 16)]
    assert shares_of(*runs) == [None, Share(0, 7), Share(1, 11)]


@pytest.mark.parametrize(
    "other, both, why",
    [
        (["trainer.seed=1"], [], "another seed: another data order"),
        (["optimizer.weight_decay=0.1"], [], "another optimizer"),
        (["trainer.batch_size=4"], [], "another batch"),
        (["trainer.eval_every=3"], [], "other evaluations in the rows"),
        (["+override.weight_decay=0.0"], [], "another key sent: other rows"),
        ([], ["dry_run=true"], "a dry run trains nothing"),
        ([], ["trainer.eval_every=2", "trainer.early_stop.patience=1"], "early stopping: not shared"),
    ],
)
def test_points_whose_configs_differ_beyond_their_plans_share_nothing(other, both, why):
    same = ["+override.lr=1e-3", "trainer.steps=12", *both]
    assert shares_of(same, [*same, "trainer.steps=16", *other]) == [None, None], why
    if not both:  # without the difference they share
        assert shares_of(same, [*same, "trainer.steps=16"]) == [None, Share(0, 11)]


def test_a_source_keeps_its_checkpoint_at_the_steps_others_continue_from_and_a_point_continues_as_if_alone(tmp_path):
    """With FakeWorkers: the source saves and keeps a checkpoint at 7 (not a save step of its own; keep_last=1); the
    point continues there: its rows are those of its run alone, steps 0..6 marked with the source's job number."""
    base = [*WSD, "checkpoint.every_steps=4", "checkpoint.keep_last=1", "logger=none"]
    source_dir, shared_dir, alone_dir = tmp_path / "0", tmp_path / "1", tmp_path / "alone"
    source = fake_workers()
    run(compose(*base, "override.lr.decay_steps=2"), source_dir, place=GivenWorkers(source), prefix=(None, (7,)))
    assert source.started[0].saved == [4, 7, 8, 12]
    assert [step_of(p) for p in saved_steps(source_dir / "checkpoints")] == [12, 7]  # kept outside the rotation

    shared = fake_workers()
    role = SharedPrefix(source_dir, 0, 7, tmp_path / "ended_0")
    run(compose(*base, "override.lr.decay_steps=6"), shared_dir, place=GivenWorkers(shared), prefix=(role, ()))
    run(compose(*base, "override.lr.decay_steps=6"), alone_dir, place=GivenWorkers(fake_workers()))
    rows, alone = metrics_rows(shared_dir), metrics_rows(alone_dir)
    assert len(shared.started[0].calls) == 5  # steps 7..11 trained here
    assert [row.get(SHARED_FROM) for row in rows] == [0] * 7 + [None] * 5
    assert without_timings([{k: v for k, v in row.items() if k != SHARED_FROM} for row in rows]) == without_timings(alone)
    assert without_timings(rows[:7]) == without_timings([{**row, SHARED_FROM: 0} for row in metrics_rows(source_dir)[:7]])
    assert job_json(shared_dir)["shared_prefix"] == {
        "from": str(source_dir), "job": 0, "step": 7, "checkpoint": str(source_dir / "checkpoints" / "step_00000007")}
    assert "branch" not in (shared_dir / "plan.json").read_text()  # its plan is its own, from step 0


def test_a_point_whose_source_ended_without_the_checkpoint_trains_from_step_0(tmp_path, caplog):
    source_dir = tmp_path / "0"
    run(compose(*WSD, "logger=none"), source_dir, place=GivenWorkers(fake_workers()))  # no checkpoint at 5
    (tmp_path / "ended_0").touch()
    started = fake_workers()
    with caplog.at_level("INFO"):
        run(compose(*WSD, "logger=none", "override.lr.decay_steps=6"), tmp_path / "1", place=GivenWorkers(started),
            prefix=(SharedPrefix(source_dir, 0, 5, tmp_path / "ended_0"), ()))  # fmt: skip
    assert len(started.started[0].calls) == 12 and not any(SHARED_FROM in row for row in metrics_rows(tmp_path / "1"))
    assert (f"shared prefix: job 0 ended without its checkpoint at step 5 ({source_dir}/checkpoints/step_00000005); "
            "this run trains from step 0") in caplog.messages  # fmt: skip


def test_a_point_waits_for_its_checkpoint_to_appear_and_stops_when_cancelled(tmp_path, caplog):
    """Its wait ends as the checkpoint appears (here: put in place at its first look), or at a cancel (a thread's job)."""
    source_dir = tmp_path / "0"
    run(compose(*WSD, "logger=none", "checkpoint.every_steps=4", "checkpoint.keep_last=0"), source_dir, place=GivenWorkers(fake_workers()))
    held = tmp_path / "held"
    shutil.move(source_dir / "checkpoints" / "step_00000004", held)
    looks = []

    def appears() -> bool:
        looks.append(1)
        shutil.move(held, source_dir / "checkpoints" / "step_00000004")
        return False

    started = fake_workers()
    with caplog.at_level("INFO"):
        run(compose(*WSD, "logger=none", "trainer.steps=10"), tmp_path / "1", place=GivenWorkers(started),
            prefix=(SharedPrefix(source_dir, 0, 4, tmp_path / "ended_0", appears), ()))  # fmt: skip
    assert looks == [1] and len(started.started[0].calls) == 6
    assert f"shared prefix: waiting for job 0's checkpoint at step 4 ({source_dir}/checkpoints/step_00000004)" in caplog.messages
    with pytest.raises(KeyboardInterrupt):
        run(compose(*WSD, "logger=none", "trainer.steps=10"), tmp_path / "2", place=GivenWorkers(fake_workers()),
            prefix=(SharedPrefix(source_dir, 0, 3, tmp_path / "ended_0", lambda: True), ()))  # fmt: skip
    assert not (tmp_path / "2" / "metrics.jsonl").exists()


def test_the_sweep_dir_says_each_jobs_part_and_a_rerun_decides_again(tmp_path):
    shares = [None, Share(0, 7), None, Share(2, 5)]
    run_dirs = [tmp_path / str(n) for n in range(4)]
    prefixes.write(tmp_path, shares, run_dirs)
    assert prefixes.role_of(tmp_path, 0) == (None, (7,)) and prefixes.role_of(tmp_path, 2) == (None, (5,))
    assert prefixes.role_of(tmp_path, 1) == (SharedPrefix(run_dirs[0], 0, 7, tmp_path / prefixes.ENDED / "0"), ())
    prefixes.mark_ended(tmp_path, 0)
    assert prefixes.role_of(tmp_path, 1)[0].ended.exists() and prefixes.role_of(tmp_path, 3)[0].ended == tmp_path / ".prefixes" / "2"
    prefixes.clear(tmp_path)
    assert prefixes.role_of(tmp_path, 1) == (None, ()) and not (tmp_path / prefixes.ENDED).exists()
    prefixes.mark_ended(tmp_path, 0)  # no shared prefixes in this sweep: nothing written
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("share, executor, shared", [(True, "local", True), (False, "local", False), (True, "slurm", False)])
def test_the_grid_shares_on_the_local_launcher_unless_told_not_to(share, executor, shared, caplog):
    """hydra.sweeper.share_prefixes (default true) on our local launcher; Slurm's jobs each train alone."""
    from types import SimpleNamespace

    from hydra_plugins.tinker_exp_plugins.launchers import GridSweeper

    sweeper = GridSweeper(None, None, share_prefixes=share)
    sweeper.ours, sweeper.launcher = True, SimpleNamespace(_EXECUTOR=executor)
    configs = [point(*WSD, f"override.lr.decay_steps={d}")[0] for d in (2, 6)]
    with caplog.at_level("INFO"):
        assert sweeper.plan_prefixes(configs) == ([None, Share(0, 7)] if shared else [None, None])
    said = [m for m in caplog.messages if m.startswith("shared prefixes:")]
    assert said == (["shared prefixes: 1 of 2 points branch from another's checkpoint; 17 steps trained of the grid's 24 "
                     "(hydra.sweeper.share_prefixes=false: each trains alone)"] if shared else [])  # fmt: skip


def test_a_share_prefixes_that_is_not_a_bool_is_one_line_and_writes_nothing(monkeypatch, capsys, tmp_path):
    from helpers import run_main

    code, out, err = run_main(monkeypatch, capsys, "-m", "hydra.sweeper.share_prefixes=maybe", "optimizer.lr=1e-3,1e-4",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [
        "tinker_exp: config error: hydra.sweeper.share_prefixes: expected true or false, got 'maybe' (str)"]
    assert not any(tmp_path.iterdir())
