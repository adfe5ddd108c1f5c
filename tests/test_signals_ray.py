"""Slurm's warning signals (the time-limit USR2 submitit asks for) reach every process of the job: Ray's daemons
and workers, started by the driver, must outlive them so the driver's handler can requeue the job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, environment
from zygotes import JOB_CONFIG_ENV  # not the session's fork server: Ray's own workers, children of its raylet

PROBE = """
import os, signal, time, psutil, ray
from tinker_exp.runtime.ray_cluster import start_ray

handled = []
signal.signal(signal.SIGUSR2, lambda signum, frame: handled.append(signum))  # submitit's, in a real job
start_ray(None, {})

@ray.remote
class Echo:
    def ping(self):
        return os.getpid()

echo = Echo.remote()
actor_pid = ray.get(echo.ping.remote())
ray_processes = psutil.Process().children(recursive=True)
assert actor_pid in [p.pid for p in ray_processes]
for process in [psutil.Process(), *ray_processes]:  # what Slurm does with --signal: every process of the step
    os.kill(process.pid, signal.SIGUSR2)
time.sleep(2)
assert handled == [signal.SIGUSR2], handled  # the driver's handler still runs
assert [p.name() for p in ray_processes if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE] == []
assert ray.get(echo.ping.remote(), timeout=60) == actor_pid  # the worker and the cluster answer
print("ok", len(ray_processes))
"""


@pytest.mark.real  # its own Ray
def test_rays_processes_outlive_slurms_time_limit_signal():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=environment({"RAY_ADDRESS": None, JOB_CONFIG_ENV: None}))  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-3000:]
