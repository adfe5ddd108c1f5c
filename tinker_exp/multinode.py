"""`srun python -m tinker_exp.multinode OVERRIDES`: one run over all nodes of an allocation, one task a node.

Used by launchers/slurm_multinode.sbatch. Task 0 starts the Ray head and runs `python -m tinker_exp
backend.nodes=<nodes> OVERRIDES` in it; every other task is a Ray node of it (tinker_exp.runtime.ray_cluster). An entry
point beside main.py: the runtime is handed the driver as a callable and never imports the entry point."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    from tinker_exp.runtime.ray_cluster import RENDEZVOUS_ENV, Allocation, run_on_allocation

    allocation = Allocation.from_env()
    rendezvous = Path(os.environ.get(RENDEZVOUS_ENV) or Path.cwd() / "outputs" / ".ray")

    def driver() -> int:
        from tinker_exp.main import main as tinker_exp_main

        sys.argv = ["tinker_exp", f"backend.nodes={allocation.nodes}", *sys.argv[1:]]
        try:
            tinker_exp_main()
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return 0

    sys.exit(run_on_allocation(driver, rendezvous) or 0)


if __name__ == "__main__":
    main()
