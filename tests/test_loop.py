"""The loop's bookkeeping through the real entry (config, plan, sinks, checkpoints), with FakeWorkers for verl.

What verl itself does is proven by the real runs in test_train_e2e and test_resume; here: which rows are
written, what is sent each step, resume row-dropping, the non-finite count and stop rule, and W&B failures.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from fakes import FakeWorkers, fake_workers
from helpers import compose, metrics_rows, planned, read_jsonl, run_fake_cli, start_fake_cli, wait_until, wandb_finished_records, wandb_history
from tinker_exp import assemble, config
from tinker_exp.errors import ConfigError, NonFiniteError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run, validate
from tinker_exp.train.data import DataFileBatches
from tinker_exp.train.judges import GO_ON, Judge, stop
from tinker_exp.train.objective import objective_metric
from tinker_exp.train.protocols import Batch
from tinker_exp.train.sinks import JsonlSink, Sinks, WandbSink, wandb_run_config

OPTIMIZER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def test_every_step_sends_the_converted_override_and_logs_requested_and_applied(tmp_path):
    start = fake_workers()
    overrides = ["+override=constant", "override.lr=5e-4", "override.weight_decay=0", "override.betas=[0.9,0.95]"]
    last = run(compose(*overrides, "trainer.steps=6", "logger=none"), tmp_path, place=GivenWorkers(start))
    (workers,) = start.started
    sent = {"lr": 5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    assert workers.calls == [sent] * 6
    assert all(type(call["weight_decay"]) is float and type(call["betas"]) is tuple for call in workers.calls)
    rows = metrics_rows(tmp_path)
    assert [row["train/step"] for row in rows] == list(range(6)) and rows[-1] == last
    flat = {"lr": 5e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
    for row in rows:
        assert {k: row[f"requested/{k}"] for k in flat} == flat == {k: row[f"applied/{k}"] for k in flat}
    assert workers.shut_down


def test_no_override_sends_nothing_and_every_row_shows_the_optimizer_values(tmp_path):
    start = fake_workers()
    run(compose("trainer.steps=5", "logger=none"), tmp_path, place=GivenWorkers(start))
    assert start.started[0].calls == [{}] * 5  # an empty override: the worker group sends verl None
    rows = metrics_rows(tmp_path)
    assert len(rows) == 5
    for row in rows:
        assert not any(key.startswith("requested/") for key in row)
        assert {k: row[f"applied/{k}"] for k in OPTIMIZER} == OPTIMIZER


def test_a_schedule_sends_each_steps_value_of_the_plan(tmp_path):
    start = fake_workers()
    run(compose("+override=[lr_cosine,beta2_warmup]", "trainer.steps=12", "logger=none"), tmp_path, place=GivenWorkers(start))
    calls = start.started[0].calls
    assert [call["lr"] for call in calls] == planned(tmp_path, "lr")
    assert [call["betas"] for call in calls] == list(zip(planned(tmp_path, "beta1"), planned(tmp_path, "beta2")))
    assert len({call["lr"] for call in calls}) > 6  # it really changes


def test_an_applied_value_that_differs_stops_the_cli_with_exit_3_naming_rank_and_group(tmp_path):
    result = run_fake_cli("+override.lr=5e-4", "trainer.steps=6", "logger=none", f"hydra.run.dir={tmp_path}",
                          env={"FAKE_DRIFT_AT": "2"})  # fmt: skip
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "tinker_exp: optimizer override not applied: step 2: rank 1 param group 0 holds lr=0.0007, but 0.0005 was requested"
    )
    assert "Traceback" not in result.stderr
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == [0, 1]  # the bad step is not logged as fine


def test_a_non_finite_step_stops_the_run_before_it_saves_again(tmp_path):
    start = fake_workers(nonfinite_at=[5])
    with pytest.raises(NonFiniteError, match=r"step 5: loss=nan, grad_norm=nan; 1 non-finite step\(s\), trainer.max_nonfinite_steps=0"):
        run(compose("trainer.steps=10", "checkpoint.every_steps=2", "checkpoint.keep_last=0", "logger=none"), tmp_path, place=GivenWorkers(start))
    assert [row["train/nonfinite_steps"] for row in metrics_rows(tmp_path)] == [0, 0, 0, 0, 0, 1]
    assert start.started[0].saved == [2, 4]
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "loop.json").read_text())
    assert state == {"step": 4, "seed": 0, "device": "cpu", "nonfinite_steps": 0}


def test_non_finite_steps_up_to_the_limit_are_counted_and_tolerated(tmp_path):
    start = fake_workers(nonfinite_at=[3, 7])
    common = ["trainer.steps=10", "checkpoint.every_steps=5", "logger=none"]
    run(compose(*common, "trainer.max_nonfinite_steps=2"), tmp_path / "two", place=GivenWorkers(start))
    rows = metrics_rows(tmp_path / "two")
    assert [row["train/nonfinite_steps"] for row in rows] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert json.loads((tmp_path / "two" / "checkpoints" / "step_00000010" / "loop.json").read_text())["nonfinite_steps"] == 2
    with pytest.raises(NonFiniteError, match=r"step 7: .*2 non-finite step\(s\), trainer.max_nonfinite_steps=1"):
        run(compose(*common, "trainer.max_nonfinite_steps=1"), tmp_path / "one", place=GivenWorkers(fake_workers(nonfinite_at=[3, 7])))


class CrashesAt(FakeWorkers):
    crash_at = 6

    def train_step(self, examples, optim_step_params):
        if self.steps_done == self.crash_at:
            raise RuntimeError("killed")
        return super().train_step(examples, optim_step_params)


def test_a_resumed_run_logs_every_step_once_and_continues_the_plan(tmp_path):
    common = ["+override=lr_cosine", "trainer.steps=10", "checkpoint.every_steps=4", "logger=none"]
    run(compose(*common), tmp_path / "whole", place=GivenWorkers(fake_workers()))
    whole = metrics_rows(tmp_path / "whole")

    with pytest.raises(RuntimeError, match="killed"):  # steps 4 and 5 are logged after the checkpoint at 4
        run(compose(*common), tmp_path / "run", place=GivenWorkers(lambda cfg, plan, *_: CrashesAt(plan.optimizer_values)))
    assert [row["train/step"] for row in metrics_rows(tmp_path / "run")] == list(range(6))
    start = fake_workers()
    run(compose(*common), tmp_path / "run", place=GivenWorkers(start))
    assert start.started[0].calls[0]["lr"] == planned(tmp_path / "run", "lr")[4]
    rows = metrics_rows(tmp_path / "run")
    assert [row["train/step"] for row in rows] == list(range(10))  # 4 and 5 once, from the resumed run
    assert len(rows) == len(whole)
    for got, want in zip(rows, whole):
        assert (got["train/loss"], got["applied/lr"]) == (want["train/loss"], want["applied/lr"])


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path):
    common = ["+override=lr_cosine", "trainer.steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=0", "logger=none"]
    run(compose(*common), tmp_path, place=GivenWorkers(fake_workers()))
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000012")  # as if killed before saving step 12
    shard = tmp_path / "checkpoints" / "step_00000008" / "workers" / "fake_rank_1.json"
    shard.write_bytes(shard.read_bytes()[:100])
    start = fake_workers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(compose(*common), tmp_path, place=GivenWorkers(start))
    (message,) = [str(w.message) for w in caught if "broken checkpoint" in str(w.message)]
    assert message.startswith(f"not resuming from a broken checkpoint: {shard}: 100 bytes, the manifest says")
    assert message.endswith("falling back to step_00000004")
    assert start.started[0].calls[0]["lr"] == planned(tmp_path, "lr")[4]  # resumed at step 4
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == list(range(12))


class ObjectiveReaches(Judge):
    """A judge of the test's own: stops the run at the first evaluation whose objective is at or below `target`."""

    def __init__(self, metric: str, target: float):
        self.metric, self.target = metric, target

    def evaluated(self, steps_done, row):
        if row.get(self.metric, float("inf")) > self.target:
            return GO_ON
        return stop(f"{self.metric} reached {self.target} at step {steps_done}", early_stopped=True, target_reached=True)


