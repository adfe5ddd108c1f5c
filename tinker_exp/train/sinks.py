"""Where step metrics go: metrics.jsonl (always); W&B, metrics.csv, TensorBoard (each when chosen, never fatal); a bar."""

from __future__ import annotations

import csv
import json
import logging
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from tinker_exp import threads
from tinker_exp.config import LoggerConfig
from tinker_exp.errors import one_line
from tinker_exp.formats import read_jsonl
from tinker_exp.optim.plan import Plan, override_config
from tinker_exp.train.signals import sigterm_deferred

log = logging.getLogger(__name__)


class JsonlSink:
    """One JSON object per step, flushed at once: a killed run keeps every step it finished.

    A run that starts at `first_step` (resumed from a checkpoint) drops the rows of that step and later,
    logged before a crash, so every step is in the file exactly once. That happens at the first row
    logged: a run that fails before it (e.g. its checkpoint does not load) leaves the file as it was.
    """

    def __init__(self, path: Path, first_step: int = 0):
        self.path, self.first_step = path, first_step
        self._file = None

    def log(self, row: dict[str, Any]) -> None:
        if self._file is None:
            if self.path.exists():
                keep_rows_before(self.path, self.first_step)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()


def keep_rows_before(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) with only its complete rows of train/step < step."""
    kept = [json.dumps(row) + "\n" for row in read_jsonl(path) if row.get("train/step", step) < step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


class NeverFatal:
    """A sink that fails alone: its first failure warns once and stops it, never training (metrics.jsonl has every step)."""

    what = "a logger"
    fallback = "training goes on without it (metrics.jsonl has every step)"
    broken = False

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> None:
        """Call `method`; an exception warns once (naming the sink) and stops the sink."""
        if self.broken:
            return
        try:
            method(*args, **kwargs)
        except Exception as e:
            self.broken = True
            warnings.warn(f"{self.what} stopped working ({type(e).__name__}: {e}); {self.fallback}", stacklevel=3)


class CsvSink(NeverFatal):
    """metrics.jsonl's rows as a table (metrics.csv, the standard library's csv): a row per step, a column per key.

    The header is every key logged so far, in the order first logged. A key first logged after the first row (val/loss
    at the first evaluation) rewrites the file, atomically, with the wider header (earlier rows leave its cell empty):
    every row always has the header's columns, as pandas and spreadsheets read them. Rare (a new key), so a step costs
    one row written and flushed. A run that starts at `first_step` (resumed) drops the rows of that step and later at
    its first row, as JsonlSink does, and keeps the header's columns."""

    what = "metrics.csv"

    def __init__(self, path: Path, first_step: int = 0):
        self.path, self.first_step = path, first_step
        self.columns: list[str] = []
        self._file: Any = None
        self._writer: Any = None

    def log(self, row: dict[str, Any]) -> None:
        self._call(self._log, row)

    def _log(self, row: dict[str, Any]) -> None:
        if self._file is None:
            kept = self._read(before=self.first_step) if self.path.exists() else []
            self._rewrite(kept, [*self.columns, *(key for key in row if key not in self.columns)])
        elif any(key not in self.columns for key in row):
            self._file.close()
            self._rewrite(self._read(), [*self.columns, *(key for key in row if key not in self.columns)])
        self._writer.writerow(row)
        self._file.flush()

    def _read(self, before: float = float("inf")) -> list[dict[str, str]]:
        """The file's complete rows of train/step < `before`; its header becomes `columns`."""
        with open(self.path, newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            self.columns = list(reader.fieldnames or [])
            rows = [row for row in reader if None not in row and None not in row.values()]  # a row cut by a kill: out
        return [row for row in rows if _step(row) < before]

    def _rewrite(self, rows: list[dict[str, Any]], columns: list[str]) -> None:
        """Write `rows` under the header `columns` (in place of the file, atomically) and go on appending to it."""
        self.columns = columns
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=columns)

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._call(self._file.close)


def _step(row: dict[str, str]) -> float:
    """A CSV row's train/step; a row without a readable one sorts last (dropped from a resumed run's file)."""
    try:
        return int(row.get("train/step") or "")
    except ValueError:
        return float("inf")


TENSORBOARD_DROPPED = ("train/step", "time")
"""metrics.jsonl keys that are no chart in TensorBoard: each event's step and wall time."""


