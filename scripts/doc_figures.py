"""Measure the figures quoted in docs/lora.md and docs/data-and-models.md: full fine-tuning against LoRA on the
tiny default model (losses, checkpoint sizes, trainable parameters) and the start line about the data of a run on
the shipped chat set.

Runs the real CLI (`python -m tinker_exp`: 20 steps, 2 CPU workers, W&B off) once per variant, one after the
other, each in its own temporary run dir, and prints per variant: the first and last training loss, the last
validation loss, the newest checkpoint's size, and what the run logged about its data and (LoRA) its adapters.

    .venv/bin/python scripts/doc_figures.py            # all five variants, about 40 s each on 2 cores
    .venv/bin/python scripts/doc_figures.py full r8    # only the variants named
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "full": [],
    "r8": ["lora=r8"],
    "r32": ["lora=r32"],
    "r8_lr1e-2": ["lora=r8", "optimizer.lr=1e-2"],
    "chat": ["data=tiny_chat"],  # the shipped conversations: its data line
}
LOGGED = ("data: ", "LoRA rank ")  # the lines of tinker_exp.log worth quoting, from where they start


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def logged_lines(log: Path) -> list[str]:
    return [line[line.index(start):] for line in log.read_text().splitlines() for start in LOGGED if start in line]


def measure(name: str, overrides: list[str], root: Path) -> str:
    run_dir = root / name
    command = [sys.executable, "-m", "tinker_exp", *overrides, "logger=none", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"WANDB_MODE": "offline"})
    if done.returncode:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [row["val/loss"] for row in rows if "val/loss" in row]
    newest = max((run_dir / "checkpoints").glob("step_*"))
    lines = [
        f"{name} ({' '.join(overrides) or 'full fine-tuning'}): train/loss {rows[0]['train/loss']:.3f} -> "
        f"{rows[-1]['train/loss']:.3f} (val {val[-1]:.3f}) in {len(rows)} steps; "
        f"checkpoint {newest.name}: {directory_bytes(newest) / 1e6:.2f} MB"
    ]
    return "\n    ".join(lines + logged_lines(run_dir / "tinker_exp.log"))


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="doc_figures_") as root:
        for name in names or list(VARIANTS):
            print(measure(name, VARIANTS[name], Path(root)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