def test_a_judge_of_ones_own_stops_the_run_at_the_evaluation_that_reaches_its_target(tmp_path, monkeypatch, caplog):
    """Registered with one line (assemble.JUDGES); the loop stops after the checkpoint at that step, whose loop state
    records the judge's stop, and the same command again finds the run complete."""
    common = ["trainer.steps=10", "trainer.eval_every=2", "checkpoint.every_steps=4", "checkpoint.keep_last=0", "logger=none"]
    run(compose(*common), tmp_path / "whole", place=GivenWorkers(fake_workers()))
    val = {row["train/step"] + 1: row["val/loss"] for row in metrics_rows(tmp_path / "whole") if "val/loss" in row}
    assert list(val) == [2, 4, 6, 8, 10] and sorted(val.values(), reverse=True) == list(val.values())  # falling
    target = (val[4] + val[6]) / 2  # first reached at step 6
    monkeypatch.setattr(assemble, "JUDGES", [*assemble.JUDGES, lambda cfg, *_: ObjectiveReaches(objective_metric(cfg), target)])
    caplog.set_level("INFO", logger="tinker_exp")
    run_dir, start = tmp_path / "judged", fake_workers()
    run(compose(*common), run_dir, place=GivenWorkers(start))
    assert [row["train/step"] for row in metrics_rows(run_dir)] == list(range(6))
    assert start.started[0].saved == [4, 6]
    state = json.loads((run_dir / "checkpoints" / "step_00000006" / "loop.json").read_text())
    assert state == {"step": 6, "seed": 0, "device": "cpu", "nonfinite_steps": 0, "early_stopped": True, "target_reached": True}
    assert f"val/loss reached {target} at step 6" in caplog.messages
    again = fake_workers()
    run(compose(*common), run_dir, place=GivenWorkers(again))
    assert again.started == [] and f"run complete: {run_dir} is done at step 6 (it stopped early;" in caplog.text


