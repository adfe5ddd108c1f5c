import os
import sys

import pytest

from helpers import COSINE_TRUNK, REPO, SLURM_NODES

# Nothing may leave this machine: offline W&B is set in the environment before wandb is imported, so
# this process, its subprocesses and Ray workers all inherit it.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_ERROR_REPORTING"] = "false"
os.environ.pop("WANDB_API_KEY", None)
# The tiny model is built once and reused across test runs.
os.environ.setdefault("TINKER_EXP_CACHE", str(REPO / ".cache"))


REAL_FIXTURES = {"ray_address", "slurm_env", "postgres_url"}
"""A test that uses one of these (directly or through another fixture) starts real work: verl's workers on Ray, jobs
on the local Slurm cluster, a PostgreSQL server. It is marked `real`; `make test-fast` (pytest -m "not real") leaves
it out. A test that starts real work otherwise (a CLI run with its own Ray, a server asked for through
request.getfixturevalue) carries the marker itself: @pytest.mark.real, or marks=pytest.mark.real on its param."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real: starts real work (verl's workers on Ray, the local Slurm cluster, PostgreSQL); `make test-fast` skips it"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def ray_address():
    """One Ray cluster for every test that trains: in-process runs join it, CLI runs get RAY_ADDRESS."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


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
    return {key: value, "RAY_ADDRESS": None}  # a sweep job starts its own Ray in its allocation


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server on this machine (launchers/local_postgres/up.sh: idempotent): its storage URL.
    A server that does not come up fails these tests, as the Slurm cluster does."""
    import subprocess

    up = subprocess.run(["bash", str(REPO / "launchers" / "local_postgres" / "up.sh")], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        pytest.fail(f"the local PostgreSQL server did not start (up.sh exit {up.returncode}):\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    return up.stdout.strip().splitlines()[-1]


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
    from helpers import run_cli

    run_dir = tmp_path_factory.mktemp("cosine_trunk")
    result = run_cli(*COSINE_TRUNK, f"hydra.run.dir={run_dir}", env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result
