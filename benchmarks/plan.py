"""Cost of the override plan: a 100,000-step dry run with four scheduled keys, next to `import hydra`,
and the per-step cost of computing, converting and validating one step's values.

    .venv/bin/python benchmarks/plan.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = [
    "+override=[lr_wsd,beta2_warmup,wd_cosine]",
    "+override.eps={schedule:exponential,value:1e-8,gamma:0.99999}",
    "override.lr.decay_steps=20000",
]


def wall(cmd: list[str], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from omegaconf import OmegaConf

    from tinker_exp.config import OptimizerConfig
    from tinker_exp.optim.convert import convert_params
    from tinker_exp.optim.plan import _sources, _value_at, build_plan

    with tempfile.TemporaryDirectory() as tmp:
        dry = wall([sys.executable, "-m", "tinker_exp", *OVERRIDES, "trainer.steps=100000", "dry_run=true",
                    f"hydra.run.dir={tmp}"])
    hydra = wall([sys.executable, "-c", "import hydra"])

    override = OmegaConf.to_container(OmegaConf.create({
        "lr": {"schedule": "wsd", "value": 1e-3, "warmup_steps": 2000, "decay_steps": 20000},
        "betas": [0.9, {"schedule": "linear", "start": 0.95, "end": 0.999}],
        "weight_decay": {"schedule": "cosine", "value": 0.1},
        "eps": {"schedule": "exponential", "value": 1e-8, "gamma": 0.99999},
    }))
    start = time.perf_counter()
    build_plan(override, OptimizerConfig(), 100_000)
    build = time.perf_counter() - start
    sources, _ = _sources(override, 100_000)
    start = time.perf_counter()
    for step in range(100_000):
        convert_params({key: _value_at(source, step) for key, source in sources.items()})
    per_step = (time.perf_counter() - start) / 100_000

    print(f"dry run, 100,000 steps, 4 scheduled keys (CLI, wall) : {dry:8.2f} s")
    print(f"python -c 'import hydra' (wall)                      : {hydra:8.2f} s   ratio {dry / hydra:.1f}x")
    print(f"build_plan in process, 100,000 steps                 : {build:8.2f} s")
    print(f"compute + convert + validate one step                : {per_step * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