class MeasuredBatches:
    """The data file's batches as a source with a measured value and a state, as an RL sampler would have them."""

    restored: list[dict] = []

    def __init__(self, *args):
        self.data, self.served = DataFileBatches(*args), 0

    def batch(self, step):
        self.served += 1
        return Batch(self.data.batch(step).examples, {"batch/served": self.served})

    def state(self):
        return {"served": self.served}

    def restore(self, state):
        MeasuredBatches.restored.append(dict(state))
        self.served = state.get("served", 0)

    def close(self):
        pass


def test_a_batch_sources_values_join_the_rows_and_its_state_is_in_every_checkpoint_and_handed_back_on_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(assemble, "DataFileBatches", MeasuredBatches)
    monkeypatch.setattr(MeasuredBatches, "restored", [])
    common = ["trainer.steps=10", "checkpoint.every_steps=4", "checkpoint.keep_last=0", "logger=none"]
    with pytest.raises(RuntimeError, match="killed"):
        run(compose(*common), tmp_path, place=GivenWorkers(lambda cfg, plan, *_: CrashesAt(plan.optimizer_values)))
    run(compose(*common), tmp_path, place=GivenWorkers(fake_workers()))
    assert MeasuredBatches.restored == [{}, {"served": 4}]
    assert [row["batch/served"] for row in metrics_rows(tmp_path)] == list(range(1, 11))  # steps 4, 5 again: counted on
    loop_state = lambda step: json.loads((tmp_path / "checkpoints" / f"step_{step:08d}" / "loop.json").read_text())  # noqa: E731
    assert [loop_state(step)["batch_source"] for step in (4, 8, 10)] == [{"served": 4}, {"served": 8}, {"served": 10}]


def test_resume_never_refuses_a_run_dir_with_checkpoints_and_overwrites_nothing(tmp_path):
    run(compose("trainer.steps=4", "logger=none"), tmp_path, place=GivenWorkers(fake_workers()))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="resume=never, but .* holds checkpoints"):
        run(compose("trainer.steps=4", "logger=none", "resume=never"), tmp_path, place=GivenWorkers(fake_workers()))
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "job.json"}
    assert after == {p: b for p, b in before.items() if p.name != "job.json"}


def test_wandb_that_cannot_start_leaves_training_and_metrics_jsonl_alone(tmp_path, monkeypatch):
    # Online with no API key: W&B refuses at once (and only loopback is named, should it try anything).
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(compose("trainer.steps=3", "logger.mode=online", "logger.init_timeout_s=5"), tmp_path, place=GivenWorkers(fake_workers()))
    assert [str(w.message) for w in caught if "W&B could not start" in str(w.message)]
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == [0, 1, 2]
    assert not list((tmp_path / "wandb").glob("*run-*"))


