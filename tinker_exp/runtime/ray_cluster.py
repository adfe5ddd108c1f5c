"""The Ray cluster of a run: a local one started for it, one it joins, or one over a Slurm allocation.

Started or joined by :func:`start_ray`; over a Slurm allocation of several nodes by :func:`run_on_allocation`, whose
nodes the driver waits for (:func:`wait_for_nodes`).

Over an allocation, every task of the job (one per node) calls :func:`run_on_allocation`: task 0 starts the Ray head in
its allocation and runs the tinker_exp driver, which joins it; each other task starts a Ray node that joins the head and
blocks until the driver is done (the head gone), then exits. Used by `launchers/slurm_multinode.sbatch` (`srun python -m
tinker_exp.multinode OVERRIDES`, which hands it the driver) and by a multi-node sweep point (the submitit launchers run
their job function once per task).

Each Ray node takes the CPUs and GPUs Slurm gave its task (`--num-cpus`, `--num-gpus`), so Ray places as many
workers on it as the allocation holds, and free ports of its own: several nodes may share one host (the local
Slurm cluster runs two on one machine), and Ray's fixed default ports would collide. The head's address reaches
the other tasks through a small file in a folder they all see (the job's submitit folder, or the recipe's); the
cluster's auth token only through the environment, never a file. Ray's processes stay children of their task
(`ray start --block`), so Slurm ends them with the job, and they ignore Slurm's USR1/USR2 (the time-limit
signal is the driver's to handle).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, TypeVar

from tinker_exp.train.signals import cleanup_wait, ignored_by_children, sigterm_handler_kept

T = TypeVar("T")

HEAD_WAIT_S = 300.0
"""How long a node waits for the head's address (the head's task may start later than its own)."""
HEAD_GONE_CHECKS = 3
"""A node stops once the head has not answered this many checks in a row, a second apart."""
NODE_STARTS = 3
"""How often a node starts `ray start` (the head: before it has started; another node: while the head runs); a
start that exits is retried."""
RENDEZVOUS_ENV = "TINKER_EXP_RAY_RENDEZVOUS"
"""The folder, seen by every task, where the head's address is left (the recipe's default: outputs/.ray)."""


@dataclass(frozen=True)
class Allocation:
    """This task's place in its Slurm job (read from the environment Slurm sets for each task)."""

    job_id: str
    """The job (for an array task, its own job id); with the restart count, names the head's address file."""
    restarts: int
    """How often Slurm requeued the job: a requeued job's new head never meets the old one's address."""
    rank: int
    """SLURM_PROCID: 0 runs the Ray head and the driver."""
    nodes: int
    """The job's nodes: one task, and one Ray node, each."""
    node: str
    """This task's Slurm node name."""
    cpus: int
    """CPUs Slurm gave this node's task: the Ray node's --num-cpus."""
    gpus: int
    """GPUs Slurm gave it (SLURM_GPUS_ON_NODE, or the CUDA_VISIBLE_DEVICES it set): the Ray node's --num-gpus."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Allocation":
        env = os.environ if env is None else env
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return cls(
            job_id=env["SLURM_JOB_ID"],
            restarts=int(env.get("SLURM_RESTART_COUNT", "0")),
            rank=int(env.get("SLURM_PROCID", "0")),
            nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"),
            node=env.get("SLURMD_NODENAME", socket.gethostname()),
            cpus=int(env.get("SLURM_CPUS_ON_NODE", "1")),
            gpus=int(env.get("SLURM_GPUS_ON_NODE") or len(visible)),
        )

    def head_file(self, rendezvous: Path) -> Path:
        return rendezvous / f"ray_head_{self.job_id}_{self.restarts}.json"

    def temp_dir(self) -> Path:
        """Ray's files for this node of this job: nothing a later Ray on the host could find, removed at the end."""
        return Path(os.environ.get("TMPDIR", "/tmp")) / f"ray_job_{self.job_id}_{self.rank}"


