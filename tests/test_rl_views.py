"""What a person reads of an RL run, reward first: the progress bar, the last line, the W&B summary's aggregations and
the sweep, study and population tables (pure: rows and run dirs written by hand as real runs write them). A real RL
study's table and its trials' last lines: tests/test_rl_search.py; report.png: tests/test_report.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tinker_exp.sweep.jobs import JobOutcome, read_outcome, summary_table
from tinker_exp.sweep.pbt_report import read_member, table
from tinker_exp.train.objective import came_to, write_objective
from tinker_exp.train.sinks import ProgressBar, progress_fields, summary_ops


def rl_rows(rewards: list[float], evaluated: dict[int, float]) -> list[dict]:
    return [{"train/step": s, "train/loss": -1.5 * s, "applied/lr": 1e-3, "train/reward": r,
             **({"eval/reward": evaluated[s]} if s in evaluated else {})} for s, r in enumerate(rewards)]  # fmt: skip


def test_the_progress_bar_shows_an_rl_runs_reward_and_latest_eval_reward_not_its_loss_and_an_sft_runs_loss(capsys):
    rows = rl_rows([0.25, 0.5, 0.75], {1: 0.6})
    assert list(progress_fields(rows[0])) == ["reward", "step", "lr"]
    bar = ProgressBar(3)
    for row in rows:
        bar.log(row)
    bar.close()
    last = capsys.readouterr().err.strip().split("\r")[-1]
    assert last.endswith("reward=0.7500, eval_reward=0.6000, step=2, lr=0.001]")  # the evaluation after step 1, kept
    assert progress_fields({"train/step": 4, "train/loss": 2.5, "applied/lr": 3e-4}) == {"step": 4, "loss": "2.5000", "lr": "0.0003"}


def test_the_last_line_says_an_rl_runs_last_reward_and_best_eval_reward_an_sft_runs_losses():
    assert came_to(rl_rows([0.1, 0.9, 0.8, 0.7], {1: 0.95, 2: 0.5, 3: 0.95})) == (
        "last reward 0.7000, best eval/reward 0.9500 after 2 steps"  # the first of equal highs
    )
    assert came_to(rl_rows([0.1, 0.2], {})) == "last reward 0.2000"  # no held-out prompts
    assert came_to([{"train/step": 0, "train/loss": 3.0}, {"train/step": 1, "train/loss": 2.5, "val/loss": 2.75}]) == (
        "final loss 2.5000, val loss 2.7500"
    )


def test_the_wandb_summary_keeps_an_rl_runs_highest_rewards_and_the_objective_by_its_mode():
    assert summary_ops("eval/reward", "max", rl=True) == {"train/reward": "max,last", "eval/reward": "max,last"}
    assert summary_ops("eval/reward", "last", rl=True) == {"train/reward": "max,last", "eval/reward": "max,last"}
    assert summary_ops("val/loss", "last") == {"val/loss": "min"}  # SFT: as before
    assert summary_ops("train/loss", "min") == {"val/loss": "min", "train/loss": "min,last"}


def rl_job(run_dir: Path, rewards: list[float], evaluated: dict[int, float], num: int) -> JobOutcome:
    """A finished RL job's run dir (metrics.jsonl, objective.json: eval/reward maximised) read back as a sweep does."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rl_rows(rewards, evaluated)))
    write_objective(run_dir, "eval/reward", "max", max(evaluated.values()))
    return read_outcome(num, [f"trainer.seed={num}"], "COMPLETED", run_dir, None, objective=max(evaluated.values()))


def columns(header: str) -> list[str]:
    """A text table's column names (two spaces or more between them)."""
    return re.split(r"\s{2,}", header.strip())


def test_an_rl_sweeps_table_shows_its_final_reward_and_its_objective_by_name_highest_first(tmp_path):
    outcomes = [rl_job(tmp_path / "0", [0.1, 0.3], {1: 0.35}, 0), rl_job(tmp_path / "1", [0.2, 0.6], {1: 0.65}, 1)]
    assert (outcomes[0].final_reward, outcomes[0].metric, outcomes[0].mode) == (0.3, "eval/reward", "max")
    header, _, *lines = summary_table(outcomes).splitlines()
    assert columns(header)[3:6] == ["steps", "final reward", "objective: eval/reward (max)"]
    assert [line.split()[:6] for line in lines] == [["*1", "trainer.seed=1", "COMPLETED", "2", "0.6000", "0.6500"],
                                                    ["0", "trainer.seed=0", "COMPLETED", "2", "0.3000", "0.3500"]]  # fmt: skip
    sft = JobOutcome(2, ["a"], "COMPLETED", "d2", final_loss=2.5, objective=2.6, metric="val/loss", mode="last")
    assert columns(summary_table([sft]).splitlines()[0])[3:6] == ["steps", "final loss", "objective: val/loss (last)"]


def test_a_populations_table_names_its_objective(tmp_path):
    members = []
    for member, best in enumerate([0.4, 0.7]):
        run_dir = tmp_path / str(member)
        run_dir.mkdir()
        write_objective(run_dir, "eval/reward", "max", best)
        members.append(read_member(member, {"override.lr.value": 1e-3}, run_dir, best, None))
    header, _, *lines = table(members).splitlines()
    assert columns(header)[:3] == ["member", "objective: eval/reward (max)", "exploits"]
    assert [line.split()[:2] for line in lines] == [["*1", "0.7000"], ["0", "0.4000"]]
