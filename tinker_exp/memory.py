"""The memory a machine has free now, for what decides how much to keep on it (a pool's groups, a sweep's slots).

Pure Python (stdlib only): Linux's /proc/meminfo for the host, nvidia-smi for GPUs; no torch, so a sweep's process
can ask before anything heavy is imported.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

MEMORY_SHARE = 0.5
"""The share of the memory free now that what we keep may take: a pool's groups (`pool up --memory-mb` sets theirs),
a sweep's automatic slots (hydra.launcher.slots=auto). The rest is left to the runs' own peaks and to other users."""


def host_memory_mb() -> float | None:
    """Memory available on this machine now (Linux's MemAvailable), in MiB; None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def gpu_memory_mb() -> float | None:
    """Free memory of this machine's fullest NVIDIA GPU (the smallest free), in MiB; None without nvidia-smi or GPUs."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
        free = [float(line) for line in out.stdout.split() if line.strip()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return min(free) if out.returncode == 0 and free else None


def default_memory_budget_mb() -> float:
    """MEMORY_SHARE of the host memory available now (unbounded where unknown)."""
    available = host_memory_mb()
    return float("inf") if available is None else available * MEMORY_SHARE
