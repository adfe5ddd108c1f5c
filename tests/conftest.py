import os
import sys
from pathlib import Path

import pytest

from helpers import COSINE_TRUNK, REPO, SLURM_NODES

# Nothing may leave this machine: offline W&B is set in the environment before wandb is imported, so
# this process, its subprocesses and Ray workers all inherit it.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_ERROR_REPORTING"] = "false"
os.environ.pop("WANDB_API_KEY", None)
# Ray's daemons, tuned for a 2-core machine that runs many clusters (each session's, each CLI run's, each Slurm
# job's): idle, a cluster took 4.3 CPU-s a minute, 2.0 with these (its log monitor globbed its log dir 10 times a
# second below 1000 files; prestarted workers and metrics nobody reads). What the tests check is unchanged: a
# worker starts when an actor asks for it, a new log file is read from its start within 0.5 s. Set before any
# process starts, so every ray.init, `ray start` and fork server inherits the same.
os.environ.update(
    RAY_LOG_MONITOR_MANY_FILES_THRESHOLD="0",
    RAY_enable_worker_prestart="0",
    RAY_prestart_worker_first_driver="0",
    RAY_enable_metrics_collection="0",
    RAY_event_stats="0",
    # No cluster of the suite's holds the port of Ray's dashboard metrics server (44227, one a machine; the product
    # turns it off too: runtime/ray_cluster.py NO_METRICS_SERVER), so a pool's test sees it free, as on a user's
    # machine (tests/test_pool.py: the pool's environment lacks this).
    DASHBOARD_METRIC_PORT="-1",
)
# The tiny model is built once and reused across test runs.
os.environ.setdefault("TINKER_EXP_CACHE", str(REPO / ".cache"))
# Runs with backend.pool=auto (the default) look for this user's warm pool here: an empty folder of the session's, so a
# developer's own pool never serves the suite's runs (tests/test_pool.py starts pools of its own). Short: a socket's
# path holds at most 107 bytes.
os.environ["TINKER_EXP_POOL_DIR"] = __import__("tempfile").mkdtemp(prefix="txp-pool-", dir="/tmp")
# ... and the suite's runs and sweeps start cold (backend.pool's default from the environment): their jobs fork from
# a zygote and join the session's Ray cluster, cheaper here than a sweep's own pool with its own cluster. The tests of
# pools (tests/test_pool.py, test_sweeps.py's local Ctrl-C sweep, test_serve.py's kept workers) ask for them.
os.environ["TINKER_EXP_POOL"] = "none"


REAL_FIXTURES = {"ray_address", "slurm_env", "postgres_url", "warm_pool"}
"""A test that uses one of these (directly or through another fixture) starts real work: verl's workers on Ray (the
session's cluster, or this process's warm pool), jobs on the local Slurm cluster, a PostgreSQL server. It is marked
`real`; `make test-fast` (pytest -m "not real") leaves it out. A test that starts real work otherwise (a CLI run with
its own Ray, a server asked for through request.getfixturevalue) carries the marker itself: @pytest.mark.real, or
marks=pytest.mark.real on its param."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real: starts real work (verl's workers on Ray, the local Slurm cluster, PostgreSQL); `make test-fast` skips it"
    )
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist: the one terminal
        config.pluginmanager.register(LiveReport(config), "live_report")
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):  # the controller
        import tempfile

        groups_dir = tempfile.mkdtemp(prefix="tinker_exp-test-groups-")
        os.environ[GROUPS_FILE_ENV] = str(Path(groups_dir) / "groups.json")  # inherited by the workers it starts
    fast = config.getoption("markexpr", "") == "not real"  # `make test-fast`: no ray.init in the workers
    if fast and config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):  # the xdist controller
        from helpers import ZYGOTE_FOLDER_ENV, CliZygote

        # One for both workers: its imports (~9 CPU-s) once. Not with real tests: the environment a worker's ray.init
        # sets (Ray's auth, read once a process at `import ray`) must be there when its zygote starts, or the runs
        # that join its cluster go fresh.
        config._cli_zygote = CliZygote.start()
        os.environ[ZYGOTE_FOLDER_ENV] = str(config._cli_zygote.folder)


def pytest_collection_finish(session):
    """Where this process will start real work on a CPU build of torch, Ray's workers fork from a server that has
    imported what they import (tests/zygotes.py): every process started from here on inherits the environment that
    sends them there. The local sweep jobs' server starts with the session's Ray cluster (ray_address)."""
    import importlib.metadata

    if "+cpu" in importlib.metadata.version("torch") and any(item.get_closest_marker("real") for item in session.items):
        start_zygote(session.config, "ray_worker")
    on_the_pool = [item for item in session.items if "warm_pool" in getattr(item, "fixturenames", ())]
    session.config._last_on_the_pool = on_the_pool[-1].nodeid if on_the_pool else None


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The warm pool ends as soon as the last test that trains on it has run (they run together, on one worker: the
    warm pool's group), not at the session's end: idle, its Ray daemons take about 2 CPU-s a minute and each of its
    workers 0.6, CPU the tests after them would otherwise share."""
    yield
    if item.nodeid == getattr(item.config, "_last_on_the_pool", None):
        down = getattr(item.config, "_warm_pool_down", None)
        if down is not None:
            down()


