"""One Ray cluster over a multi-node Slurm allocation: the pure parts (a task's allocation, each node's `ray start`,
a sweep point's overrides, the placement check). The real runs on the 2-node local Slurm cluster are in
tests/test_sweeps.py (the recipe; a sweep of 2-node points: one requeued that resumes, one cancelled)."""

from __future__ import annotations

import json
import os

import pytest

from helpers import run_cli
from hydra_plugins.tinker_exp_plugins.launchers import spanning
from tinker_exp.errors import ConfigError
from tinker_exp.runtime.device import check_placement
from tinker_exp.runtime.ray_cluster import Allocation, ray_start_command

TASK_1 = {
    "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "1", "SLURM_JOB_NUM_NODES": "2",
    "SLURMD_NODENAME": "n2", "SLURM_CPUS_ON_NODE": "16", "SLURM_GPUS_ON_NODE": "8",
}  # fmt: skip
TASK_0 = {**TASK_1, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"}


def test_a_task_reads_its_place_in_the_allocation():
    assert Allocation.from_env(TASK_1) == Allocation(job_id="41", restarts=2, rank=1, nodes=2, node="n2", cpus=16, gpus=8)
    # GPUs as Slurm's gres sets them when SLURM_GPUS_ON_NODE is missing; a first start; a CPU node
    gpus = Allocation.from_env({**TASK_1, "SLURM_GPUS_ON_NODE": "", "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert gpus.gpus == 3
    first = Allocation.from_env({k: v for k, v in TASK_1.items() if k not in ("SLURM_RESTART_COUNT", "SLURM_GPUS_ON_NODE")})
    assert (first.restarts, first.gpus) == (0, 0)


def test_a_requeued_job_never_reads_the_old_heads_address(tmp_path):
    before = Allocation.from_env({**TASK_1, "SLURM_RESTART_COUNT": "0"})
    after = Allocation.from_env(TASK_1)
    assert before.head_file(tmp_path) != after.head_file(tmp_path)
    assert before.temp_dir() == after.temp_dir() != Allocation.from_env({**TASK_1, "SLURM_PROCID": "0"}).temp_dir()


def flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].partition("=")[::2] for arg in command if arg.startswith("--"))


def test_each_ray_node_takes_its_allocation_and_ports_of_its_own():
    """Two Ray nodes may share a host: every port Ray would otherwise fix is a free one, per node; CPUs and GPUs are
    the task's (so a node holds the workers its allocation can, one per node here)."""
    task = Allocation.from_env(TASK_1)
    head = flags(ray_start_command(task, "10.0.0.1", head_port=6400))
    node = flags(ray_start_command(task, "10.0.0.2", head="10.0.0.1:6400"))
    for started in (head, node):
        assert started["num-cpus"] == "16" and started["num-gpus"] == "8" and "block" in started
        assert (started["min-worker-port"], started["max-worker-port"]) == ("0", "0")  # each worker a free port
        assert started["temp-dir"] == str(task.temp_dir())
    assert "head" in head and head["port"] == "6400" and head["node-ip-address"] == "10.0.0.1"
    assert "head" not in node and node["address"] == "10.0.0.1:6400" and node["node-ip-address"] == "10.0.0.2"
    ports = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "metrics-export-port", "runtime-env-agent-port"]  # fmt: skip
    for started, own in ((head, [*ports, "ray-client-server-port", "port"]), (node, ports)):  # a node's own: distinct
        chosen = [int(started[p]) for p in own]  # (another node binds its own when it starts, on its own host or this)
        assert len(set(chosen)) == len(chosen) and 52365 not in chosen and 10001 not in chosen  # not Ray's fixed defaults


def test_free_ports_are_distinct_and_never_the_one_set_aside():
    """Chosen together, each socket held until all are: never the same port twice (a head's node manager and object
    manager once got the same one, and its `ray start` failed), nor the head's own port."""
    from tinker_exp.runtime.ray_cluster import free_port, free_ports

    head_port = free_port()
    for _ in range(20):
        ports = free_ports(7, besides=head_port)
        assert len(set(ports)) == 7 and head_port not in ports


def test_a_sweep_point_spans_the_jobs_nodes():
    assert spanning(["optimizer.lr=1e-3"], 2) == ["optimizer.lr=1e-3", "backend.nodes=2"]
    assert spanning(["backend.nodes=2", "trainer.steps=3"], 2) == ["trainer.steps=3", "backend.nodes=2"]
    with pytest.raises(ConfigError, match=r"^backend.nodes=3: a sweep point spans hydra.launcher.nodes=2 nodes"):
        spanning(["backend.nodes=3"], 2)


def test_nodes_on_the_local_launcher_is_a_config_error(tmp_path):
    result = run_cli("-m", "hydra/launcher=local", "hydra.launcher.nodes=2", f"hydra.sweep.dir={tmp_path}", "dry_run=true")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tinker_exp: config error: hydra.launcher.nodes=2: the local launcher runs each job on this machine; "
        "a point spans nodes with hydra/launcher=slurm"
    )
    assert not (tmp_path / ".submitit").exists()


