"""The CLI's resume modes and checkpoint errors, and the `tinker-exp` entry point: exit status and one line each.

The run dir's checkpoints come from the real CLI with FakeWorkers (tests/fake_cli.py); what is checked here, the
resume decision, happens before any worker starts (dry_run=true stops right after it).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, environment, metrics_rows, run_cli, run_fake_cli, start_fake_cli, wait_until


def fake_cli_args(run_dir: Path, steps: int) -> list[str]:
    """The real CLI with FakeWorkers (tests/fake_cli.py): `steps` steps into `run_dir`, a checkpoint every 2."""
    return [f"trainer.steps={steps}", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={run_dir}"]


def fake_cli(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return run_fake_cli(*fake_cli_args(run_dir, steps))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished")
    made = fake_cli(run_dir, 4)
    assert made.returncode == 0, made.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    return run_dir


def files(run_dir: Path) -> dict[Path, bytes]:
    """Everything in the run dir but what records each attempt that got the run dir, a failed one too: job.json, the
    logs (appended) and Hydra's .hydra/ (written once the run dir's lock is held)."""
    attempt = lambda p: p.name == "job.json" or p.suffix == ".log" or ".hydra" in p.parts  # noqa: E731
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and not attempt(p)}


def test_resume_never_on_a_run_dir_with_checkpoints_exits_2_and_overwrites_nothing(finished_run):
    before = files(finished_run)
    result = run_cli("resume=never", "trainer.steps=4", "dry_run=true", f"hydra.run.dir={finished_run}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tinker_exp: config error: resume=never, but {finished_run / 'checkpoints'} holds checkpoints: "
        "use resume=auto or another run dir"
    ]
    assert files(finished_run) == before


def every_file(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def refusals(run_dir: Path, bad_rows: Path) -> dict[str, tuple[list[str], str]]:
    """Commands refused before any worker starts, each with the start of its one line."""
    same = ["trainer.steps=4", "checkpoint.every_steps=2", "logger=none"]  # finished_run's config
    return {
        "bad value": ([*same, "+override.lr=-1"], "config error: override.lr: must be >= 0, got -1"),
        "another config": ([*same, "trainer.seed=3"], f"config error: {run_dir} holds a run of another config (trainer.seed: 0 -> 3)"),
        "bad data path": ([*same, "data.path=/nonexistent.jsonl"], "config error: data.path: "),
        "bad row": ([*same, f"data.path={bad_rows}"], f"config error: data.path: {bad_rows}:2: "),
    }


def test_a_refused_command_writes_nothing_into_a_finished_run_dir(finished_run, tmp_path):
    """Not .hydra/, job.json or a log line either: every file's bytes and the list of files stay as they were."""
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    for what, (args, line) in refusals(finished_run, bad_rows).items():
        before = every_file(finished_run)
        assert ".hydra/overrides.yaml" in before and "job.json" in before
        result = run_cli(*args, f"hydra.run.dir={finished_run}")
        assert result.returncode == 2, (what, result.stderr[-3000:])
        (said,) = result.stderr.strip().splitlines()
        assert said.startswith(f"tinker_exp: {line}"), (what, said)
        assert every_file(finished_run) == before, what


def test_a_refused_command_leaves_no_run_dir(tmp_path):
    """resume=must in a fresh dir, a bad value, a bad data path: the run dir Hydra made for the command goes again."""
    for what, args in {"resume=must": ["resume=must"], "bad value": ["+override.lr=-1"], "bad data path": ["data.path=/nonexistent.jsonl"]}.items():
        run_dir = tmp_path / what.replace(" ", "_")
        result = run_cli(*args, "logger=none", f"hydra.run.dir={run_dir}")
        assert result.returncode == 2, (what, result.stderr[-3000:])
        assert not run_dir.exists(), (what, sorted(p.name for p in run_dir.iterdir()))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_resume_must_without_a_checkpoint_exits_2(tmp_path):
    result = run_cli("resume=must", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tinker_exp: config error: resume=must, but there is no checkpoint in {tmp_path / 'checkpoints'}"
    ]


def test_resume_must_finds_the_newest_checkpoint(finished_run):
    result = run_cli("resume=must", "trainer.steps=4", "dry_run=true", f"hydra.run.dir={finished_run}")
    assert result.returncode == 0, result.stderr
    assert f"resuming from {finished_run / 'checkpoints' / 'step_00000004'} at step 4" in result.stdout


