"""Append one stage's figures to FIGURES (a JSON list, rewritten whole each time: a kill keeps what finished).

    python3 scripts/gpu_check/record.py FIGURES STAGE KIND RC SECONDS LOG [RUN_DIR] [END_TIME]

KIND: env (the ENV line), bench (benchmarks/gpu.py's GPU_BENCH line, else its GPU_BENCH_PARTIAL line, its progress
lines and its --json file, LOG.json), slots (benchmarks/slots.py's --json file, LOG.json, and its last lines), run (a
tinker_exp run dir: losses, step times, tokens/s, the device and workers lines, and the end of the run: END_TIME,
when the process exited, minus the last step's row and minus the last checkpoint's line), text (the log's last
lines), skipped, summary.
Stdlib only; never raises (a parse error is recorded as such).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path


def rows_of(run_dir: Path) -> list[dict]:
    rows = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def log_time(line: str) -> float | None:
    """The wall time of a tinker_exp.log line ([2026-12-04 17:02:03,123][...)."""
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000 if m else None


def run_figures(log: str, run_dir: Path, end: float | None) -> dict:
    rows = rows_of(run_dir)
    f: dict = {"run_dir": str(run_dir), "steps_logged": len(rows)}
    for prefix in ("device: ", "workers: ", "done: "):
        lines = [line.strip() for line in log.splitlines() if line.strip().startswith(prefix)]
        if lines:
            f[prefix.strip(": ") + "_line"] = lines[-1]
    if not rows:
        return f
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    times = [row.get("perf/step_time_s") for row in rows if row.get("perf/step_time_s") is not None]
    f.update(loss_first=losses[0], loss_last=losses[-1], step_time_first_s=times[0] if times else None,
             step_time_median_s=statistics.median(times[1:]) if len(times) > 1 else None,
             tokens_per_s_median=statistics.median([row["perf/tokens_per_s"] for row in rows[1:]]) if len(rows) > 1 else None)  # fmt: skip
    keys = [k for k in rows[0] if k.startswith("requested/")]
    f["applied_equals_requested"] = all(row.get("applied/" + k.split("/", 1)[1]) == row.get(k) for row in rows for k in keys if k in row)
    val = [row["val/loss"] for row in rows if "val/loss" in row]
    if val:
        f["val_loss_last"] = val[-1]
    last_step = rows[-1].get("time")
    run_log = run_dir / "tinker_exp.log"
    text = run_log.read_text(errors="replace") if run_log.exists() else ""
    checkpoints = [log_time(line) for line in text.splitlines() if "checkpoint: " in line]
    stamped = [t for t in (log_time(line) for line in text.splitlines()) if t is not None]
    if last_step is not None:
        f["end"] = {
            "last_checkpoint_after_last_step_s": (checkpoints[-1] - last_step) if checkpoints and checkpoints[-1] else None,
            "last_log_line_after_last_step_s": (stamped[-1] - last_step) if stamped else None,
            "process_exit_after_last_step_s": (end - last_step) if end else None,
            "adapter_exported": (run_dir / "adapter").is_dir(),
        }
    return f


def figures(kind: str, log_path: str, extra: list[str]) -> dict:
    log = Path(log_path).read_text(errors="replace") if log_path != "-" and Path(log_path).exists() else ""
    if kind == "env":
        lines = [line for line in log.splitlines() if line.startswith("ENV ")]
        return json.loads(lines[-1][4:]) if lines else {"parse": "no ENV line"}
    if kind == "bench":
        lines = [line for line in log.splitlines() if line.startswith("GPU_BENCH ")]
        partial = [line for line in log.splitlines() if line.startswith("GPU_BENCH_PARTIAL ")]
        if lines:
            f = json.loads(lines[-1][len("GPU_BENCH "):])
        elif partial:  # stopped in the bare loop: tinker_exp's figures
            f = {"partial": True, **json.loads(partial[-1][len("GPU_BENCH_PARTIAL "):])}
        else:
            f = {"parse": "no GPU_BENCH line"}
        f["progress"] = [line for line in log.splitlines() if line.startswith("[")][-40:]
        full = Path(log_path + ".json")
        if full.exists():
            f["all"] = json.loads(full.read_text())
        f["report"] = log[log.rfind("GPU benchmark: "):][:3000] if "GPU benchmark: " in log else log[-3000:]
        return f
    if kind == "run":
        return run_figures(log, Path(extra[0]), float(extra[1]) if len(extra) > 1 else None)
    if kind == "slots":  # benchmarks/slots.py: its --json file (LOG.json) and its last lines
        full = Path(log_path + ".json")
        f = json.loads(full.read_text()) if full.exists() else {"parse": "no --json file"}
        f["tail"] = log.splitlines()[-16:]
        return f
    if kind == "text":  # a benchmark that prints its own table (benchmarks/pool.py): its last lines
        return {"tail": log.splitlines()[-12:]}
    return {}


def main() -> None:
    path, stage, kind, rc, seconds, log = sys.argv[1:7]
    entry: dict = {"stage": stage, "kind": kind, "rc": rc, "seconds": float(seconds)}
    try:
        entry.update(figures(kind, log, sys.argv[7:]))
    except Exception as e:  # a figure that does not parse must not lose the others
        entry["parse_error"] = f"{type(e).__name__}: {e}"
    out = Path(path)
    try:
        entries = json.loads(out.read_text()) if out.exists() else []
    except ValueError:
        entries = []
    if kind == "summary":
        entry["stages"] = {e["stage"]: (e["rc"], e["seconds"]) for e in entries}
    entries.append(entry)
    out.write_text(json.dumps(entries, indent=1, default=str))


if __name__ == "__main__":
    main()