def wait_for_nodes(nodes: int, timeout_s: float) -> None:
    """Multi-node: the other nodes' `ray start` may still be joining; fail clearly rather than hang in placement."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while (alive := sum(node["Alive"] for node in ray.nodes())) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend.nodes={nodes}, but only {alive} Ray node(s) joined within {timeout_s:.0f} s")
        time.sleep(1.0)


def start_ray(address: str | None, env: dict[str, str], num_cpus: int | None = None) -> None:
    """ray.init: a new local cluster (address None), never one found through /tmp/ray/ray_current_cluster.

    `num_cpus`: the CPUs it counts (None: the machine's; a pool counts more, for the groups it keeps idle).

    The daemons it starts ignore Slurm's USR1/USR2 (inherited SIG_IGN): submitit's time-limit USR2 reaches every
    process of the job, and would kill Ray's GCS and workers before the driver's handler could requeue the job."""
    import logging

    import ray
    from ray._private import ray_constants

    # The driver's SIGTERM is ours (train/signals.py: a run stops, a sweep stops its trials); Ray's failure handler
    # (absl's) chains to it, but printed a crash's stack dump first wherever it stayed installed (a sweep starts Ray
    # in a thread, where sigterm_handler_kept cannot put ours back). Ray's own processes keep theirs.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    with sigterm_handler_kept(), ignored_by_children(), dropped(auth_log, DEFAULT_TOKEN_AUTH), environ(NO_METRICS_SERVER):
        ray.init(
            address=address or "local",
            num_cpus=num_cpus,
            runtime_env={"env_vars": env},
            include_dashboard=False,
            log_to_driver=True,  # worker output reaches the driver, which writes it to workers.log
            configure_logging=False,
        )


NO_METRICS_SERVER = {"DASHBOARD_METRIC_PORT": "-1"}
"""For Ray's daemons: the dashboard process, which Ray starts even with include_dashboard=False (for its usage
stats), serves Prometheus metrics over HTTP on port 44227 of every interface of the node, to anyone who can reach it,
whenever that port is free. Ray has no setting to turn it off; a port it cannot bind does (the dashboard's log says
so once, with the bind's error)."""

NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
"""For `ray start --block` over an allocation: on SIGTERM its node stops at once rather than draining first (up to
30 s, Ray's default, for Serve's replicas to move away). A job's Ray node has nothing to hand over: it is stopped
when its job ends (stop_group) or Slurm ends the job, and a drain only held the node (10 s a node, the grace
stop_group waited on it: a node whose head is gone cannot reach the GCS to drain) before the job's end was
written or its nodes were free for the next job."""


@contextmanager
def environ(variables: Mapping[str, str]) -> Iterator[None]:
    """`variables` in this process's environment while the block runs (what it starts inherits them), then as before."""
    before = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


DEFAULT_TOKEN_AUTH = "Token authentication is enabled for this Ray cluster."
"""Ray's warning, on the terminal of every run that starts a local cluster, that it did what it does by default
(a token of its own for the cluster): nothing for the user to do, so not said (a disabled token still is)."""


@contextmanager
def dropped(logger: "logging.Logger", start: str) -> Iterator[None]:
    """The records of `logger` whose message starts with `start`, dropped while the block runs."""

    def keep(record: "logging.LogRecord") -> bool:
        return not record.getMessage().startswith(start)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def run_on_allocation(driver: Callable[[], T], rendezvous: Path) -> T | None:
    """Run this task's part of the allocation's cluster: the head and the driver on task 0, a Ray node elsewhere.

    Task 0: the Ray head, then `driver()` (its return value returned), which finds the head in RAY_ADDRESS; other tasks:
    a Ray node until the head is gone (None)."""
    allocation = Allocation.from_env()
    ensure_token()
    if allocation.rank == 0:
        with ray_head(allocation, rendezvous):
            return driver()
    ray_node(allocation, rendezvous)
    return None


def ensure_token() -> None:
    """Ensure the job's Ray cluster token is in the environment.

    Ray clusters started by `ray start` take clients with the cluster's token only: one per job, in the environment of
    every task (a launcher sets it before submitting; srun passes it on)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    if not os.environ.get("RAY_AUTH_TOKEN"):
        raise RuntimeError("RAY_AUTH_TOKEN is not set in this job's environment: every task needs the same token")


def new_token() -> str:
    return secrets.token_hex(32)


def node_ip() -> str:
    """This host's address as other hosts reach it (hostname -I when the name maps to loopback)."""
    ip = socket.gethostbyname(socket.gethostname())
    if ip.startswith("127."):
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        ip = next((a for a in found if ":" not in a), ip)
    return ip


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, besides: int | None = None) -> list[int]:
    """`count` distinct free ports, none of them `besides`.

    Every socket is held until all are chosen, as a port closed at once may be handed out again (else a head's node
    manager and object manager can get the same one)."""
    from contextlib import ExitStack

    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            s = held.enter_context(socket.socket())
            s.bind(("", 0))
            if s.getsockname()[1] != besides:
                ports.append(s.getsockname()[1])
    return ports


def ray_start_command(allocation: Allocation, ip: str, head_port: int | None = None, head: str | None = None) -> list[str]:
    """`ray start --block` for this node: the head (head_port) or a node joining `head`.

    CPUs and GPUs from the allocation, free ports for whatever Ray would otherwise put on a fixed port."""
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--log-color=false", f"--node-ip-address={ip}"]
    command += [f"--num-cpus={allocation.cpus}", f"--num-gpus={allocation.gpus}", f"--temp-dir={allocation.temp_dir()}"]
    names = ["node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent"]
    if head is None:
        names.append("ray-client-server")
        command += ["--head", f"--port={head_port}", "--include-dashboard=false"]
    else:
        command += [f"--address={head}"]
    command += [f"--{name}-port={port}" for name, port in zip(names, free_ports(len(names), besides=head_port))]
    return command + ["--min-worker-port=0", "--max-worker-port=0"]  # 0: each worker takes a free port


def answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


STARTED = "Ray runtime started."
"""What `ray start` prints once its node is up (after its raylet registered with the GCS)."""


@contextmanager
def ray_process(command: list[str], allocation: Allocation) -> Iterator[tuple[subprocess.Popen, threading.Event]]:
    """`ray start --block` in a process group of its own, stopped with everything it started on the way out.

    Its output goes on to this task's, and the event is set once it has printed STARTED."""
    with ignored_by_children():  # submitit's time-limit USR2 reaches every process of the job
        process = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace",
                                   env={**os.environ, **NO_METRICS_SERVER, **NO_DRAIN})  # fmt: skip
    started = threading.Event()

    def relay() -> None:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if STARTED in line:
                started.set()

    threading.Thread(target=relay, name="ray-start-output", daemon=True).start()
    try:
        yield process, started
    finally:
        stop_group(process)
        shutil.rmtree(allocation.temp_dir(), ignore_errors=True)


def stop_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the Ray node's process group, SIGKILL what is left after `grace_s`.

    A node whose head is gone cannot drain itself and would wait on the GCS; after a SIGTERM of our own, Slurm's
    KillWait is running."""
    for sig, wait_s in ((signal.SIGTERM, cleanup_wait(grace_s)), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if not group_alive(process.pid):
            return


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@contextmanager
def ray_head(allocation: Allocation, rendezvous: Path) -> Iterator[str]:
    """Task 0: the Ray head, its address left for the other tasks and set as RAY_ADDRESS while inside.

    A head whose `ray start` exits before it has started (its raylet has a fixed 30 s to register with its GCS, which a
    loaded machine misses) starts again on a new port, up to NODE_STARTS starts: nothing has used it yet."""
    ip = node_ip()
    for start in range(1, NODE_STARTS + 1):
        port = free_port()
        address = f"{ip}:{port}"
        print(f"tinker_exp multinode: job {allocation.job_id}, {allocation.nodes} node(s), Ray head {address} on {allocation.node}", flush=True)
        with ray_process(ray_start_command(allocation, ip, head_port=port), allocation) as (process, started):
            deadline = time.monotonic() + HEAD_WAIT_S
            while not (started.is_set() and answers(address)) and process.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head at {address} did not start within {HEAD_WAIT_S:.0f} s")
                time.sleep(0.5) if started.is_set() else started.wait(0.5)  # (started: the GCS may lag its port)
            if process.poll() is not None:
                message = f"the Ray head on {allocation.node} exited ({process.returncode}) before it started"
                if start == NODE_STARTS:
                    raise RuntimeError(message)
                print(f"tinker_exp multinode: {message}; it starts again ({start + 1} of {NODE_STARTS})", flush=True)
                continue
            with head_address_shared(address, allocation, rendezvous):
                yield address
            return


@contextmanager
def head_address_shared(address: str, allocation: Allocation, rendezvous: Path) -> Iterator[None]:
    """The head's address in the rendezvous file for the other tasks, and in RAY_ADDRESS for this one."""
    head_file = allocation.head_file(rendezvous)
    rendezvous.mkdir(parents=True, exist_ok=True)
    tmp = head_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "node": allocation.node}))
    tmp.replace(head_file)  # whole or absent for the readers
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield
    finally:
        head_file.unlink(missing_ok=True)
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous


def ray_node(allocation: Allocation, rendezvous: Path) -> None:
    """Another task: a Ray node that joins the head and runs until the head stops answering.

    A node that exits while the head answers joins again, up to NODE_STARTS starts: `ray start` gives its raylet a fixed
    30 s to register with the head, which a loaded machine misses (the driver is still waiting for the node then)."""
    head_file = allocation.head_file(rendezvous)
    deadline = time.monotonic() + HEAD_WAIT_S
    while not head_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Ray head address in {head_file} within {HEAD_WAIT_S:.0f} s (task 0 did not start it)")
        time.sleep(0.5)
    head = json.loads(head_file.read_text())["address"]
    for start in range(1, NODE_STARTS + 1):
        print(f"tinker_exp multinode: node {allocation.node} joins the Ray head at {head}", flush=True)
        with ray_process(ray_start_command(allocation, node_ip(), head=head), allocation) as (process, _):
            missed = 0
            while process.poll() is None and missed < HEAD_GONE_CHECKS:
                time.sleep(1.0)
                missed = 0 if answers(head) else missed + 1
        if missed >= HEAD_GONE_CHECKS or not answers(head):
            print(f"tinker_exp multinode: node {allocation.node}: the Ray head is gone; this node stopped", flush=True)
            return
        message = f"the Ray node on {allocation.node} exited ({process.returncode}) while the head at {head} runs"
        if start == NODE_STARTS:  # this node keeps dying under a running head: the task fails
            raise RuntimeError(message)
        print(f"tinker_exp multinode: {message}; it joins again ({start + 1} of {NODE_STARTS})", flush=True)