def test_no_usable_checkpoint_exits_5_naming_each_one(finished_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    for checkpoint in (run_dir / "checkpoints").iterdir():
        (checkpoint / "loop.json").unlink()
    before = files(run_dir)
    result = run_cli("dry_run=true", f"hydra.run.dir={run_dir}")
    assert result.returncode == 5, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tinker_exp: checkpoint error: no usable checkpoint in {run_dir / 'checkpoints'}: ")
    assert line.count("loop.json: missing") == 2
    assert files(run_dir) == before


def saved_on(run_dir: Path, device: str) -> None:
    """Every checkpoint of `run_dir` as if its workers had run on `device` (loop.json and its manifest entry)."""
    for checkpoint in (run_dir / "checkpoints").iterdir():
        state = json.loads((checkpoint / "loop.json").read_text())
        (checkpoint / "loop.json").write_text(json.dumps({**state, "device": device}, indent=1) + "\n")
        manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
        manifest["files"]["loop.json"]["bytes"] = (checkpoint / "loop.json").stat().st_size
        (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")


def test_a_checkpoint_saved_on_another_device_stops_the_run_before_any_worker_starts(finished_run, tmp_path):
    import shutil

    assert json.loads((finished_run / "checkpoints" / "step_00000004" / "loop.json").read_text())["device"] == "cpu"
    dry = run_cli("backend.device=cuda", "trainer.steps=6", "dry_run=true", f"hydra.run.dir={finished_run}")
    assert dry.returncode == 2, dry.stderr  # an explicit device: a dry run finds it, importing no torch
    assert dry.stderr.strip().splitlines() == [
        f"tinker_exp: config error: backend.device: this run trains on cuda, but {finished_run / 'checkpoints' / 'step_00000004'} "
        "was saved by cpu workers and verl loads it onto cpu only: set backend.device=cpu to continue it, or use another run dir"
    ]
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed after step 2: not complete
    saved_on(run_dir, "cuda")  # as if trained on a GPU machine, continued here (auto: cpu)
    kept = lambda: {p: b for p, b in files(run_dir).items() if "checkpoints" in p.parts or p.name == "metrics.jsonl"}  # noqa: E731
    before = kept()
    real = fake_cli(run_dir, 4)  # the same config: a resume
    assert real.returncode == 2, real.stderr[-3000:]
    assert real.stderr.strip().splitlines()[-1] == (
        f"tinker_exp: config error: backend.device: this run trains on cpu, but {run_dir / 'checkpoints' / 'step_00000002'} "
        "was saved by cuda workers and verl loads it onto cuda only: set backend.device=cuda to continue it, or use another run dir"
    )
    assert kept() == before  # no row logged, no checkpoint touched: no worker started


def test_the_tinker_exp_entry_point_is_the_same_cli(tmp_path):
    entry = Path(sys.executable).parent / "tinker-exp"
    ok = subprocess.run([str(entry), "+override=lr_cosine", "trainer.steps=30", "dry_run=true", f"hydra.run.dir={tmp_path}"],
                        cwd=REPO, env=environment({}), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "lr: cosine over 30 steps" in ok.stdout and (tmp_path / "plan.json").exists()
    bad = subprocess.run([str(entry), "+override.lr=-1", "dry_run=true", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=REPO, env=environment({}), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["tinker_exp: config error: override.lr: must be >= 0, got -1"]


def test_a_resumed_runs_progress_bar_starts_at_its_first_step_and_ends_at_the_last(finished_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed before its last checkpoint
    resumed = fake_cli(run_dir, 4)  # the same command (another trainer.steps is refused: a branch's job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    counts = re.findall(r"train:\s+\d+%\|[^|]*\| (\d+)/(\d+) ", resumed.stderr)  # each redraw of the bar
    assert counts[0] == ("2", "4") and counts[-1] == ("4", "4"), resumed.stderr[-3000:]
    assert all(int(done) >= 2 for done, _ in counts)


@pytest.mark.parametrize("gate_step, continues", [(3, "continues from {checkpoints}/step_00000002"),
                                                  (1, "starts again from step 0: no checkpoint yet")])  # fmt: skip
def test_ctrl_c_says_where_the_same_command_continues(tmp_path, gate_step, continues):
    """SIGINT as a terminal's Ctrl-C delivers it, while the run waits before `gate_step` (its gate never opens)."""
    run_dir = tmp_path / "run"
    driver = start_fake_cli(*fake_cli_args(run_dir, 6), env={"FAKE_GATE_STEP": str(gate_step), "FAKE_GATE_FILE": str(tmp_path / "never")},
                            default_sigint=True)  # as a terminal's process (a suite run under `&` ignores SIGINT)  # fmt: skip
    try:
        log = run_dir / "tinker_exp.log"
        ready = lambda: len(metrics_rows(run_dir)) >= gate_step and (gate_step < 2 or "checkpoint: " in log.read_text())  # noqa: E731
        wait_until(ready, 180, "the run never reached its gate", driver)
        driver.send_signal(signal.SIGINT)
        _, stderr = driver.communicate(timeout=180)
    finally:
        driver.kill()
    assert driver.returncode == 130, stderr[-3000:]
    where = continues.format(checkpoints=run_dir / "checkpoints")
    assert stderr.strip().splitlines()[-1] == f"tinker_exp: interrupted (Ctrl-C); the same command {where}"
    assert not (run_dir / "tinker_exp.lock").exists()