def cpu_rank(node: str, node_id: str) -> dict:
    return {"platform": "cpu", "parameters": "cpu", "attention": "sdpa", "node": (node_id, node)}


def test_ranks_of_a_multi_node_run_each_on_its_own_node():
    ranks = [cpu_rank("n1", "a" * 56), cpu_rank("n2", "b" * 56)]
    assert check_placement("cpu", ranks, nodes=2) == (
        "2 rank(s) on cpu; Ray nodes: rank 0 n1 (aaaaaaaa), rank 1 n2 (bbbbbbbb); attention sdpa"
    )
    with pytest.raises(RuntimeError, match=r"^backend.nodes=2, but the 2 ranks run on 1 Ray node\(s\)$"):
        check_placement("cpu", [cpu_rank("n1", "a" * 56)] * 2, nodes=2)
    assert check_placement("cpu", [cpu_rank("vm", "a" * 56)] * 2) == "2 rank(s) on cpu; attention sdpa"  # one node


def test_a_node_whose_ray_start_exits_under_a_running_head_joins_again(tmp_path, monkeypatch, capsys):
    """`ray start` gives its raylet a fixed 30 s to register (a loaded machine misses it: the 2-node preemption test
    once did): the node starts again while the head answers, and the task fails only after NODE_STARTS starts."""
    import sys
    import time

    from tinker_exp.runtime import ray_cluster

    allocation = Allocation.from_env({**TASK_1, "SLURM_JOB_ID": f"t{time.monotonic_ns()}"})
    allocation.head_file(tmp_path).write_text('{"address": "127.0.0.1:1", "node": "n1"}')
    exits, runs = [sys.executable, "-c", "raise SystemExit(1)"], [sys.executable, "-c", "import time; time.sleep(60)"]
    commands = [exits, runs]
    monkeypatch.setattr(ray_cluster, "ray_start_command", lambda *a, **k: commands.pop(0))
    monkeypatch.setattr(ray_cluster.time, "sleep", lambda s: None)
    monkeypatch.setattr(ray_cluster, "answers", lambda address: bool(commands))  # gone once the second start runs
    ray_cluster.ray_node(allocation, tmp_path)
    out = capsys.readouterr().out
    assert out.count("joins the Ray head at 127.0.0.1:1") == 2 and commands == []
    assert "the Ray node on n2 exited (1) while the head at 127.0.0.1:1 runs; it joins again (2 of 3)" in out
    assert out.rstrip().endswith("the Ray head is gone; this node stopped")

    monkeypatch.setattr(ray_cluster, "ray_start_command", lambda *a, **k: exits)
    monkeypatch.setattr(ray_cluster, "answers", lambda address: True)
    with pytest.raises(RuntimeError, match=r"the Ray node on n2 exited \(1\) while the head at 127.0.0.1:1 runs"):
        ray_cluster.ray_node(allocation, tmp_path)
    assert capsys.readouterr().out.count("joins the Ray head") == ray_cluster.NODE_STARTS


def test_a_head_whose_ray_start_exits_before_it_started_starts_again(tmp_path, monkeypatch, capsys):
    """Task 0's `ray start --head` once timed out registering its raylet (ci14, a loaded machine) and exited after
    its GCS had answered, leaving the driver on a dead head: the head counts as up only once `ray start` says so
    (ray_cluster.STARTED) and its port answers; one that exits before starts again on a new port, and after
    NODE_STARTS starts the task fails. Its address is shared only once it has started."""
    import sys
    import time

    from tinker_exp.runtime import ray_cluster

    allocation = Allocation.from_env({**TASK_0, "SLURM_JOB_ID": f"t{time.monotonic_ns()}"})
    exits = [sys.executable, "-c", "print('registering'); raise SystemExit(1)"]

    def serves(port: int) -> list[str]:  # a head that starts: it prints STARTED and answers on its port
        code = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
                f"print({ray_cluster.STARTED!r}, flush=True); time.sleep(60)")
        return [sys.executable, "-c", code]

    commands = [exits, "serves"]
    monkeypatch.setattr(ray_cluster, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(ray_cluster, "ray_start_command", lambda a, ip, head_port: (lambda c: serves(head_port) if c == "serves" else c)(commands.pop(0)))
    with ray_cluster.ray_head(allocation, tmp_path) as address:
        assert json.loads(allocation.head_file(tmp_path).read_text())["address"] == address == os.environ["RAY_ADDRESS"]
    out = capsys.readouterr().out
    assert commands == [] and out.count("Ray head 127.0.0.1:") == 2 and "registering" in out
    assert "the Ray head on n1 exited (1) before it started; it starts again (2 of 3)" in out
    assert not allocation.head_file(tmp_path).exists()

    monkeypatch.setattr(ray_cluster, "ray_start_command", lambda *a, **k: exits)
    with pytest.raises(RuntimeError, match=r"^the Ray head on n1 exited \(1\) before it started$"):
        with ray_cluster.ray_head(allocation, tmp_path):
            pass
    assert capsys.readouterr().out.count("Ray head 127.0.0.1:") == ray_cluster.NODE_STARTS
    assert not allocation.head_file(tmp_path).exists()


def test_a_ray_node_stops_on_sigterm_without_draining_first(tmp_path, monkeypatch, capsys):
    """A node's `ray start` runs with Ray's SIGTERM drain off, as Ray reads it: its SIGTERM (the job's end, stop_group's)
    stops it at once, not after up to 30 s of draining for Serve (10 s a node on the local cluster, stop_group's grace)."""
    import sys

    from tinker_exp.runtime import ray_cluster

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "30")  # a user's own setting does not bring it back
    reads = [sys.executable, "-c", "from ray._private import ray_constants as c; print('drain', c.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)"]
    with ray_cluster.ray_process(reads, Allocation.from_env(TASK_1)) as (process, _):
        assert process.wait(60) == 0
    assert "drain 0.0\n" in capsys.readouterr().out


