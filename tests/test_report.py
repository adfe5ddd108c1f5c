"""report.png and study.png read back as data (titles, legend labels, which line is thick), not as pixels; and
`python -m tinker_exp.report`. Run dirs are written by hand with the project's own writers (job.json, plan.json,
objective.json) as real runs write them; a study is a real Optuna study in SQLite."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from helpers import run_module
from tinker_exp import report as command
from tinker_exp.optim.convert import flat_values
from tinker_exp.optim.plan import plan_for
from tinker_exp.optim.preview import write_plan_file
from tinker_exp.sweep.jobs import job_info, write_job_info
from tinker_exp.sweep.report import (
    BEST_LINE_WIDTH,
    LINE_WIDTH,
    display_name,
    draw_report,
    draw_study,
    read_run,
    title_name,
    write_report,
)
from tinker_exp.train.objective import write_objective

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
COSINE = {"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 2, "min_ratio": 0.1}}
WSD = {"lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 1, "decay_steps": 2}}


def make_run(run_dir: Path, overrides=(), losses=(5.0, 4.5, 4.2, 4.0), schedule=COSINE, objective=None,
             num=None, config: str | None = None, applied: bool = False) -> Path:  # fmt: skip
    """A run dir as a finished run leaves it: job.json, plan.json, metrics.jsonl (a val row every other step;
    `applied`: with the applied/* values of its plan, as the loop logs them), objective.json (a (metric, mode,
    value) triple) and config.yaml."""
    write_job_info(run_dir, job_info(num, list(overrides)))
    plan = plan_for(schedule or {}, dict(ADAMW), len(losses), "AdamW")
    write_plan_file(plan, run_dir / "plan.json")

    def sent(step: int) -> dict:  # every float of the param group, sent or not
        flat = {**flat_values("", ADAMW), **{k: c if isinstance(c, float) else c[step] for k, c in plan.columns.items()}}
        return {f"applied/{k}": float(v) for k, v in flat.items()} if applied else {}

    rows = [{"train/step": step, "train/loss": loss, **sent(step), **({"val/loss": loss + 0.1} if step % 2 else {})}
            for step, loss in enumerate(losses)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if objective is not None:
        write_objective(run_dir, *objective)
    (run_dir / "config.yaml").write_text(config or f"trainer:\n  steps: {len(losses)}\nlogger:\n  run_name: null\n")
    return run_dir


def texts(fig) -> list[str]:
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def legend(fig, kinds=("train", "val")) -> list[str]:
    """The run entries of the figure's one legend (beside the main panel or below the figure), after its two
    kinds of line (train/val; an RL run's train/reward and eval/reward)."""
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    assert len(legends) == 1
    labels = [t.get_text() for t in legends[0].get_texts()]
    assert labels[:2] == list(kinds)
    return labels[2:]


def legend_widths(fig) -> dict[str, float]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return {t.get_text(): h.get_linewidth() for t, h in zip(legends[0].get_texts(), legends[0].legend_handles)}


def loss_widths(fig) -> dict[str, set[float]]:
    """Each run's loss lines (train and val), by the label they carry as gid: their line widths."""
    widths: dict[str, set[float]] = {}
    for line in fig.axes[0].get_lines():
        if line.get_gid():
            widths.setdefault(line.get_gid(), set()).add(line.get_linewidth())
    return widths


def test_a_runs_report_is_titled_by_its_name_and_its_legend_names_its_overrides(tmp_path):
    run_dir = make_run(tmp_path / "outputs" / "runs" / "2026-12-01" / "08-36-42-416363", ["+override=lr_cosine", "trainer.steps=4"])
    fig = draw_report([read_run(run_dir)], f"run {title_name(run_dir)}")
    assert fig._suptitle.get_text() == (
        "run runs/2026-12-01/08-36-42-416363\nlr: cosine (value 0.001, warmup_steps 2, min_ratio 0.1)"  # num_cycles: its default
    )
    assert legend(fig) == ["+override=lr_cosine trainer.steps=4"]  # as typed
    assert not [text for text in texts(fig) if str(tmp_path) in text]  # no absolute path anywhere
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "lr"]  # the plan key that changes has its panel

    named = make_run(tmp_path / "named", config="logger:\n  run_name: lr-cosine-short\n")  # W&B's name for it
    assert title_name(named) == "lr-cosine-short (named)"
    fig = draw_report([read_run(named)], f"run {title_name(named)}")
    assert fig._suptitle.get_text() == "run lr-cosine-short (named)"  # the schedules are the legend
    assert legend(fig) == ["lr: cosine (value 0.001, warmup_steps 2, min_ratio 0.1)"]
    # A sweep's job: W&B's name for it is made of its overrides, which the legend shows (floats shortened).
    job = make_run(tmp_path / "outputs" / "sweeps" / "s" / "1", ["+override=lr_cosine", "override.lr.value=0.0006380556092044456"],
                   config="logger:\n  run_name: override=lr_cosine,override.lr.value=0.0006380556092044456\n")  # fmt: skip
    fig = draw_report([read_run(job)], f"run {title_name(job)}")
    assert fig._suptitle.get_text().splitlines()[0] == "run sweeps/s/1"
    assert legend(fig) == ["+override=lr_cosine override.lr.value=0.000638"]
    plain = make_run(tmp_path / "plain", schedule=None)
    assert legend(draw_report([read_run(plain)], "run plain")) == ["defaults, no override"]
    assert [ax.get_ylabel() for ax in draw_report([read_run(plain)], "run plain").axes] == ["loss"]


def rl_run(run_dir: Path, reward: list[float], overrides=(), objective=None) -> Path:
    """An RL run dir: make_run's, its rows with train/reward at every step and eval/reward (reward + 0.05) at odd ones."""
    make_run(run_dir, overrides, objective=objective)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row, r in zip(rows, reward):
        row.pop("val/loss", None)
        row |= {"train/reward": r} | ({"eval/reward": r + 0.05} if row["train/step"] % 2 else {})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def test_a_proposed_runs_title_says_its_schedule_as_given_and_fits_the_picture(tmp_path):
    """A proposed WSD (forecast propose: value, warmup, decay, shape, final ratio): its title says those, not the
    parameters plan.json holds at their defaults (stable_steps None, num_cycles 0.5, ...), and every title line, a
    long one wrapped, lies inside the saved picture."""
    spec = {"lr": {"schedule": "wsd", "value": 3e-3, "warmup_steps": 2, "decay_steps": 4, "decay_shape": "1-sqrt", "min_ratio": 0.01}}
    run_dir = make_run(tmp_path / ("proposed_" + "x" * 120), ["+override=proposed"], losses=[5.0 - s / 10 for s in range(20)], schedule=spec)
    fig = draw_report([read_run(run_dir)], f"run {title_name(run_dir)}")
    title = fig._suptitle.get_text()
    assert title.splitlines()[-1] == "lr: wsd (value 0.003, warmup_steps 2, decay_steps 4, decay_shape 1-sqrt, min_ratio 0.01)"
    fig.canvas.draw()
    drawn, whole = fig._suptitle.get_window_extent(), fig.bbox
    assert whole.x0 <= drawn.x0 and drawn.x1 <= whole.x1  # the long name wrapped, inside
    assert "".join(title.splitlines()[:-1]) == f"run {title_name(run_dir)}"


def test_an_rl_runs_reward_is_its_main_panel_and_its_policy_loss_a_small_one_below(tmp_path):
    """Each run's train/reward (every step) and eval/reward (at its evaluations) read back from the main panel,
    under the run's label, the legend there; the policy loss below it, then the plan's panels. One RL run's title
    says what it came to, as its last line does. An SFT run's main panel is its loss (above)."""
    rewards = {"a": [0.0, 0.25, 0.5, 1.0], "b": [0.1, 0.1, 0.2, 0.3]}
    for name, reward in rewards.items():
        rl_run(tmp_path / name, reward, [f"trainer.seed={len(name) + ord(name)}"])
    runs = [read_run(tmp_path / name) for name in rewards]
    fig = draw_report(runs, "rl")
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward", "policy loss", "lr"]
    assert [ax.get_gridspec().get_height_ratios() for ax in fig.axes][0] == [2.2, 1, 1]  # the reward's panel the largest
    reward_ax, loss_ax = fig.axes[:2]
    assert legend(fig, ("train/reward", "eval/reward")) == ["trainer.seed=98", "trainer.seed=99"]
    for run, reward in zip(runs, rewards.values()):
        train, evaluated = [line for line in reward_ax.get_lines() if line.get_gid() == run.label]
        assert (list(train.get_xdata()), list(train.get_ydata())) == ([0, 1, 2, 3], reward)
        assert evaluated.get_linestyle() == "--" and list(evaluated.get_xdata()) == [1, 3]
        assert list(evaluated.get_ydata()) == [reward[1] + 0.05, reward[3] + 0.05]
        (loss,) = [line for line in loss_ax.get_lines() if line.get_gid() == run.label]
        assert list(loss.get_ydata()) == [5.0, 4.5, 4.2, 4.0]
    one = draw_report([read_run(tmp_path / "a")], "run a")
    assert one._suptitle.get_text().splitlines()[-1] == "last reward 1.0000, best eval/reward 1.0500 after 4 steps"


def test_an_rl_run_with_a_kl_penalty_draws_its_policy_loss_and_the_penalty_below_the_reward(tmp_path):
    """rl.kl_coef > 0: train/loss is train/pg_loss + train/kl_loss. The lower panel draws the policy loss (solid)
    and the KL penalty (dotted, same units), named as such, not train/loss under the label "policy loss"."""
    run_dir = rl_run(tmp_path / "kl", [0.0, 0.25, 0.5, 1.0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [0.0, 0.3, 0.6, 0.9]
    for row, penalty in zip(rows, kl):
        row |= {"train/pg_loss": row["train/loss"] - penalty, "train/kl_loss": penalty}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_run(run_dir)
    fig = draw_report([run], "run kl")
    loss_ax = fig.axes[1]
    assert loss_ax.get_ylabel() == "policy loss, KL penalty"
    policy, penalty = [line for line in loss_ax.get_lines() if line.get_gid() == run.label]
    assert list(policy.get_ydata()) == [5.0, 4.5 - 0.3, 4.2 - 0.6, 4.0 - 0.9] and policy.get_linestyle() == "-"
    assert list(penalty.get_ydata()) == kl and penalty.get_linestyle() == ":"
    assert "KL penalty (in the loss)" in texts(fig)
    plain = draw_report([read_run(rl_run(tmp_path / "plain", [0.0, 0.1, 0.2, 0.3]))], "run plain")
    assert plain.axes[1].get_ylabel() == "policy loss" and "KL penalty (in the loss)" not in texts(plain)


def test_a_sweeps_best_job_by_its_objective_is_drawn_thick_and_named(tmp_path):
    sweep = tmp_path / "outputs" / "sweeps" / "2026-12-01" / "08-38-51"
    last = ("val/loss", "last")
    make_run(sweep / "0", ["+override=lr_cosine", "trainer.steps=4"], (5.0, 4.0, 3.0, 2.0), objective=(*last, 4.3), num=0)
    make_run(sweep / "1", ["+override=lr_wsd", "trainer.steps=4"], (5.0, 4.5, 4.2, 4.1), WSD, objective=(*last, 4.25), num=1)
    make_run(sweep / "2", ["+override=constant", "trainer.steps=4"], (5.0, 4.5), {"lr": 1e-3}, num=2)  # failed: no objective
    runs = [read_run(sweep / str(n), f"job {n}") for n in range(3)]
    fig = draw_report(runs, f"sweep {display_name(sweep)}")
    # Job 1 is best by its objective (what the sweeper minimised), though job 0's training loss ends lower.
    assert legend(fig) == ["job 0: override=lr_cosine -> 4.3", "best: job 1: override=lr_wsd -> 4.25", "job 2: override=constant"]
    assert fig._suptitle.get_text() == "sweep sweeps/2026-12-01/08-38-51\nbest of 2 by val/loss (last): job 1, 4.25"
    assert loss_widths(fig) == {
        "job 0: override=lr_cosine": {LINE_WIDTH, LINE_WIDTH + 0.6},  # train, val (dashed)
        "job 1: override=lr_wsd": {BEST_LINE_WIDTH, BEST_LINE_WIDTH + 0.6},
        "job 2: override=constant": {LINE_WIDTH, LINE_WIDTH + 0.6},
    }
    widths = legend_widths(fig)
    assert widths["best: job 1: override=lr_wsd -> 4.25"] > widths["job 0: override=lr_cosine -> 4.3"]

    # min mode: the objective is the lowest value the run logged, as objective.json says; still the lowest wins.
    write_objective(sweep / "2", "val/loss", "min", 4.0)
    assert "best:" not in " ".join(legend(draw_report([read_run(sweep / str(n), f"job {n}") for n in range(3)], "s")))
    for n, value in enumerate((4.3, 4.25, 4.0)):
        write_objective(sweep / str(n), "val/loss", "min", value)
    assert legend(draw_report([read_run(sweep / str(n), f"job {n}") for n in range(3)], "s"))[2] == "best: job 2: override=constant -> 4"


def test_a_run_that_did_not_complete_is_labelled_where_it_stopped(tmp_path):
    """A run that logged steps but ended before its last without completing (no objective.json: killed, cut off by its
    study's stop, failed) says so in its label, as many steps done as it logged of trainer.steps; a run that completed
    (objective.json), also one that stopped early by its own rule (pruned, early stop: fewer steps), says nothing; a
    run's own report, drawn as it ends and before its objective.json, neither."""
    sweep = tmp_path / "study"
    make_run(sweep / "0", ["optimizer.lr=0.001"], (5.0,) * 8, objective=("val/loss", "last", 4.9), num=0)
    make_run(sweep / "1", ["optimizer.lr=0.002"], (5.0, 4.8, 4.7), config="trainer:\n  steps: 8\n", num=1)
    make_run(sweep / "2", ["optimizer.lr=0.003"], (5.0, 4.9), objective=("val/loss", "last", 5.1), config="trainer:\n  steps: 8\n", num=2)
    fig = draw_report([read_run(sweep / str(n), f"trial {n}" + (" (pruned after 2 steps)" if n == 2 else "")) for n in range(3)], "study")
    assert legend(fig) == ["best: trial 0: optimizer.lr=0.001 -> 4.9", "trial 1: optimizer.lr=0.002 (stopped after 3 of 8 steps)",
                           "trial 2 (pruned after 2 steps): optimizer.lr=0.003 -> 5.1"]  # fmt: skip
    assert legend(draw_report([read_run(sweep / "1")], "run")) == ["optimizer.lr=0.002 (stopped after 3 of 8 steps)"]
    assert legend(draw_report([read_run(sweep / "1", completed=True)], "run")) == ["optimizer.lr=0.002"]


def test_runs_judged_by_different_objectives_are_not_ranked(tmp_path):
    a = make_run(tmp_path / "a", ["trainer.objective=train/loss"], objective=("train/loss", "last", 1.0))
    b = make_run(tmp_path / "b", ["trainer.objective=val/loss"], objective=("val/loss", "last", 2.0))
    fig = draw_report([read_run(a), read_run(b)], "two")
    assert legend(fig) == ["trainer.objective=train/loss -> 1", "trainer.objective=val/loss -> 2"]
    assert set().union(*loss_widths(fig).values()) == {LINE_WIDTH, LINE_WIDTH + 0.6}
    assert fig._suptitle.get_text() == "two"


def test_runs_are_labelled_by_what_differs_between_them(tmp_path):
    def labels(*run_dirs):
        return legend(draw_report([read_run(d) for d in run_dirs], "runs"))

    # A key one run set and another did not: the other shows its config's value; what all share is left out.
    short = make_run(tmp_path / "short", ["+override=lr_cosine", "trainer.steps=4", "optimizer.lr=0.0012345678"])
    default = make_run(tmp_path / "default", ["+override=lr_cosine"], losses=(5.0,) * 10, config="trainer:\n  steps: 10\noptimizer:\n  lr: 0.001\n")
    assert labels(short, default) == ["trainer.steps=4 optimizer.lr=0.00123", "trainer.steps=10 optimizer.lr=0.001"]
    # The same overrides: the config keys that differ (not the W&B names a sweep gives every job).
    a = make_run(tmp_path / "a", ["+override=lr_cosine"], config="data:\n  seed: 1\nlogger:\n  run_name: a\n")
    b = make_run(tmp_path / "b", ["+override=lr_cosine"], config="data:\n  seed: 2\nlogger:\n  run_name: b\n")
    assert labels(a, b) == ["data.seed=1", "data.seed=2"]
    # Alike in everything: their dirs tell them apart.
    c = make_run(tmp_path / "c", ["+override=lr_cosine"])
    d = make_run(tmp_path / "d", ["+override=lr_cosine"])
    assert labels(c, d) == ["c", "d"]
    # Hydra's group choices count as settings: a run without +override shows none for it.
    (c / ".hydra").mkdir()
    (c / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      override: lr_cosine\n      hydra/env: default\n")
    none = make_run(tmp_path / "none", [], schedule=None)
    (none / ".hydra").mkdir()
    (none / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      override: null\n      hydra/env: other\n")
    assert labels(c, none) == ["override=lr_cosine", "defaults"]
    # A key left null in the config (a run without +override=... as a real run writes it): defaults, not override=None.
    unset = make_run(tmp_path / "unset", [], schedule=None, config="override: null\ntrainer:\n  steps: 4\n")
    assert labels(c, unset) == ["override=lr_cosine", "defaults"]


def test_runs_with_and_without_a_schedule_both_draw_their_applied_lr_on_a_log_axis_when_it_spans_a_decade(tmp_path):
    """A run without an override has an lr too (its optimizer's, constant): drawn beside a scheduled run's, from the
    applied/lr the loop logged; a run stopped early ends where it stopped; lrs over more than a decade: a log axis."""
    steps = (5.0, 4.5, 4.2, 4.0, 3.9, 3.8)
    low = {"lr": {"schedule": "constant", "value": 1e-5}}
    scheduled = make_run(tmp_path / "low", ["+override=constant", "override.lr=1e-5"], losses=steps, schedule=low, applied=True)
    plain = make_run(tmp_path / "plain", [], losses=steps[:3], schedule=None, applied=True, config="override: null\n")
    fig = draw_report([read_run(scheduled), read_run(plain)], "runs")
    (lr_ax,) = [ax for ax in fig.axes if ax.get_ylabel() == "lr"]
    drawn = {line.get_gid(): (list(line.get_xdata()), set(line.get_ydata())) for line in lr_ax.get_lines() if line.get_gid()}
    assert drawn == {"override=constant override.lr=1e-05": ([0, 1, 2, 3, 4, 5], {1e-5}), "defaults": ([0, 1, 2], {1e-3})}
    assert lr_ax.get_yscale() == "log" and legend(fig) == ["override=constant override.lr=1e-05", "defaults"]
    assert fig.axes[-1].get_xlabel() == "train/step (0 = the first step)"
    # A warmup from 0 (not on a log axis): linear.
    cosine = make_run(tmp_path / "cosine", ["+override=lr_cosine"], losses=steps, applied=True)
    (lr_ax,) = [ax for ax in draw_report([read_run(cosine), read_run(plain)], "runs").axes if ax.get_ylabel() == "lr"]
    assert lr_ax.get_yscale() == "linear"


def test_an_lr_axis_with_a_warmup_from_0_draws_no_tick_label_over_another(tmp_path):
    """A study's report.png: warmups from 0 among lrs over more than a decade (symlog) label 0 and the decades from the
    least lr up, each apart from the others (a decade just above 0, 1e-05 or 1e-06, was drawn over 0's label)."""
    from itertools import combinations

    steps = (5.0, 4.5, 4.2, 4.0, 3.9, 3.8)
    for peaks in ((2e-5, 1e-3), (1e-5, 3e-4, 1e-3), (2e-8, 1e-1)):  # the least lr (the first warmup step's): a decade, between two, far down
        runs = [make_run(tmp_path / f"{peaks}" / str(n), [f"override.lr.value={peak}"], losses=steps, applied=True,
                         schedule={"lr": {"schedule": "cosine", "value": peak, "warmup_steps": 2, "min_ratio": 0.1}})
                for n, peak in enumerate(peaks)]  # fmt: skip
        fig = draw_report([read_run(run) for run in runs], "study s")
        (lr_ax,) = [ax for ax in fig.axes if ax.get_ylabel() == "lr"]
        fig.canvas.draw()
        low, high = lr_ax.get_ylim()
        labels = [t for t in lr_ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
        assert lr_ax.get_yscale() == "symlog" and labels[0].get_position()[1] == 0.0 and len(labels) >= 3, peaks
        boxes = {t.get_text(): t.get_window_extent() for t in labels}
        assert [(a, b) for a, b in combinations(boxes, 2) if boxes[a].overlaps(boxes[b])] == [], peaks


def test_a_legend_of_long_labels_goes_below_the_plot_short_ones_beside_it(tmp_path):
    keys = ["override.lr.value=0.0006380556092044456", "override.lr.warmup_steps=2", "override.lr.min_ratio=0.32294705653332806"]
    long = [make_run(tmp_path / str(n), [*keys[:2], f"override.lr.min_ratio=0.{n + 1}"] + [f"trainer.seed={n}"]) for n in range(2)]
    fig = draw_report([read_run(d) for d in long], "long")
    assert legend(fig) == ["override.lr.min_ratio=0.1 trainer.seed=0", "override.lr.min_ratio=0.2 trainer.seed=1"]
    assert not fig.legends and fig.axes[0].get_legend().get_bbox_to_anchor().x0 > fig.axes[0].bbox.x1  # beside
    wide = [make_run(tmp_path / f"w{n}", [f"{key.partition('=')[0]}={value}" for key, value in zip(keys, values)])
            for n, values in enumerate(((6e-4, 2, 0.3), (4e-4, 5, 0.1)))]  # fmt: skip
    fig = draw_report([read_run(d) for d in wide], "wide")
    assert len(legend(fig)[0]) > 60 and fig.legends  # a figure legend, below: the plot keeps its width
    fig = draw_report([read_run(make_run(tmp_path / "short", ["trainer.seed=1"]))], "one")
    assert not fig.legends and fig.axes[0].get_legend() is not None  # one run: inside the loss panel
    assert fig.axes[0].get_legend().get_bbox_to_anchor().x0 <= fig.axes[0].bbox.x0
    fig = draw_report([read_run(wide[0])], "one, long")
    assert fig.legends and legend(fig) == ["override.lr.value=0.0006 override.lr.warmup_steps=2 override.lr.min_ratio=0.3"]


def test_write_report_writes_a_png_and_nothing_when_no_run_logged_a_step(tmp_path):
    run_dir = make_run(tmp_path / "run", ["+override=lr_cosine"])
    assert write_report([("", run_dir)], tmp_path / "report.png", "run") == tmp_path / "report.png"
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    assert write_report([("", tmp_path / "empty")], tmp_path / "none.png", "none") is None
    assert not (tmp_path / "none.png").exists()


def study_dir(tmp_path: Path) -> tuple[Path, object]:
    """A study as hydra/sweeper=optuna leaves it: optuna.journal in the sweep dir, a run dir per trial."""
    import optuna

    from tinker_exp.sweep.study import open_storage, sweep_storage

    sweep = tmp_path / "outputs" / "sweeps" / "2026-12-01" / "08-37-19"
    sweep.mkdir(parents=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="tinker_exp", storage=open_storage(sweep_storage(sweep)))
    space = {"override.lr.value": optuna.distributions.FloatDistribution(1e-4, 3e-3, log=True),
             "override.lr.warmup_steps": optuna.distributions.IntDistribution(0, 5)}  # fmt: skip
    for number, (lr, warmup, value) in enumerate(((6e-4, 2, 5.7), (4e-4, 5, 5.5), (3e-4, 4, 5.9))):
        trial = study.ask(space)
        study.tell(trial, value)
        overrides = ["hparams_search=lr_cosine", f"override.lr.value={lr!r}", f"override.lr.warmup_steps={warmup}"]
        # The run dir holds what the trial really ran with (its own overrides), its objective what it returned.
        make_run(sweep / str(number), overrides, objective=("val/loss", "last", value), num=number)
    return sweep, study


def test_a_studys_picture_plots_the_objective_against_each_parameter_with_the_best_ringed(tmp_path):
    from tinker_exp.sweep.report import _pyplot

    plt = _pyplot()  # the backend chosen as every picture chooses it (Agg), before the style is read
    sweep, study = study_dir(tmp_path)
    style = dict(plt.rcParams)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = draw_study(study, f"study {display_name(sweep)}")
    assert [w for w in caught if "Experimental" in w.category.__name__] == []  # silenced where it is built
    assert dict(plt.rcParams) == style  # Optuna's ggplot style stays in its own figure
    best = study.best_trial
    panels = {ax.get_xlabel(): ax for ax in fig.axes if ax.get_xlabel() in best.params}
    assert sorted(panels) == sorted(best.params) == ["override.lr.value", "override.lr.warmup_steps"]
    for name, ax in panels.items():
        rings = [c for c in ax.collections if c.get_label() == f"best: trial {best.number}"]
        assert len(rings) == 1 and [tuple(p) for p in rings[0].get_offsets()] == [(best.params[name], best.value)]
    assert fig._suptitle.get_text().endswith(f"best: trial {best.number}, {best.value:.4g}")
    study_trials = [t for t in study.trials if t.value is not None]
    assert math.isclose(best.value, min(t.value for t in study_trials))


def test_a_studys_picture_marks_its_pruned_trials_and_labels_a_log_axis_at_a_few_round_values():
    """Pruned trials drawn (x, at the last value each reported) where a learning rate too high stopped them, outside
    the completed trials' range; the log axis labelled at round values only (no overlapping minor labels)."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    space = {"override.lr": FloatDistribution(1e-5, 1e-1, log=True)}
    study = optuna.create_study()
    for number, lr in enumerate((1e-5, 1e-4, 3e-4, 1e-2, 5e-2)):
        trial = optuna.trial.create_trial(params={"override.lr": lr}, distributions=space, value=5.0 + number,
                                          state=TrialState.PRUNED if lr > 1e-3 else TrialState.COMPLETE,
                                          intermediate_values={1: 5.0 + number})  # fmt: skip
        study.add_trial(trial)
    fig = draw_study(study, "study s")
    (ax,) = [ax for ax in fig.axes if ax.get_xlabel() == "override.lr"]
    (crosses,) = [c for c in ax.collections if c.get_gid() == "pruned"]
    assert [tuple(p) for p in crosses.get_offsets()] == [(1e-2, 8.0), (5e-2, 9.0)]
    low, high = ax.get_xlim()
    assert ax.get_xscale() == "log" and low < 1e-5 and high > 5e-2  # the pruned are inside the panel
    labels = [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert labels == ["1e-05", "1e-04", "1e-03", "1e-02"] and not [t for t in ax.get_xticklabels(minor=True) if t.get_text()]
    assert "(3 completed, 2 pruned (x)); best: trial 0, 5" in fig._suptitle.get_text()
    fig.canvas.draw()


def test_a_maximised_studys_picture_says_higher_is_better_and_rings_the_highest():
    """A study on eval/reward (direction maximize, as trainer.objective_mode=max makes it): its title says so."""
    import optuna
    from optuna.distributions import FloatDistribution

    space = {"override.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study(direction="maximize")
    for lr, reward in ((1e-4, 0.04), (3e-3, 0.71), (1e-2, 0.39)):
        study.add_trial(optuna.trial.create_trial(params={"override.lr": lr}, distributions=space, value=reward))
    fig = draw_study(study, "study s")
    assert fig._suptitle.get_text().splitlines()[1] == (
        "objective (higher is better) against each searched parameter (3 completed); best: trial 1, 0.71"
    )


def test_a_study_of_one_completed_trial_draws_it_on_the_searched_range_without_a_colour_bar_or_a_warning():
    """One point: no colour bar of trial numbers (Optuna's spanned 0.9-1.1 around the one), no warning of equal x
    limits, and the lr axis over the range searched, the point inside it."""
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution

    space = {"override.lr": FloatDistribution(1e-4, 3e-2, log=True), "override.lr.warmup_steps": IntDistribution(0, 5)}
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(params={"override.lr": 3e-3, "override.lr.warmup_steps": 2}, distributions=space, value=0.27))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = draw_study(study, "study s")
    assert [ax.get_label() for ax in fig.axes if ax.get_label() == "<colorbar>"] == []
    panels = {ax.get_xlabel(): ax for ax in fig.axes}
    assert sorted(panels) == sorted(space)
    for name, searched in space.items():
        low, high = panels[name].get_xlim()
        assert low < searched.low and high > searched.high  # the whole range, a little padded
    assert "(1 completed); best: trial 0, 0.27" in fig._suptitle.get_text()


def test_the_command_draws_a_studys_trials_and_its_parameters(tmp_path, capsys):
    sweep, study = study_dir(tmp_path)
    assert command.main([str(sweep)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(sweep / "report.png"), str(sweep / "study.png")]
    assert (sweep / "study.png").read_bytes()[:4] == b"\x89PNG"
    runs = command.runs_of([sweep])
    assert [name for name, _ in runs] == ["trial 0", "trial 1", "trial 2"]
    fig = draw_report([read_run(d, name) for name, d in runs], command.title([sweep], runs))
    assert fig._suptitle.get_text() == "study sweeps/2026-12-01/08-37-19\nbest of 3 by val/loss (last): trial 1, 5.5"
    assert legend(fig)[1] == "best: trial 1: override.lr.value=0.0004 override.lr.warmup_steps=5 -> 5.5"


def test_the_command_draws_runs_of_different_sweeps_together(tmp_path, capsys):
    outputs = tmp_path / "outputs"
    for sweep, steps in (("08-00-00", 4), ("09-00-00", 6)):
        for n, name in enumerate(("lr_cosine", "lr_wsd")):
            make_run(outputs / "sweeps" / "2026-12-01" / sweep / str(n), [f"+override={name}", f"trainer.steps={steps}"],
                     losses=(5.0,) * steps, objective=("val/loss", "last", 4 + n + steps / 10), num=n)  # fmt: skip
    single = make_run(outputs / "runs" / "2026-12-01" / "10-00-00-000001", ["+override=lr_cosine"], losses=(5.0,) * 10,
                      config="trainer:\n  steps: 10\n")
    out = tmp_path / "together.png"
    paths = [outputs / "sweeps" / "2026-12-01" / "08-00-00", outputs / "sweeps" / "2026-12-01" / "09-00-00" / "1", single]
    assert command.main([*map(str, paths), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n" and out.read_bytes()[:4] == b"\x89PNG"
    runs = command.runs_of(paths)
    assert [name for name, _ in runs] == ["08-00-00/0", "08-00-00/1", "09-00-00/1", "10-00-00-000001"]
    fig = draw_report([read_run(d, name) for name, d in runs], command.title(paths, runs))
    assert legend(fig) == [
        "best: 08-00-00/0: override=lr_cosine trainer.steps=4 -> 4.4",
        "08-00-00/1: override=lr_wsd trainer.steps=4 -> 5.4",
        "09-00-00/1: override=lr_wsd trainer.steps=6 -> 5.6",
        "10-00-00-000001: override=lr_cosine trainer.steps=10",
    ]
    assert fig._suptitle.get_text().startswith(
        "4 runs: sweeps/2026-12-01/08-00-00, sweeps/2026-12-01/09-00-00/1, runs/2026-12-01/10-00-00-000001\n"
    )
    # One run dir given: its own report.png, redrawn.
    assert command.main([str(single)]) == 0 and capsys.readouterr().out == f"{single / 'report.png'}\n"


def test_a_path_that_is_not_a_run_dir_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "run")
    for args, message in (
        ([str(tmp_path / "run"), str(tmp_path / "missing")], f"{tmp_path / 'missing'}: no such file or directory"),
        ([str(tmp_path / "empty")], f"{tmp_path / 'empty'}: not a run dir (no job.json or metrics.jsonl) nor a sweep dir of run dirs"),
        ([str(tmp_path / "run"), "-o", str(tmp_path / "r.jpg")], f"-o {tmp_path / 'r.jpg'}: the report is a PNG; name it *.png"),
        ([str(tmp_path / "run"), "-o", str(tmp_path / "no" / "r.png")], f"-o {tmp_path / 'no' / 'r.png'}: no such directory {tmp_path / 'no'}"),
    ):
        result = run_module("tinker_exp.report", *args)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"tinker_exp.report: {message}\n")


def test_a_study_over_a_choice_rings_the_best_on_each_axis_and_one_parameter_keeps_our_title(tmp_path):
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    space = {"optimizer.name": CategoricalDistribution(["adamw", "sgd"]), "trainer.batch_size": IntDistribution(2, 8)}
    for params, value in (({"optimizer.name": "adamw", "trainer.batch_size": 2}, 1.0),
                          ({"optimizer.name": "sgd", "trainer.batch_size": 4}, 0.5),
                          ({"optimizer.name": "adamw", "trainer.batch_size": 8}, 2.0)):  # fixed: no axis of one value
        study.add_trial(optuna.trial.create_trial(params=params, distributions=space, value=value))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna's ExperimentalWarning is silenced where the picture is built
        fig = draw_study(study, "study")
    rings = {ax.get_xlabel(): [c for c in ax.collections if c.get_label().startswith("best:")] for ax in fig.axes if ax.get_xlabel()}
    ticks = {t.get_text(): t.get_position()[0] for t in next(ax for ax in fig.axes if ax.get_xlabel() == "optimizer.name").get_xticklabels()}
    assert {name: [tuple(p) for p in ring.get_offsets()] for name, (ring,) in rings.items()} == {
        "optimizer.name": [(ticks["'sgd'"], 0.5)], "trainer.batch_size": [(4.0, 0.5)]}  # the lowest: minimised

    single = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", study_name="one parameter")
    single.tell(single.ask({"optimizer.lr": FloatDistribution(1e-4, 1e-2)}), 3.0)
    single.tell(single.ask({"optimizer.lr": FloatDistribution(1e-4, 1e-2)}), 2.0)
    fig = draw_study(single, "study of one")
    assert "Slice Plot" not in texts(fig) and fig._suptitle.get_text().startswith("study of one\n")


def test_a_choice_of_numbers_is_ringed_at_its_tick_and_a_choice_only_pruned_trials_drew_gets_one():
    """choice(1e-6, 3e-2) (Optuna draws a choice on a categorical axis, numbers too): two completed trials drew 3e-2
    and one pruned trial 1e-6. The best is ringed on its point (its tick, not x = 0.03 off to the side), and the
    pruned trial's choice gets a tick of its own (it had none: not drawn at 1e-6, beside 3e-2's tick)."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    space = {"override.lr": CategoricalDistribution([1e-6, 3e-2])}
    study = optuna.create_study(direction="maximize")
    for lr, reward, state in ((3e-2, 0.27, TrialState.COMPLETE), (1e-6, 0.04, TrialState.PRUNED), (3e-2, 0.27, TrialState.COMPLETE)):
        study.add_trial(optuna.trial.create_trial(params={"override.lr": lr}, distributions=space, value=reward, state=state,
                                                  intermediate_values={1: reward}))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of equal x limits: one value on the axis
        fig = draw_study(study, "study s")
    (ax,) = [ax for ax in fig.axes if ax.get_xlabel() == "override.lr"]
    ticks = {t.get_text(): t.get_position()[0] for t in ax.get_xticklabels()}
    (ring,) = [c for c in ax.collections if c.get_label().startswith("best:")]
    (cross,) = [c for c in ax.collections if c.get_gid() == "pruned"]
    assert [tuple(p) for p in ring.get_offsets()] == [(ticks["0.03"], 0.27)]
    assert [tuple(p) for p in cross.get_offsets()] == [(ticks["1e-06"], 0.04)] and ticks["1e-06"] != ticks["0.03"]
    low, high = ax.get_xlim()
    assert low < min(ticks.values()) and max(ticks.values()) < high
    fig.canvas.draw()


def test_a_job_that_logged_no_step_is_named_in_the_title_and_still_labels_the_others(tmp_path):
    make_run(tmp_path / "0", ["+override=lr_cosine", "trainer.steps=6"], num=0)
    write_job_info(tmp_path / "1", job_info(1, ["+override=lr_wsd", "trainer.steps=6"]))  # failed at its config
    fig = draw_report([read_run(tmp_path / str(n), f"job {n}") for n in range(2)], "sweep s")
    assert legend(fig) == ["job 0: override=lr_cosine"]  # what tells it from job 1, not all its overrides
    assert fig._suptitle.get_text().splitlines()[-1] == "not drawn, no step logged: job 1"


def test_the_command_on_runs_that_logged_no_step_draws_nothing_and_says_so(tmp_path, capsys):
    write_job_info(tmp_path / "dry", job_info(None, ["dry_run=true"]))  # a dry run: job.json and plan.json only
    assert command.main([str(tmp_path / "dry")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"tinker_exp.report: no run logged a step ({tmp_path / 'dry'}); nothing drawn\n"
    assert not (tmp_path / "dry" / "report.png").exists()


def test_a_runs_saved_configs_read_as_pyyaml_reads_them(tmp_path):
    """The report reads config.yaml and .hydra/hydra.yaml with libyaml's parser: the values PyYAML's own gives, for
    the files a run writes (OmegaConf's YAML of the composed config, with its `hydra` node and a sweep's values)."""
    import yaml
    from omegaconf import OmegaConf

    from helpers import compose
    from tinker_exp.sweep.report import _read_yaml

    composed = compose("hparams_search=lr_cosine", "lora=r8", "override.lr.value=0.0006466422717414558", with_hydra=True)
    for name, node in (("config.yaml", {k: v for k, v in composed.items() if k != "hydra"}), ("hydra.yaml", {"hydra": composed.hydra})):
        path = tmp_path / name
        path.write_text(OmegaConf.to_yaml(OmegaConf.create(node)))
        assert _read_yaml(path) == yaml.safe_load(path.read_text()) != None  # noqa: E711
