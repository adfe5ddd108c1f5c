import os

import pytest

from helpers import REPO

# Nothing may leave this machine: offline W&B is set in the environment before wandb is imported, so
# this process, its subprocesses and Ray workers all inherit it.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_ERROR_REPORTING"] = "false"
os.environ.pop("WANDB_API_KEY", None)
# The tiny model is built once and reused across test runs.
os.environ.setdefault("TINKER_EXP_CACHE", str(REPO / ".cache"))


@pytest.fixture(scope="session")
def ray_address():
    """One Ray cluster for every test that trains: in-process runs join it, CLI runs get RAY_ADDRESS."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