def start_zygote(config, kind: str) -> None:
    """A fork server of tests/zygotes.py, with this process's environment as it is now; what this process starts
    from here on goes to it."""
    import tempfile

    import zygotes

    path = str(Path(tempfile.mkdtemp(prefix="tinker_exp-zygote-")) / kind)
    config._zygotes = [*getattr(config, "_zygotes", []), zygotes.start(kind, path, dict(os.environ))]
    os.environ.update(zygotes.session_env({kind: path}))


def pytest_unconfigure(config):
    import shutil
    import subprocess

    for zygote in getattr(config, "_zygotes", []):  # each ends when its stdin closes (what it started goes on)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
        shutil.rmtree(Path(zygote.args[-1]).parent, ignore_errors=True)
    if hasattr(config, "_cli_zygote"):
        from helpers import ZYGOTE_FOLDER_ENV

        config._cli_zygote.stop()
        os.environ.pop(ZYGOTE_FOLDER_ENV, None)
    if not hasattr(config, "workerinput") and GROUPS_FILE_ENV in os.environ:
        shutil.rmtree(Path(os.environ.pop(GROUPS_FILE_ENV)).parent, ignore_errors=True)


SLURM_GROUP = "slurm"
WARM_GROUP = "warm_pool"
GROUPS_FILE_ENV = "TINKER_EXP_TEST_GROUPS"
"""`make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`), each group of tests whole on one of them:
every test that uses the local Slurm cluster in one group, so Slurm tests never overlap (they share 2 nodes, and some
assert what the queue holds); the other tests of every file that trains on the warm pool in one group, so that one
pool serves them (a pool trains one run at a time: a second worker's run would start cold); every other test in its
file's group, so a module fixture is built once. xdist's own
loadgroup (xdist_group marks) does not group under pytest 9.2 (nodeids are no longer xdist's to suffix): the workers
write each test's group to this file (its path from the controller, in the environment) and `GroupScheduling`
reads it."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import json

    groups = {}
    on_the_pool = {item.path for item in items if "warm_pool" in getattr(item, "fixturenames", ())}
    for item in items:
        names = getattr(item, "fixturenames", ())
        if REAL_FIXTURES.intersection(names):
            item.add_marker(pytest.mark.real)
        groups[item] = SLURM_GROUP if "slurm_env" in names else WARM_GROUP if item.path in on_the_pool else item.path.name
    # Longest first, so that the two workers end together (`--no-loadscope-reorder` keeps this order): the Slurm
    # group, then the files that hold real work (those on the warm pool first, together: its pool ends after their
    # last test), then the rest. Stable: a file's tests stay together and in order.
    real_groups = {groups[item] for item in items if item.get_closest_marker("real")}
    items.sort(key=lambda item: (groups[item] != SLURM_GROUP, groups[item] not in real_groups, groups[item] != WARM_GROUP))
    if hasattr(config, "workerinput") and GROUPS_FILE_ENV in os.environ:  # both workers write the same: atomically
        path = Path(os.environ[GROUPS_FILE_ENV])
        written = path.with_name(f"{path.name}.{config.workerinput['workerid']}")
        written.write_text(json.dumps({item.nodeid: groups[item] for item in items}))
        written.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: xdist's scope scheduling over the groups the workers wrote (GROUPS_FILE_ENV)."""
    if config.getoption("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:  # first called once every worker has collected
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
            return self.groups[nodeid]

    return GroupScheduling(config, log)


def once_across_workers(tmp_path_factory, name: str, make):
    """`make()`'s result (JSON), made by whichever xdist worker asks first and read by the other: a session fixture
    is per worker, and this one's real work is worth sharing. Without xdist: simply `make()`."""
    import json

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # this run's, common to its workers
    done = shared / f"{name}.json"
    with FileLock(shared / f"{name}.lock"):
        if not done.exists():
            done.write_text(json.dumps(make()))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def ray_address(pytestconfig):
    """One Ray cluster for every test that trains: in-process runs join it, CLI runs get RAY_ADDRESS. Once it is up
    (ray.init sets variables the jobs inherit: RAY_AUTH_MODE, ...), the local sweep jobs fork from a server that has
    imported what their drivers import (tests/zygotes.py), where Ray's workers do."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    if getattr(pytestconfig, "_zygotes", None):
        start_zygote(pytestconfig, "job")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def warm_pool(pytestconfig):
    """This test process's warm pool (`python -m tinker_exp.pool up`, the product's, in a folder of its own), up from
    the first test that asks until the last one has run (pytest_runtest_teardown): the environment a CLI run needs
    to train on it as a user's run does with a pool up (backend.pool=auto, the default; no RAY_ADDRESS: a pool runs
    its own Ray cluster). The suite's real CLI runs that claim nothing of a cold start train here, each a lease of
    the pool's kept groups (a group a key, built at the key's first run) or, for LoRA SFT, a slot of one; a warm run
    is its cold run, bitwise (tests/test_pool.py checks that against cold runs, and keeps the cold path's own tests
    cold)."""
    import shutil
    import tempfile

    from helpers import run_module

    folder = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp"))  # short: a socket's path holds at most 107 bytes
    env = {"TINKER_EXP_POOL_DIR": str(folder), "TINKER_EXP_POOL": "auto", "RAY_ADDRESS": None}
    # Idle for as long as a loaded suite could leave it; a group for every key the runs on it use (full fine-tuning on
    # 1 and 2 workers, RL, LoRA's slots), so that none is built twice.
    up = run_module("tinker_exp.pool", "up", "--idle-min", "120", "--max-groups", "6", env=env, timeout=600)
    if up.returncode != 0 or "pool up at" not in up.stdout:
        log = folder / "pool.log"
        pytest.fail(f"the suite's warm pool did not start:\n{up.stdout[-2000:]}{up.stderr[-3000:]}{log.read_text()[-3000:] if log.exists() else ''}")

    def down() -> None:
        if folder.exists():
            run_module("tinker_exp.pool", "down", env=env, timeout=120)
            shutil.rmtree(folder, ignore_errors=True)

    pytestconfig._warm_pool_down = down
    yield env
    down()


@pytest.fixture(scope="session")
def slurm_env():
    """The local Slurm cluster of SLURM_NODES nodes (launchers/local_slurm/up.sh: idempotent), as client env vars.
    Every Slurm test runs on it: single-node jobs take one node, multi-node ones span them.

    A cluster that does not come up fails these tests, in `make test` as in CI: skips are for a missing GPU only.
    """
    import subprocess

    up = subprocess.run(
        ["bash", str(REPO / "launchers" / "local_slurm" / "up.sh"), str(SLURM_NODES)], capture_output=True, text=True, timeout=600
    )
    if up.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not start (up.sh exit {up.returncode}):\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    env_file = up.stdout.strip().splitlines()[-1]  # up.sh prints `export SLURM_CONF=...` last
    key, _, value = env_file.removeprefix("export ").partition("=")
    env = {key: value, "RAY_ADDRESS": None}  # a sweep job starts its own Ray in its allocation
    from helpers import cancel_leftover_jobs

    cancel_leftover_jobs(env)  # the tests assert what the queue holds: jobs a cluster kept across restarts go first
    return env


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A real PostgreSQL server on this machine (launchers/local_postgres/up.sh: idempotent): its storage URL.
    A server that does not come up fails these tests, as the Slurm cluster does. Started by one xdist worker only
    (two up.sh at once would race to create the cluster)."""
    import subprocess

    def start() -> str:
        up = subprocess.run(["bash", str(REPO / "launchers" / "local_postgres" / "up.sh")], capture_output=True, text=True, timeout=600)
        if up.returncode != 0:
            pytest.fail(f"the local PostgreSQL server did not start (up.sh exit {up.returncode}):\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
        return up.stdout.strip().splitlines()[-1]

    return once_across_workers(tmp_path_factory, "postgres_url", start)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report kept on its test (`item.reports[phase]`), for the fixtures' teardown to read."""
    report = yield
    item.reports = {**getattr(item, "reports", {}), report.when: report}
    return report


@pytest.fixture(autouse=True)
def slurm_queue_emptied(request):
    """After a test on the local Slurm cluster: what it left in the queue (a failed test's jobs) is cancelled and the
    nodes are waited for, so that one failure does not starve the next tests of nodes; a failed test prints the
    cluster's state and its jobs' logs (helpers.slurm_state)."""
    if "slurm_env" not in request.fixturenames:
        yield
        return
    from helpers import cancel_leftover_jobs, slurm_state

    slurm_env = request.getfixturevalue("slurm_env")
    tmp_path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if any(report.failed for report in getattr(request.node, "reports", {}).values()):
        print(slurm_state(slurm_env, tmp_path))
    cancel_leftover_jobs(slurm_env)


@pytest.fixture(autouse=True)
def close_figures():
    """Figures drawn to be read back as data (draw_report, draw_plan) are closed after each test that drew any."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(scope="session")
def cosine_trunk(ray_address, tmp_path_factory):
    """One real CLI run through the shared Ray cluster (RAY_ADDRESS), read by several tests, never written to:
    (its run dir, the finished process). It is test_branch_ray's trunk, test_resume's uninterrupted run and
    checkpoints (copied before use), test_train_e2e's CLI run with a quiet terminal, and the one-node run
    test_sweeps' multinode recipe is compared with."""
    import subprocess

    from helpers import run_cli

    def train() -> dict:
        run_dir = tmp_path_factory.mktemp("cosine_trunk")
        result = run_cli(*COSINE_TRUNK, f"hydra.run.dir={run_dir}", env={"RAY_ADDRESS": ray_address})
        return {"run_dir": str(run_dir), "args": result.args, "returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}

    run = once_across_workers(tmp_path_factory, "cosine_trunk", train)  # one run for both xdist workers
    result = subprocess.CompletedProcess(run["args"], run["returncode"], run["stdout"], run["stderr"])
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(run["run_dir"]), result



class LiveReport:
    """On the one terminal (xdist's controller, or a run without xdist), as they happen: each failure in a line, and
    each test still running after SLOW_S (again at each multiple). A CI run killed at its time limit prints no summary;
    these lines are then all that says which tests failed and where its time went."""

    SLOW_S = 300

    def __init__(self, config):
        import threading

        self.config = config
        self.running: dict[str, float] = {}
        self.stopped = threading.Event()
        threading.Thread(target=self._name_slow_tests, daemon=True, name="slow-tests").start()

    def _write(self, line: str, **markup) -> None:
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(line, flush=True, **markup)

    def pytest_runtest_logstart(self, nodeid, location):
        import time

        self.running[nodeid] = time.monotonic()

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            self.running.pop(report.nodeid, None)
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            why = crash.message.splitlines()[0][:300] if crash is not None and crash.message else ""
            self._write(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s): {why}", red=True)

    def pytest_unconfigure(self, config):
        self.stopped.set()

    def _name_slow_tests(self) -> None:
        import time

        named: dict[str, int] = {}
        while not self.stopped.wait(10):
            for nodeid, since in list(self.running.items()):
                multiple = int((time.monotonic() - since) // self.SLOW_S)
                if multiple > named.get(nodeid, 0):
                    named[nodeid] = multiple
                    self._write(f"\nstill running after {multiple * self.SLOW_S} s: {nodeid}", yellow=True)