@pytest.mark.parametrize("stopping", [False, True])
def test_a_ray_node_that_ignores_sigterm_is_killed_after_the_grace_and_sooner_once_the_job_is_stopping(stopping, monkeypatch):
    """stop_group: SIGTERM to the node's process group, SIGKILL after its grace; once SIGTERM reached this process
    (Slurm's KillWait is running) the grace is STOPPING_WAIT_S (both shortened here)."""
    import signal
    import subprocess
    import sys

    from tinker_exp.runtime.ray_cluster import stop_group
    from tinker_exp.train import signals

    monkeypatch.setattr(signals, "SIGTERM_RECEIVED", signals.threading.Event())
    monkeypatch.setattr(signals, "STOPPING_WAIT_S", 0.5)
    if stopping:
        signals.SIGTERM_RECEIVED.set()
    process = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                "print('ready', flush=True); time.sleep(120)"], start_new_session=True, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline() == "ready\n"  # its SIGTERM is ignored from here
    waited = []
    wait = process.wait
    monkeypatch.setattr(process, "wait", lambda timeout=None: (waited.append(timeout), wait(timeout))[1])
    stop_group(process, grace_s=3.0)
    assert process.returncode == -signal.SIGKILL
    assert waited == [0.5 if stopping else 3.0, 5.0]


@pytest.mark.parametrize("stopping", [False, True])
def test_freeing_the_workers_of_a_cluster_that_does_not_answer_waits_less_once_the_job_is_stopping(stopping, monkeypatch):
    """TinkerWorkers.shutdown on a cluster it did not start: ray.kill runs in a thread joined for its timeout, at most
    STOPPING_WAIT_S once SIGTERM arrived (Slurm signalled Ray's daemons too; its KillWait is running). Both
    shortened here."""
    import threading
    import types
    import warnings

    import ray

    from tinker_exp.runtime.workers import TinkerWorkers
    from tinker_exp.train import signals

    monkeypatch.setattr(signals, "SIGTERM_RECEIVED", threading.Event())
    monkeypatch.setattr(signals, "STOPPING_WAIT_S", 0.5)
    if stopping:
        signals.SIGTERM_RECEIVED.set()
    released = threading.Event()
    monkeypatch.setattr(ray, "kill", lambda worker: released.wait(60))  # a GCS that does not answer
    workers = object.__new__(TinkerWorkers)  # only what shutdown reads: no Ray started
    workers.owns_ray, workers.output, workers.pool = False, None, None
    workers.group = types.SimpleNamespace(workers=["actor"])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            workers.shutdown(timeout_s=3.0)
    finally:
        released.set()
    assert [str(w.message) for w in caught] == [f"Ray did not free the workers within {'0' if stopping else '3'} s (is its cluster gone?)"]


def test_rays_notice_of_its_default_token_is_dropped_while_a_run_starts_its_cluster_and_only_that():
    """Ray's own warning functions, as ray.init calls them for a new local cluster: the one that says it did what it
    does by default is dropped inside start_ray's filter (a run's terminal stays quiet); a disabled token is still
    said, and outside the filter the notice reaches the logger's handlers as Ray sends it."""
    import logging

    from ray._private.authentication import authentication_token_setup as auth

    from tinker_exp.runtime.ray_cluster import DEFAULT_TOKEN_AUTH, dropped

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # ray's loggers do not propagate to pytest's
    logger = logging.getLogger(auth.__name__)
    logger.addHandler(handler)
    try:
        with dropped(logger, DEFAULT_TOKEN_AUTH):
            auth._warn_token_auth_enabled()
            auth._warn_token_auth_disabled()
        auth._warn_token_auth_enabled()
    finally:
        logger.removeHandler(handler)
    assert len(said) == 2 and said[0].startswith("Token authentication is disabled") and said[1].startswith(DEFAULT_TOKEN_AUTH)