class DiesAfter:
    """A W&B run whose service dies after `ok` calls (every later call raises, as wandb's do)."""

    def __init__(self, ok: int):
        self.ok, self.calls = ok, 0

    def _call(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.ok:
            raise BrokenPipeError("the service is gone")

    log = finish = _call


def test_a_wandb_sink_that_breaks_warns_once_and_the_other_sinks_go_on(tmp_path):
    jsonl, run_ = JsonlSink(tmp_path / "metrics.jsonl"), DiesAfter(ok=2)
    sinks = Sinks([WandbSink(run_), jsonl])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            sinks.log({"train/step": step})
        sinks.close(0)
    assert [str(w.message).split(" (")[0] for w in caught] == ["W&B stopped working"]
    assert run_.calls == 3  # not called again once broken, not even finish()
    assert [row["train/step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(5))


def test_a_sigterm_while_a_row_is_written_stops_after_every_sink_has_it(tmp_path):
    """The stop (Terminated, from sigterm_raises) waits for the row: it is in metrics.jsonl and W&B, or in neither."""
    import os
    import signal

    from tinker_exp.errors import Terminated
    from tinker_exp.train.signals import sigterm_raises

    class SignalledWhileLogging:  # the first sink: SIGTERM arrives as it writes step 1
        def __init__(self):
            self.rows = []

        def log(self, row):
            self.rows.append(row)
            if row["train/step"] == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    first, jsonl = SignalledWhileLogging(), JsonlSink(tmp_path / "metrics.jsonl")
    sinks = Sinks([first, jsonl])
    with sigterm_raises(), pytest.raises(Terminated):
        for step in range(3):
            sinks.log({"train/step": step})
    jsonl.close(143)
    assert [row["train/step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1] == [r["train/step"] for r in first.rows]


class SwallowsTheSigterm(FakeWorkers):
    """At step 3, SIGTERM arrives inside a call that catches what the handler raises (as a library's own call can):
    the handler has run, its Terminated is gone."""

    def train_step(self, examples, optim_step_params):
        import os
        import signal

        if self.steps_done == 3:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:  # noqa: BLE001  (what the library does)
                pass
        return super().train_step(examples, optim_step_params)


def test_a_sigterm_whose_exception_a_library_swallowed_still_stops_the_run_at_the_next_step(tmp_path):
    """A real SIGTERM, its Terminated lost inside a step: the handler ignores later SIGTERMs (a second must not cut the
    clean-up short), so the run trained on to its end and exited 0 (seen in CI). Now it stops at the next step's start
    as on SIGTERM: step 3's row is the last, exit 143's Terminated."""
    from tinker_exp.errors import Terminated
    from tinker_exp.train.signals import sigterm_raises

    with sigterm_raises(), pytest.raises(Terminated):  # as run.run_and_score runs a run
        run(compose("trainer.steps=8", "logger=none"), tmp_path, place=GivenWorkers(lambda cfg, plan, *_: SwallowsTheSigterm(plan.optimizer_values)))
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == [0, 1, 2, 3]


def wandb_config_of(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    dcfg = compose(*overrides)
    plan = validate(config.load(dcfg))
    return wandb_run_config(OmegaConf.to_container(dcfg, resolve=True), plan, {"override": "x"}, {"overrides": list(overrides), "slurm": None})


def test_the_wandb_config_is_flat_with_the_override_as_the_plan_uses_it():
    """One key per value (W&B's parallel coordinates and grouping): each override key's schedule and every
    parameter of it, defaults filled in, leftovers of an earlier composed file dropped; betas per component."""
    with pytest.warns(UserWarning, match=r"override.lr: ignoring decay_shape, decay_steps,"):
        flat = wandb_config_of("+override=[lr_wsd,beta2_warmup,lr_cosine]", "override.lr.warmup_steps=5", "+override.weight_decay=0")
    assert all(not isinstance(value, (dict, list)) or value in ({}, []) for value in flat.values()), flat
    assert {key: value for key, value in flat.items() if key.startswith("override.")} == {
        "override.lr.schedule": "cosine", "override.lr.value": 1e-3, "override.lr.warmup_steps": 5,
        "override.lr.min_ratio": 0.1, "override.lr.num_cycles": 0.5, "override.lr.total_steps": 20,
        "override.betas.0.schedule": "constant", "override.betas.0.value": 0.9,
        "override.betas.1.schedule": "linear", "override.betas.1.start": 0.95, "override.betas.1.end": 0.999,
        "override.betas.1.warmup_steps": 0, "override.betas.1.total_steps": 20,
        "override.weight_decay.schedule": "constant", "override.weight_decay.value": 0.0,
    }  # fmt: skip
    assert flat["trainer.steps"] == 20 and flat["optimizer.betas.1"] == 0.999 and flat["logger.tags"] == []
    assert flat["hydra_choices.override"] == "x" and flat["job.overrides.2"] == "+override.weight_decay=0"
    keyframes = wandb_config_of("+override=lr_keyframes", "+override.eps=1e-7")
    assert {key: value for key, value in keyframes.items() if key.startswith("override.")} == {
        "override.lr.schedule": "keyframes", "override.lr.points.0": 1e-5, "override.lr.points.4": 1e-3,
        "override.lr.points.19": 1e-4, "override.lr.total_steps": 20,
        "override.eps.schedule": "constant", "override.eps.value": 1e-7,  # a plain value is a constant
    }  # fmt: skip
    assert not [key for key in wandb_config_of() if key.startswith("override")]


class RecordingRun:
    def __init__(self):
        self.history, self.summary = [], self.Summary()

    class Summary(dict):
        def update(self, values):
            self.setdefault("updates", []).append(dict(values))

    def log(self, row):
        self.history.append(row)


def test_wandb_history_holds_only_charts_counts_go_to_the_summary():
    run_ = RecordingRun()
    sink = WandbSink(run_)
    for step, extra in enumerate([{}, {"val/loss": 2.0, "val/tokens": 226}, {"val/loss": 1.9, "val/tokens": 226}]):
        sink.log({"train/step": step, "time": 1.7e9 + step, "train/loss": 3.0, "train/nonfinite_steps": 0, **extra})
    assert run_.history == [
        {"train/step": 0, "train/loss": 3.0},
        {"train/step": 1, "train/loss": 3.0, "val/loss": 2.0},
        {"train/step": 2, "train/loss": 3.0, "val/loss": 1.9},
    ]
    assert run_.summary["updates"] == [{"train/nonfinite_steps": 0}, {"val/tokens": 226}]  # when they change


def test_wandb_service_killed_mid_run_one_warning_and_every_step_logged(tmp_path):
    """The real W&B service of a real CLI process is killed at step 2 (fake workers wait for the test's go)."""
    import psutil

    steps, gate = 6, tmp_path / "go"
    driver = start_fake_cli(f"trainer.steps={steps}", f"hydra.run.dir={tmp_path / 'run'}",
                            env={"FAKE_GATE_STEP": "2", "FAKE_GATE_FILE": str(gate)})  # its own process, W&B's service under it  # fmt: skip
    try:
        wait_until(lambda: len(metrics_rows(tmp_path / "run")) >= 2, 180, "training never started", driver)
        # W&B starts beside the steps: once its run is there (its line in the run's log) it is handed the rows that
        # waited (steps 0 and 1). (Its offline file shows them about 15 s later: W&B's writer flushes on its own.)
        log = tmp_path / "run" / "tinker_exp.log"
        wait_until(lambda: log.exists() and "W&B run " in log.read_text(), 120, "W&B never started", driver)
        services = [p for p in psutil.Process(driver.pid).children(recursive=True) if "wandb-core" in p.name()]
        assert services, "no wandb-core process under the driver"
        for service in services:
            service.kill()
        gone = lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in services)  # noqa: E731
        wait_until(gone, 60, "wandb-core did not die")
        gate.touch()
        _, stderr = driver.communicate(timeout=180)
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    assert stderr.count("W&B stopped working") == 1, stderr[-3000:]
    assert [row["train/step"] for row in metrics_rows(tmp_path / "run")] == list(range(steps))


class StartOrder(FakeWorkers):
    """Records what the driver had done when the group was constructed (its workers starting) and at the first step."""

    def __init__(self, run_dir, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_dir = run_dir
        self.at_start = self.driver_state()

    def driver_state(self) -> dict:
        return {name: (self.run_dir / name).exists() for name in ("plan.json", "plan.png", "wandb_run_id")}

    def train_step(self, examples, optim_step_params):
        self.__dict__.setdefault("at_first_step", self.driver_state())
        return super().train_step(examples, optim_step_params)


def test_the_plot_and_wandb_start_while_the_workers_start_and_no_step_waits_for_wandb(tmp_path, monkeypatch):
    """After everything that can stop the run (plan.json, data, device), the workers are started first; the plot and
    W&B start beside them (a thread) and no step waits for them: here W&B's start is held until two steps are done,
    and every step's row still reaches W&B, in order."""
    import threading

    from tinker_exp.train.sinks import WandbSink

    held, started = threading.Event(), []
    real_start = WandbSink.start.__func__

    def held_start(cls, *args, **kwargs):
        assert held.wait(120), "the steps waited for W&B"
        return real_start(cls, *args, **kwargs)

    monkeypatch.setattr(WandbSink, "start", classmethod(held_start))

    class HoldingWandb(StartOrder):
        def train_step(self, examples, optim_step_params):
            result = super().train_step(examples, optim_step_params)
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 2:
                self.at_second_step = self.driver_state()
                held.set()
            return result

    def start(cfg, plan, model_path, run_dir):
        started.append(HoldingWandb(run_dir, plan.optimizer_values))
        return started[0]

    run(compose("trainer.steps=4", "+override=lr_cosine"), tmp_path, place=GivenWorkers(start))  # a plan to plot
    (workers,) = started
    assert workers.at_start == {"plan.json": True, "plan.png": False, "wandb_run_id": False}
    assert workers.at_second_step["wandb_run_id"] is False  # two steps done before W&B's run existed
    assert [row["train/step"] for row in metrics_rows(tmp_path)] == [0, 1, 2, 3]
    history = [row for row in wandb_history(wandb_finished_records(tmp_path)) if "train/loss" in row]
    assert [row["train/step"] for row in history] == [0, 1, 2, 3]  # the rows that waited, then the rest
    assert (tmp_path / "plan.png").exists()


def test_the_driver_start_up_thread_returns_its_result_or_error_at_low_priority():
    import os
    import sys
    import threading
    import time

    from tinker_exp.train.sinks import Background

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    if sys.platform == "linux":  # per-thread niceness: the thread yields the CPU to the workers, not this one
        assert Background(niceness)() == min(niceness() + 10, 19) and niceness() < 19
    assert Background(lambda: "done")() == "done"
    with pytest.raises(ZeroDivisionError):
        Background(lambda: 1 / 0)()
    slow = Background(lambda: time.sleep(5))
    assert slow(0.05) is None and not slow.done()  # not done in time: nothing (a stop does not wait)


def test_a_starting_sink_keeps_the_rows_until_it_is_there():
    import threading

    from tinker_exp.train.sinks import StartingSink

    class Rows:
        def __init__(self):
            self.rows, self.closed = [], None

        def log(self, row):
            self.rows.append(row)

        def close(self, exit_code=0):
            self.closed = exit_code

    gate, target = threading.Event(), Rows()
    sink = StartingSink(lambda: gate.wait(60) and target)
    sink.log({"step": 0})
    sink.log({"step": 1})
    assert target.rows == []  # still starting: nothing waits for it
    gate.set()
    wait_until(lambda: target.rows, 60, "the rows never reached the sink")  # handed over as soon as it is there
    sink.log({"step": 2})
    sink.close(0)  # a finished run waits for it
    assert target.rows == [{"step": 0}, {"step": 1}, {"step": 2}] and target.closed == 0
    left_out = StartingSink(lambda: None)  # W&B warned and is left out: rows go nowhere, no error
    left_out.log({"step": 0})
    left_out.close(0)
    broken = StartingSink(lambda: 1 / 0)
    with pytest.warns(UserWarning, match="W&B's start failed: ZeroDivisionError"):
        broken.close(1)
