"""What a branch's pictures and summaries show, read back as data (titles, legend labels, each line's x range, the
vertical line at the branch step), not as pixels. Run dirs are written by hand with the project's own writers
(main.write_plan for plan.json with a branch's lineage, job.json with it, metrics.jsonl with the branch's own steps
only), as tests/test_branch.py's (fake-worker) branches leave them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from tinker_exp import report as command
from tinker_exp.run import write_plan
from tinker_exp.optim.plan import plan_for
from tinker_exp.optim.preview import draw_plan, history, plot_plan, read_plan_file
from tinker_exp.sweep.jobs import job_info, read_outcome, summary_table, write_job_info, write_summary
from tinker_exp.formats import read_jsonl
from tinker_exp.sweep.report import draw_report, read_run
from tinker_exp.train.objective import write_objective

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
WSD = {"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 1, "decay_steps": 3}}
COSINE = {"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 0, "min_ratio": 0.1}}
STEPS = 12


def make_run(run_dir: Path, schedule=WSD, steps=STEPS, trunk: Path | None = None, at: int = 0,
             overrides=(), num=None) -> Path:  # fmt: skip
    """A finished run as it leaves its dir; with `trunk`: a branch of it at step `at` (lineage in plan.json and
    job.json, metrics.jsonl from `at` on). Losses tell whose a row is: the trunk's 5 - step/10, a branch's 4 - step/10."""
    lineage = None
    if trunk is not None:
        checkpoint = trunk / "checkpoints" / f"step_{at:08d}"
        lineage = {"from": str(trunk), "step": at, "checkpoint": str(checkpoint), "trunk_wandb_run_id": None}
    write_job_info(run_dir, {**job_info(num, list(overrides)), **({"branch": lineage} if lineage else {})})
    write_plan(plan_for(schedule, dict(ADAMW), steps, "AdamW"), run_dir, [], lineage)
    base = 4.0 if trunk is not None else 5.0
    rows = [{"train/step": s, "train/loss": base - s / 10, **({"val/loss": base - s / 10 + 0.05} if s % 2 else {})}
            for s in range(at, steps)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "config.yaml").write_text(f"trainer:\n  steps: {steps}\nlogger:\n  run_name: null\n")
    return run_dir


def legend(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    assert len(legends) == 1
    return [t.get_text() for t in legends[0].get_texts()]


def lines_by_gid(ax) -> dict[str, list]:
    """The axes' drawn lines (not the vertical ones) by gid: each one's x data."""
    out: dict[str, list] = {}
    for line in ax.get_lines():
        gid = line.get_gid() or ""
        if gid and not gid.startswith("branch step"):
            out.setdefault(gid, []).append([int(x) for x in line.get_xdata()])
    return out


def branch_lines(ax) -> list[int]:
    """x of each vertical line at a branch step."""
    return sorted(int(line.get_xdata()[0]) for line in ax.get_lines() if (line.get_gid() or "").startswith("branch step"))


def test_history_follows_the_lineage_back_to_step_0(tmp_path):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4)
    b2 = make_run(tmp_path / "b2", COSINE, trunk=b1, at=8)
    early = make_run(tmp_path / "early", COSINE, trunk=b1, at=2)  # before b1's own steps: only the trunk's
    assert [(p.run_dir, p.first, p.end) for p in history(trunk)] == [(trunk, 0, None)]
    assert [(p.run_dir, p.first, p.end) for p in history(b2)] == [(trunk, 0, 4), (b1, 4, 8), (b2, 8, None)]
    assert [(p.run_dir, p.first, p.end) for p in history(early)] == [(trunk, 0, 2), (early, 2, None)]


def test_a_branchs_report_draws_the_trunk_grey_up_to_its_step_a_line_there_and_its_own_rows_after(tmp_path):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4, overrides=["+override=lr_cosine", f"branch.from={trunk}", "branch.step=4"])
    fig = draw_report([read_run(b1)], "run b1")
    assert fig._suptitle.get_text().splitlines()[:2] == ["run b1", "branch of t at step 4"]
    label = "+override=lr_cosine branch.from=t branch.step=4"  # the trunk named as in its own entry, not a whole path
    assert legend(fig) == ["train", "val", "trunk t (steps 0..3)", label]
    loss_ax, lr_ax = fig.axes
    assert lr_ax.get_ylabel() == "lr"
    drawn = lines_by_gid(loss_ax)
    assert drawn["trunk t (steps 0..3)"] == [[0, 1, 2, 3], [1, 3]]  # train, val: the trunk's rows before step 4 only
    own = drawn[label]
    assert own == [list(range(4, STEPS)), [5, 7, 9, 11]]
    trunk_loss = loss_ax.get_lines()[0]
    assert trunk_loss.get_color() == "0.55" and trunk_loss.get_linewidth() < 1.0  # grey and thin
    assert list(trunk_loss.get_ydata()) == [5.0, 4.9, 4.8, 4.7]  # read from the trunk's metrics.jsonl
    # The plan panel: the trunk's plan (its plan.json) before 4, the branch's own from 4.
    plans = lines_by_gid(lr_ax)
    assert plans["trunk t (steps 0..3)"] == [[0, 1, 2, 3]]
    assert plans[label] == [list(range(4, STEPS))]
    trunk_plan, branch_plan = read_plan_file(trunk / "plan.json"), read_plan_file(b1 / "plan.json")
    trunk_lr, branch_lr = (line.get_ydata() for line in lr_ax.get_lines()[:2])
    assert np.array_equal(trunk_lr, trunk_plan.column("lr")[:4])
    assert np.array_equal(branch_lr, branch_plan.column("lr")[4:])
    assert branch_lines(loss_ax) == branch_lines(lr_ax) == [4]


def test_a_branch_of_a_branch_draws_each_trunks_part(tmp_path):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4)
    b2 = make_run(tmp_path / "b2", WSD, trunk=b1, at=8)
    fig = draw_report([read_run(b2)], "run b2")
    assert legend(fig)[2:4] == ["trunk t (steps 0..3)", "trunk b1 (steps 4..7)"]
    drawn = lines_by_gid(fig.axes[0])
    assert drawn["trunk t (steps 0..3)"][0] == [0, 1, 2, 3]
    assert drawn["trunk b1 (steps 4..7)"][0] == [4, 5, 6, 7]
    assert branch_lines(fig.axes[0]) == [4, 8]
    assert fig._suptitle.get_text().splitlines()[1] == "branch of b1 at step 8"


def test_a_branch_whose_trunk_is_gone_draws_its_own_steps_and_says_so(tmp_path):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4)
    (trunk / "plan.json").unlink()
    with pytest.warns(UserWarning, match=f"its trunk {trunk} .branch.from. is not there"):
        run = read_run(b1)
    fig = draw_report([run], "run b1")
    assert not [label for label in legend(fig) if label.startswith("trunk")]
    assert branch_lines(fig.axes[0]) == [4]
    assert list(lines_by_gid(fig.axes[0]).values())[0][0] == list(range(4, STEPS))


def test_a_sweep_of_branches_shows_the_trunk_once_up_to_the_last_branch_step(tmp_path):
    trunk = make_run(tmp_path / "t")
    sweep = tmp_path / "sweep"
    for num, at in enumerate((4, 8)):
        make_run(sweep / str(num), COSINE, trunk=trunk, at=at, num=num,
                 overrides=["+override=lr_cosine", f"branch.from={trunk}", f"branch.step={at}"])  # fmt: skip
    fig = draw_report([read_run(sweep / str(n), f"job {n}") for n in range(2)], "sweep s")
    assert fig._suptitle.get_text().splitlines()[:2] == ["sweep s", "branches of t at steps 4, 8"]
    assert legend(fig) == ["train", "val", "trunk t (steps 0..7)", "job 0: branch.step=4", "job 1: branch.step=8"]
    drawn = lines_by_gid(fig.axes[0])
    assert drawn["trunk t (steps 0..7)"] == [list(range(8)), [1, 3, 5, 7]]  # once, up to the last branch step
    assert drawn["job 0: branch.step=4"][0] == list(range(4, STEPS))
    assert drawn["job 1: branch.step=8"][0] == list(range(8, STEPS))
    for ax in fig.axes:
        assert branch_lines(ax) == [4, 8]
    assert lines_by_gid(fig.axes[1])["trunk t (steps 0..7)"] == [list(range(8))]  # the trunk's plan once, too
    named = make_run(tmp_path / "wsd_trunk")  # a trunk whose dir says it is one: named once ("trunk trunk" before)
    branch = make_run(tmp_path / "b", COSINE, trunk=named, at=4, overrides=[f"branch.from={named}", "branch.step=4"])
    assert legend(draw_report([read_run(branch)], "run b"))[2] == "wsd_trunk (steps 0..3)"

    # The summary says it once, above the table (steps: each branch's own).
    outcomes = [read_outcome(n, ["branch.step=" + str(at)], "COMPLETED", sweep / str(n), None) for n, at in enumerate((4, 8))]
    assert [(o.branch_from, o.branch_step, o.steps) for o in outcomes] == [(str(trunk), 4, 8), (str(trunk), 8, 4)]
    table = summary_table(outcomes)
    assert table.splitlines()[0] == f"branches of {trunk} at steps 4, 8; grouped by branch step (a budget), the best of each marked *"
    assert table.count("branches of") == 1
    assert f"branches of {trunk} at steps 4, 8" in write_summary(sweep, outcomes).read_text()
    plain = make_run(tmp_path / "plain")
    assert summary_table([read_outcome(0, [], "COMPLETED", plain, None)]).startswith("job ")  # no line above


def test_branches_of_several_steps_are_compared_within_their_budget_in_the_summary_and_the_report(tmp_path):
    """Decays at steps 4 and 8, two shapes each: a later branch step is a bigger budget and tends to win whatever its decay, so each
    branch step's best is its own (summary: grouped, a * in each group; report: each group's best drawn thick)."""
    trunk = make_run(tmp_path / "t")
    sweep = tmp_path / "sweep"
    objectives = {0: 5.2, 1: 5.1, 2: 4.6, 3: 4.7}  # job: (step 4, 1-sqrt), (4, linear), (8, 1-sqrt), (8, linear)
    for num, (at, shape) in enumerate(((4, "1-sqrt"), (4, "linear"), (8, "1-sqrt"), (8, "linear"))):
        make_run(sweep / str(num), COSINE, trunk=trunk, at=at, num=num,
                 overrides=[f"branch.step={at}", f"override.lr.decay_shape={shape}"])  # fmt: skip
        write_objective(sweep / str(num), "val/loss", "last", objectives[num], None)
    outcomes = [read_outcome(n, read_run(sweep / str(n)).command_line, "COMPLETED", sweep / str(n), None, objective=objectives[n])
                for n in range(4)]  # fmt: skip
    table = summary_table(outcomes).splitlines()
    assert table[0] == f"branches of {trunk} at steps 4, 8; grouped by branch step (a budget), the best of each marked *"
    assert [line.split()[0] for line in table[3:]] == ["*1", "0", "*2", "3"]
    written = [row["num"] for row in read_jsonl(Path(write_summary(sweep, outcomes)).with_suffix(".jsonl"))]
    assert written == [1, 0, 2, 3]
    fig = draw_report([read_run(sweep / str(n), f"job {n}") for n in range(4)], "sweep s")
    assert fig._suptitle.get_text().splitlines()[2] == (
        "best of each branch step by val/loss (last): step 4: job 1, 5.1; step 8: job 2, 4.6"
    )
    assert fig.axes[-1].get_xlabel() == (  # rows count from 0, branch steps count steps done: both said
        "train/step (0 = the first step; dashed: branch step N, after N steps done, at the branch's first train/step)"
    )
    assert [label for label in legend(fig) if label.startswith("best")] == [
        "best at step 4: job 1: branch.step=4 override.lr.decay_shape=linear -> 5.1",
        "best at step 8: job 2: branch.step=8 override.lr.decay_shape=1-sqrt -> 4.6",
    ]


def test_the_report_command_draws_a_trunk_whole_and_its_branches_beside_it(tmp_path, capsys):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4, overrides=["+override=lr_cosine", "branch.step=4"])
    b2 = make_run(tmp_path / "b2", COSINE, trunk=trunk, at=8, overrides=["+override=lr_cosine", "branch.step=8"])
    runs = command.runs_of([trunk, b1, b2])
    fig = draw_report([read_run(d, name) for name, d in runs], command.title([trunk, b1, b2], runs))
    assert legend(fig) == ["train", "val", "trunk t (steps 0..11)", "b1: branch.step=4", "b2: branch.step=8"]
    drawn = lines_by_gid(fig.axes[0])
    assert drawn["trunk t (steps 0..11)"][0] == list(range(STEPS))  # given as a run: its whole curve, grey
    assert branch_lines(fig.axes[0]) == [4, 8]
    out = tmp_path / "together.png"
    assert command.main([str(trunk), str(b1), str(b2), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().out.strip() == str(out)


def test_a_branchs_plan_png_draws_the_trunks_plan_before_its_step_and_its_own_after(tmp_path):
    trunk = make_run(tmp_path / "t")
    b1 = make_run(tmp_path / "b1", COSINE, trunk=trunk, at=4)
    plan = read_plan_file(b1 / "plan.json")
    fig = draw_plan(plan, history(b1))
    title = fig._suptitle.get_text()
    assert title.splitlines()[0] == "branch of t at step 4; its own plan from there:"
    assert "lr: cosine" in title.splitlines()[1]
    (ax,) = fig.axes
    assert legend(fig) == ["trunk t (steps 0..3)", "this branch (from step 4)"]
    drawn = lines_by_gid(ax)
    assert drawn == {"trunk t (steps 0..3)": [[0, 1, 2, 3]], "this branch (from step 4)": [list(range(4, STEPS))]}
    assert np.array_equal(ax.get_lines()[0].get_ydata(), read_plan_file(trunk / "plan.json").column("lr")[:4])
    assert branch_lines(ax) == [4]
    # plot_plan reads the lineage from the plan.json beside the picture, as a run writes it first.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_plan(plan, b1 / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trunk_fig = draw_plan(read_plan_file(trunk / "plan.json"), history(trunk))  # a run from step 0: as before
    assert branch_lines(trunk_fig.axes[0]) == [] and trunk_fig.axes[0].get_legend() is None
    assert not trunk_fig._suptitle.get_text().startswith("branch")