class TensorBoardSink(NeverFatal):
    """Each row's numbers as scalars in TensorBoard's event files (its own writer), step = train/step, in `folder`.

    One event a step (every scalar of the row in one summary), flushed at once; TensorBoard is imported at the first
    row (nothing is written before it, as in metrics.jsonl). The flat config once, as a text (a table) and as the
    run's hparams (TensorBoard's HPARAMS tab compares a sweep's trials by them). A run that starts at `first_step` (resumed, or rerun after a crash) opens its own event file
    with a session start at that step: TensorBoard's readers drop what an earlier file logged at that step and later,
    so each step is read once."""

    what = "TensorBoard"

    def __init__(self, folder: Path, config: Mapping[str, Any], first_step: int = 0):
        self.folder, self.config, self.first_step = folder, dict(config), first_step
        self._writer: Any = None

    def log(self, row: dict[str, Any]) -> None:
        self._call(self._log, row)

    def _log(self, row: dict[str, Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            self._open()
        values = [Summary.Value(tag=key, simple_value=value) for key, value in row.items()
                  if key not in TENSORBOARD_DROPPED and isinstance(value, (int, float)) and not isinstance(value, bool)]  # fmt: skip
        self._writer.add_event(Event(wall_time=row.get("time", time.time()), step=row["train/step"], summary=Summary(value=values)))
        self._writer.flush()  # as metrics.jsonl: a killed run keeps every step it logged (a resume needs those before it)

    def _open(self) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.folder))
        now, step = time.time(), self.first_step
        self._writer.add_event(Event(wall_time=now, step=step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.add_event(Event(wall_time=now, step=step, summary=config_summaries(self.config)))

    def close(self, exit_code: int = 0) -> None:
        if self._writer is not None:
            self._call(self._writer.close)


def config_summaries(config: Mapping[str, Any]) -> Any:
    """The flat config as TensorBoard's text (a markdown table, tag `config`) and as the run's hparams."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.hparams import metadata as hparams_metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionStartInfo

    table = "| key | value |\n|---|---|\n" + "".join(f"| {key} | {json.dumps(value)} |\n" for key, value in config.items())
    text = TensorProto(dtype="DT_STRING", string_val=[table.encode()], tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    start = SessionStartInfo()
    for key, value in config.items():
        if isinstance(value, bool):
            start.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            start.hparams[key].number_value = value
        elif value is not None:
            start.hparams[key].string_value = value if isinstance(value, str) else json.dumps(value)
    hparams = HParamsPluginData(session_start_info=start, version=hparams_metadata.PLUGIN_DATA_VERSION)
    return Summary(value=[
        Summary.Value(tag="config", tensor=text, metadata=SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))),
        Summary.Value(tag=hparams_metadata.SESSION_START_INFO_TAG, metadata=SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name=hparams_metadata.PLUGIN_NAME, content=hparams.SerializeToString()))),
    ])  # fmt: skip


def end_wandb_service() -> None:
    """End W&B's service process now, as W&B's exit hook would end it; nothing when no run here used W&B.

    The service is started by the first W&B run in this process. A process that ends its own children before it exits (a
    pool's, at its end) otherwise leaves that hook only a traceback, its service gone."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        try:
            wandb.teardown()
        except Exception as e:  # noqa: BLE001  (the process is ending: say it, go on)
            log.warning(f"W&B's service did not end cleanly ({type(e).__name__}: {e})")


def wandb_environment(run_dir: Path, mode: str) -> dict[str, str]:
    """Keep W&B's files inside the run dir, and offline runs off the network (set before import)."""
    wandb_dir = run_dir / "wandb_files"
    env = {
        "WANDB_DIR": str(run_dir),
        "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
        "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
        "WANDB_DATA_DIR": str(wandb_dir / "data"),
        "WANDB_ERROR_REPORTING": "false",
    }
    if mode == "offline":
        env["WANDB_MODE"] = "offline"
    return env


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf of a nested config under its dotted path, a list's items under their index.

    {'a': {'b': [1, {'c': 2}]}} -> {'a.b.0': 1, 'a.b.1.c': 2}; an empty mapping or list stays a value ({'tags': []})."""
    flat: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)) and value:
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}")
        else:
            flat[path] = value

    for key, value in config.items():
        walk(value, str(key))
    return flat


def wandb_run_config(resolved: Mapping[str, Any], plan: Plan, choices: Mapping[str, Any] | None, job: Any) -> dict[str, Any]:
    """The W&B run config, one flat key per value (W&B's parallel coordinates, grouping and filters work on keys).

    The resolved config with its override section as the plan uses it (`override_config`: a schedule's kind and every
    parameter, defaults filled in; a plain value is a constant), Hydra's choices and the job."""
    config = {key: value for key, value in resolved.items() if key != "override"}
    if plan.keys:
        config["override"] = override_config(plan)
    return flat_config({**config, "hydra_choices": dict(choices or {}), "job": job})


WANDB_DROPPED = ("time",)
"""metrics.jsonl keys W&B does not get: the wall clock (W&B keeps `_timestamp` itself)."""
WANDB_SUMMARY_ONLY = ("train/nonfinite_steps", "val/tokens")
"""metrics.jsonl keys W&B keeps in the run summary, not the history: counts, not curves (no chart)."""


def summary_ops(objective: str, mode: str, rl: bool = False) -> dict[str, str]:
    """What the W&B run's summary keeps of each metric (W&B's summary ops, comma-separated).

    An SFT run's val/loss its lowest; an RL run's rewards (train/reward, eval/reward) their highest and last, so the
    summary shows the best evaluation; the run's objective (trainer.objective) also by its mode (min or max), beside its
    last."""
    ops = {"train/reward": "max,last", "eval/reward": "max,last"} if rl else {"val/loss": "min"}
    if mode in ("min", "max"):
        ops[objective] = ",".join(dict.fromkeys([mode, *ops.get(objective, "last").split(","), "last"]))
    return ops


class WandbSink(NeverFatal):
    """The run's history holds only what a person charts; everything else goes to the config or the summary."""

    what = "W&B"
    fallback = "metrics.jsonl only from here"

    def __init__(self, run: Any):
        self.run = run
        self._summary: dict[str, Any] = {}

    @classmethod
    def start(cls, logger_cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], name: str,
              summaries: Mapping[str, str] | None = None) -> "WandbSink | None":  # fmt: skip
        """Start a W&B run; on any failure warn and return None (training goes on, JSONL is complete).

        `summaries`: metric -> what the run's summary keeps of it (`summary_ops`).

        One W&B run id per run dir (kept in `wandb_run_id`): a run continued in the same dir (resume, a
        requeued Slurm job) resumes the same W&B run.
        """
        mode = logger_cfg.mode.value
        os.environ.update(wandb_environment(run_dir, mode))
        for key in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            Path(os.environ[key]).mkdir(parents=True, exist_ok=True)
        try:
            import wandb

            id_file = run_dir / "wandb_run_id"
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(4))
            run = wandb.init(
                id=id_file.read_text().strip(),
                resume="allow",
                # runs at once in one process (a sweep's trials on slots, a pool's runs on slots) each their own: by
                # default W&B hands a second init the run already active in the process, and finishes it with it
                reinit="create_new",
                project=logger_cfg.project,
                entity=logger_cfg.entity,
                group=logger_cfg.group,
                tags=list(logger_cfg.tags),
                name=name,
                mode=mode,
                dir=str(run_dir),
                config=config,
                # silent: no banner or run summary on the terminal; one line of ours says where the run is.
                settings=wandb.Settings(init_timeout=logger_cfg.init_timeout_s, x_disable_viewer=True, silent=True),
            )
            run.define_metric("train/step", hidden=True)  # the x axis, not a chart of its own
            run.define_metric("*", step_metric="train/step")
            for metric, kept in (summaries or summary_ops("val/loss", "last")).items():
                run.define_metric(metric, step_metric="train/step", summary=kept)
            log.info(f"W&B run {run.id} ({mode}): {run.dir}")
            return cls(run)
        except Exception as e:  # no key, no network, bad entity: never stop training for the logger
            warnings.warn(f"W&B could not start ({type(e).__name__}: {e}); metrics.jsonl only", stacklevel=2)
            return None

    def attach_plan(self, header: list[str], rows: list[list], plot: Path | None) -> None:
        """Attach the override plan's table (in the run summary) and plot (in the history, once before step 0).

        The table goes in the summary: a table in the history would chart its row and column counts. The plot is an
        image: a media panel, no chart."""
        import wandb

        self._call(self.run.summary.update, {"plan/table": wandb.Table(columns=header, data=rows)})
        if plot is not None:
            self._call(self.run.log, {"plan/plot": wandb.Image(str(plot))})

    def attach_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A table in the run summary (a population member's exploits)."""
        import wandb

        self._call(self.run.summary.update, {name: wandb.Table(columns=columns, data=rows)})

    def log(self, row: dict[str, Any]) -> None:
        history = {key: value for key, value in row.items() if key not in WANDB_DROPPED + WANDB_SUMMARY_ONLY}
        self._call(self.run.log, history)
        summary = {key: row[key] for key in WANDB_SUMMARY_ONLY if key in row and self._summary.get(key, object()) != row[key]}
        if summary:
            self._call(self.run.summary.update, summary)
            self._summary.update(summary)

    def close(self, exit_code: int = 0) -> None:
        self._call(self.run.finish, exit_code=exit_code)


class ProgressBar:
    """Steps done of trainer.steps on stderr; a resumed run's bar starts at its first step (20/60, not 0/60)."""

    def __init__(self, total: int, first_step: int = 0):
        self.total, self.first_step = total, first_step
        self.last_eval: float | None = None  # an RL run's latest eval/reward, shown until the next evaluation
        self._bar = None

    def log(self, row: dict[str, Any]) -> None:
        if self._bar is None:  # opened at the first step, so worker start-up does not skew its rate
            from tqdm import tqdm

            # position=0: each run's bar is the first line of its own terminal, also when runs on slots share a
            # process (tqdm would stack the bars of one process)
            self._bar = tqdm(
                total=self.total, initial=self.first_step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                position=0,
            )
        self.last_eval = row.get("eval/reward", self.last_eval)
        self._bar.set_postfix(progress_fields(row, self.last_eval), refresh=False)
        self._bar.update(1)

    def close(self, exit_code: int = 0) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_fields(row: dict[str, Any], last_eval: float | None = None) -> dict[str, Any]:
    """What the progress bar shows of a step, in order.

    An RL run's reward first (and `last_eval`, its latest eval/reward), not its loss (a policy-gradient surrogate near
    0); an SFT run's loss."""
    lr = f"{row.get('applied/lr', float('nan')):.3g}"
    if "train/reward" in row:
        evaluated = {} if last_eval is None else {"eval_reward": f"{last_eval:.4f}"}
        return {"reward": f"{row['train/reward']:.4f}", **evaluated, "step": row["train/step"], "lr": lr}
    return {"step": row["train/step"], "loss": f"{row['train/loss']:.4f}", "lr": lr}


class Background:
    """Work running in a thread at a lower CPU priority.

    The driver's own start-up work then takes only the CPU the workers' start-up leaves (on a machine of few cores they
    would otherwise share it)."""

    def __init__(self, work: Callable[[], Any]):
        self.box: dict[str, Any] = {}
        self.thread = threads.start(lambda: self._run(work), "driver-start-up")  # its lines are the run's

    def _run(self, work: Callable[[], Any]) -> None:
        if sys.platform == "linux":  # Linux: per-thread niceness (a child process started here inherits it)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except OSError:
                pass
        try:
            self.box["result"] = work()
        except BaseException as e:  # re-raised in the caller
            self.box["error"] = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def __call__(self, timeout: float | None = None) -> Any:
        """The result (the work's error re-raised); None if it is not done within `timeout`."""
        self.thread.join(timeout)
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("result")


class StartingSink:
    """A sink that starts in the background (W&B's run, started beside the workers), so that no step waits for it.

    Rows wait, in order, until it is there; the thread that started it then hands it the waiting rows. Closing waits for
    it (at most 10 s when the run failed). A start that gave no sink (W&B warned and is left out) or failed drops the
    rows."""

    def __init__(self, start: Callable[[], Any]):
        self.lock = threading.Lock()
        self.sink: Any = None
        self.waiting: list[dict[str, Any]] | None = []  # None once started (or failed)
        self.started = Background(lambda: self._started(start))

    def _started(self, start: Callable[[], Any]) -> Any:
        sink = None
        try:
            sink = start()
        finally:
            with self.lock:  # a row logged meanwhile waits for this, so the order holds
                self.sink, waiting, self.waiting = sink, self.waiting or [], None
                for row in waiting if sink is not None else ():
                    sink.log(row)
        return sink

    def log(self, row: dict[str, Any]) -> None:
        with self.lock:
            if self.waiting is not None:
                self.waiting.append(row)
                return
        if self.sink is not None:
            self.sink.log(row)

    def attach_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Once the sink is there (at the run's end: it is, or closing would wait for it anyway)."""
        try:
            sink = self.started(None)
        except Exception:  # the start failed: close() says so
            return
        if sink is not None:
            sink.attach_table(name, columns, rows)

    def close(self, exit_code: int = 0) -> None:
        try:
            self.started(None if exit_code == 0 else 10.0)
        except Exception as e:  # the start failed: the other sinks still close
            warnings.warn(f"W&B's start failed: {one_line(e)}", stacklevel=1)
            return
        with self.lock:
            sink = self.sink
        if sink is not None:
            sink.close(exit_code)


class Sinks:
    """Fan-out to every sink; closing always closes all of them."""

    def __init__(self, sinks: list[Any]):  # Sink or None (a sink that did not start)
        self.sinks = [s for s in sinks if s is not None]

    def log(self, row: dict[str, Any]) -> None:
        with sigterm_deferred():  # a SIGTERM between two sinks would leave the row in one of them only
            for sink in self.sinks:
                sink.log(row)

    def attach_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        for sink in self.sinks:
            if hasattr(sink, "attach_table"):
                sink.attach_table(name, columns, rows)

    def close(self, exit_code: int = 0) -> None:
        for sink in self.sinks:
            sink.close(exit_code)
