"""Warm workers (tinker_exp/pool/): one real pool of verl workers on Ray for the module, and real CLI runs on it
compared bitwise with cold runs of the same commands (every metrics.jsonl value but timings): SFT, LoRA, RL (after a
warm run SIGKILLed mid-run), resume and a branch; a run killed mid-step, then a good run; a client killed right after
handing its run over; a second run beside a busy pool; a user's reward file edited between runs; refusals the pool
checks; kept groups; Ray's dashboard off; a local sweep's jobs on the sweep's own pool, a seed change there. Without
workers: a pool planted by another user gets nothing; what a run sends; a pool process's lease timeout, one process
an address and a down while it starts; a run dir a pool still writes into."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import (
    COSINE_TRUNK,
    REPO,
    assert_adapters_close,
    assert_rows_close,
    environment,
    metrics_rows,
    run_cli,
    run_module,
    run_warm,
    start_cli,
    wait_until,
    wandb_finished_records,
    wandb_history,
    wandb_run_record,
    without_timings,
)
from tinker_exp.config.rl import RLConfig

NOBODY = 65534
"""Another local user (this machine's `nobody`): the planted pool's."""
as_root = pytest.mark.skipif(os.getuid() != 0, reason="planting another user's folder and process needs root")

@pytest.fixture(scope="module")
def pool(ray_address, tmp_path_factory):
    """A pool of this module's (`pool up`, in a folder of its own), and the environment its runs need to find it.
    Its own Ray cluster: never the session's (no RAY_ADDRESS)."""

    folder = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp"))
    # DASHBOARD_METRIC_PORT as a user's environment has it (unset): the pool's Ray turns off what listens there
    env = {"TINKER_EXP_POOL_DIR": str(folder), "TINKER_EXP_POOL": "auto", "RAY_ADDRESS": None, "DASHBOARD_METRIC_PORT": None}
    up = run_module("tinker_exp.pool", "up", "--idle-min", "15", "--max-groups", "3", env=env, timeout=400)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:] + (folder / "pool.log").read_text()[-3000:]
    try:
        assert "pool up at" in up.stdout and "2 x TinkerTrainingWorker on cpu" in up.stdout
        # the pool's own lines only: no library's info (verl's "Platform override from VERL_PLATFORM: cpu")
        assert [line for line in up.stderr.splitlines() if not line.startswith(("pool: ", "workers: "))] == [], up.stderr
    except AssertionError:
        run_module("tinker_exp.pool", "down", env=env, timeout=120)  # a pool that came up is not left behind
        raise
    yield env
    down = run_module("tinker_exp.pool", "down", env=env, timeout=120)
    assert "pool down" in down.stdout, down.stdout + down.stderr
    from tinker_exp.place import wire

    pid = int(re.search(r"pool down \(pid (\d+)\)", down.stdout).group(1))
    wait_until(lambda: not wire.alive(pid), 120, "the pool's process never ended")
    said = (folder / "pool.log").read_text()
    # runs on its slots used W&B (test_lora_runs_at_once...): its service ends before the pool ends its children,
    # not in an exit hook that finds it gone (a traceback at every `pool down`)
    assert "Traceback" not in said and "Exception ignored" not in said, said[-3000:]
    shutil.rmtree(folder, ignore_errors=True)


def cold(ray_address: str, *args: str) -> subprocess.CompletedProcess:
    result = run_cli(*args, "backend.pool=none", env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm workers" not in result.stdout
    return result


LONG_RUN = ["trainer.steps=2000", "checkpoint.every_steps=0", "checkpoint.at_end=false", "logger=none"]
"""A run that trains for minutes (0.1-0.3 s a step here) unless it is stopped."""


def kill_a_warm_run_mid_run(pool: dict, run_dir: Path) -> None:
    """A warm run of LONG_RUN, SIGKILLed once it has logged 2 steps."""
    killed = start_cli(*LONG_RUN, f"hydra.run.dir={run_dir}", env=pool)
    try:
        wait_until(lambda: len(metrics_rows(run_dir)) >= 2, 300, "the warm run never logged 2 steps", killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        killed.kill()


def test_a_killed_run_leaves_the_pool_usable_a_second_run_trains_cold_or_is_refused_and_a_warm_run_is_the_cold_run(pool, cosine_trunk, tmp_path):
    """While a run holds the pool, a second one with backend.pool=auto trains cold (one line says so), and one that
    names the pool's address is refused (one line, exit 2, nothing written)."""
    long_run = start_cli("trainer.steps=400", "checkpoint.every_steps=0", f"hydra.run.dir={tmp_path / 'killed'}", env=pool)
    try:
        wait_until(lambda: len(metrics_rows(tmp_path / "killed")) >= 3, 240, "the warm run never logged 3 steps", long_run)
        address = f"backend.pool={pool['TINKER_EXP_POOL_DIR']}/pool.sock"
        refused = run_cli("trainer.steps=2", address, f"hydra.run.dir={tmp_path / 'refused'}", env=pool)
        status = run_module("tinker_exp.pool", "status", env=pool)
        beside = ["trainer.steps=1", "backend.num_workers=1", "logger=none", "checkpoint.at_end=false", "checkpoint.every_steps=0"]
        cold_beside = run_cli(*beside, f"hydra.run.dir={tmp_path / 'beside'}", env=pool)
        long_run.send_signal(signal.SIGKILL)  # mid-run: between two steps or inside one
        long_run.wait(timeout=30)
    finally:
        long_run.kill()
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"tinker_exp: pool busy: {address}: the pool at") and "one run at a time" in line
    assert f"({tmp_path / 'killed'}, pid {long_run.pid}," in line  # the busy run named by its run dir
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    assert cold_beside.returncode == 0, cold_beside.stderr[-3000:]
    assert f"pool: busy with {tmp_path / 'killed'} (pid {long_run.pid}, since" in cold_beside.stdout and "starting cold" in cold_beside.stdout
    assert "pool: training on" not in cold_beside.stdout and len(metrics_rows(tmp_path / "beside")) == 1
    assert "now running a run since" in status.stdout and "trainer.steps=400" in status.stdout

    # The next run waits for the killed one to end, then trains exactly as the suite's cold run of its command.
    run_dir = tmp_path / "after"
    run_warm(pool, *COSINE_TRUNK, f"hydra.run.dir={run_dir}")
    assert without_timings(metrics_rows(run_dir)) == without_timings(metrics_rows(cosine_trunk[0]))
    status = run_module("tinker_exp.pool", "status", env=pool)
    assert "runs served: 2" in status.stdout and "now idle" in status.stdout


def test_resume_and_a_branch_on_the_pool_are_bitwise_cold_ones(pool, cosine_trunk, ray_address, tmp_path):
    trunk = cosine_trunk[0]
    resumed = tmp_path / "resumed"
    shutil.copytree(trunk, resumed)
    for step in (8, 12):  # as if it had been stopped after its step-4 checkpoint
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    result = run_warm(pool, *COSINE_TRUNK, f"hydra.run.dir={resumed}")
    assert "at step 4" in result.stdout
    assert without_timings(metrics_rows(resumed)) == without_timings(metrics_rows(trunk))

    branch = ["+override=lr_wsd", "trainer.steps=7", f"branch.from={trunk}", "branch.step=4"]
    cold(ray_address, *branch, f"hydra.run.dir={tmp_path / 'cold_branch'}")
    run_warm(pool, *branch, f"hydra.run.dir={tmp_path / 'warm_branch'}")
    cold_rows, warm_rows = (without_timings(metrics_rows(tmp_path / name)) for name in ("cold_branch", "warm_branch"))
    assert [row["train/step"] for row in warm_rows] == [4, 5, 6] and warm_rows == cold_rows


def test_a_worker_that_died_is_replaced_and_the_next_run_is_the_cold_run(pool, cosine_trunk, tmp_path):
    status = run_module("tinker_exp.pool", "status", env=pool).stdout
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", status.split("memory (resident", 1)[1])]
    assert len(pids) >= 2, status
    pids = pids[:2]  # the default SFT group's (the most recently used: listed first)
    os.kill(pids[1], signal.SIGKILL)  # a rank lost (out of memory, say) between two runs
    result = run_warm(pool, *COSINE_TRUNK, f"hydra.run.dir={tmp_path}")
    assert "pool: a worker had died" in result.stdout and "building the group again" in result.stdout
    assert without_timings(metrics_rows(tmp_path)) == without_timings(metrics_rows(cosine_trunk[0]))
    assert str(pids[1]) not in run_module("tinker_exp.pool", "status", env=pool).stdout


LORA = ["lora=r8", "logger=none", "trainer.steps=3"]
"""A LoRA run of rank 8: a group of its own."""


@pytest.fixture(scope="module")
def cold_lora(ray_address, tmp_path_factory) -> Path:
    """The cold run of LORA (the seed's default, 0): what its warm runs and a sweep's first point on a pool must be."""
    run_dir = tmp_path_factory.mktemp("cold_lora")
    cold(ray_address, *LORA, f"hydra.run.dir={run_dir}")
    return run_dir


@pytest.mark.parametrize("command", [LORA, ["env=digits", "loss=importance_sampling", "trainer.steps=2"]], ids=["lora", "rl"])
def test_lora_and_rl_on_the_pool_are_bitwise_cold_runs(pool, ray_address, tmp_path, command, request):
    """Each builds a group of its own beside the default one, and trains exactly as its cold run, twice (the second
    time on the kept group: from fresh state, or on a new slot, LoRA SFT runs taking slots of their group). The RL
    run comes right after a warm SFT run SIGKILLed between its steps (or inside one): it waits for that run's end
    first."""
    if command == LORA:
        cold_dir = request.getfixturevalue("cold_lora")
    else:
        cold_dir = tmp_path / "cold"
        cold(ray_address, *command, f"hydra.run.dir={cold_dir}")
        kill_a_warm_run_mid_run(pool, tmp_path / "killed")
    first = run_warm(pool, *command, f"hydra.run.dir={tmp_path / 'warm'}")
    again = run_warm(pool, *command, f"hydra.run.dir={tmp_path / 'again'}")  # the kept group, fresh state
    trains = "pool: slot 1 of 4 on the pool at " if command == LORA else "pool: training on the workers just built on"
    said = ("pool: no kept group fits this run", "pool: group built in", trains)
    assert all(line in first.stdout for line in said), first.stdout[-3000:]
    assert sorted(said, key=first.stdout.index) == list(said)  # what happened, in order
    kept = "a kept group (built" if command == LORA else "pool: training on the warm workers of"
    assert kept in again.stdout and "group built" not in again.stdout
    rows = without_timings(metrics_rows(cold_dir))
    assert len(rows) == int(command[-1].split("=")[1])
    assert without_timings(metrics_rows(tmp_path / "warm")) == rows == without_timings(metrics_rows(tmp_path / "again"))
    if command == LORA:
        adapter = "adapter/adapter_model.safetensors"
        assert (tmp_path / "warm" / adapter).read_bytes() == (cold_dir / adapter).read_bytes()


def test_a_warm_run_uses_the_reward_file_as_it_is_now_and_checks_its_inputs_once(pool, tmp_path):
    """The user's reward, imported from the client's folder at each run: edited between two warm runs (0.0 -> 1.0),
    the second run's reward is the new one (the RL group of the test above is kept: no new build). Its inputs are
    checked once, by the client: the reward is tried there on every prompt row, and the pool calls it only on the
    responses it samples (training and the evaluation after the last step)."""
    rl = ["env=digits", "loss=importance_sampling", "trainer.steps=1", "logger=none", "env.reward=my_pool_reward:reward"]
    prompts = {name: sum(1 for line in (REPO / f"tinker_exp/assets/digits_{name}.jsonl").read_text().splitlines() if line.strip())
               for name in ("train", "eval")}  # fmt: skip
    group = RLConfig()
    sampled = group.responses_per_step * 1 + prompts["eval"] * group.group_size
    rewards = []
    for value in (0.0, 1.0):
        calls = tmp_path / f"calls_{value}.txt"
        (tmp_path / "my_pool_reward.py").write_text(
            f"import os\ndef reward(row, response):\n    with open({str(calls)!r}, 'a') as f:\n"
            f"        f.write(f'{{os.getpid()}} {{response == \"\"}}\\n')\n    return {value}\n"
        )
        run_dir = tmp_path / f"run_{value}"
        result = run_cli(*rl, f"hydra.run.dir={run_dir}", env=pool, cwd=tmp_path)
        assert result.returncode == 0 and "pool: training on the warm workers of" in result.stdout, result.stderr[-3000:]
        rewards.append(metrics_rows(run_dir)[0]["train/reward"])
        pool_pid = re.search(r"^pool at \S+: pid (\d+),", run_module("tinker_exp.pool", "status", env=pool).stdout, re.M)[1]
        by_pid: dict[str, list[str]] = {}
        for line in calls.read_text().splitlines():
            pid, empty = line.split()
            by_pid.setdefault(pid, []).append(empty)
        assert len(by_pid.pop(pool_pid)) == sampled
        assert [len(called) for called in by_pid.values()] == [prompts["train"] + prompts["eval"]]  # the client's check
        assert set(*by_pid.values()) == {"True"}  # each with an empty response
    assert rewards == [0.0, 1.0]


def pool_status(pool: dict) -> dict:
    from tinker_exp.place import wire

    return wire.ask(Path(pool["TINKER_EXP_POOL_DIR"]) / "pool.sock", ("status",))


def pool_tree(pid: int) -> list[int]:
    from tinker_exp.pool.host import descendant_pids

    return [pid, *descendant_pids(pid)]


KILLED_AFTER_SENDING = """
import os, runpy, signal
from tinker_exp.place import lease
sent = lease.Lease.train_run


def train_run(self, *args, **kwargs):  # its check answered and its record written: dies as soon as its run is sent
    self.follow = lambda: os.kill(os.getpid(), signal.SIGKILL)
    return sent(self, *args, **kwargs)


lease.Lease.train_run = train_run
runpy.run_module("tinker_exp", run_name="__main__", alter_sys=True)
"""
"""The real CLI (its run dir's lock, its record, its lease, its run sent), SIGKILLed right after `Lease.train_run`
sent the run: before anything comes back, before the pool marks the run dir's lock as its own."""


def test_a_client_killed_right_after_sending_its_run_leaves_the_pool_free_and_the_next_run_served(pool, cosine_trunk, tmp_path):
    """The pool sees the connection go while it takes the run up (queued, or starting it): the run is ended before
    it trains (or stopped as on SIGTERM), the lease is freed, nothing writes into the run dir any more (a rerun may
    take it at once), and the next run trains exactly as the cold run of its command."""
    from tinker_exp.train.rundir_lock import RunDirLock

    killed_dir = tmp_path / "killed"
    client = subprocess.run([sys.executable, "-c", KILLED_AFTER_SENDING, *LONG_RUN, f"hydra.run.dir={killed_dir}"], cwd=REPO,
                            env=environment(pool), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert client.returncode == -signal.SIGKILL, client.stderr[-3000:]
    assert (killed_dir / "tinker_exp.log").exists()  # its record written (the check passed) before its run was sent
    # 2000 steps take minutes: the pool is free well before unless the killed client's run went on training.
    wait_until(lambda: pool_status(pool)["holder"] is None, 120, "the pool still lends its workers to the killed client")
    assert len(metrics_rows(killed_dir)) < 2000
    with RunDirLock(killed_dir):  # no one writes there any more: a rerun takes the dir at once
        pass

    run_dir = tmp_path / "next"
    run_warm(pool, *COSINE_TRUNK, f"hydra.run.dir={run_dir}")
    assert without_timings(metrics_rows(run_dir)) == without_timings(metrics_rows(cosine_trunk[0]))


DASHBOARD_PORT = 8265
"""Ray's dashboard (its HTTP server and job-submission API) listens here when it runs."""


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports that these processes listen on (Linux's /proc: their sockets' inodes in /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = fd.readlink().name
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def test_the_pools_ray_runs_no_dashboard(pool):
    """Ray's dashboard (a job-submission API any local user can reach) is off: no process of the pool's tree listens
    on its port, and Ray's dashboard process, which include_dashboard=False still starts (its usage stats only,
    `--modules-to-load=UsageStatsHead`), listens on nothing: not even its Prometheus metrics server, which it opens on
    port 44227 of every interface whenever that port is free (no Ray of the suite's holds it: conftest.py); the check
    sees the ports the pool's Ray does listen on."""
    tree = pool_tree(pool_status(pool)["pid"])
    commands = {pid: command_line(pid) for pid in tree}
    assert any("raylet" in command for command in commands.values()), commands
    ports = listening_ports(tree)
    assert ports and DASHBOARD_PORT not in ports, ports
    for pid, command in commands.items():
        if "dashboard/dashboard.py" in command:
            assert "--modules-to-load=UsageStatsHead" in command and listening_ports([pid]) == set(), command


POOL_CHECKS = ("a GPU-only setting on cpu", "a LoRA target the model lacks", "a row too long")
"""The refusals of test_cli_errors.refused_on_the_run_path that a warm pool's check makes (assemble.inputs, in the
pool's process)."""


def test_a_command_refused_by_the_pool_writes_nothing_anywhere(pool, tmp_path):
    """With the pool up (backend.pool=auto finds it), the refusals that the pool checks (the device, the model, its
    LoRA targets, the data as tokenized) come before the run's record, as a cold run's: exit 2, one line, nothing made
    below the folder; and the pool is free again after each, with no run served and no group built."""
    from test_cli_errors import refused_on_the_run_path

    given, cwd = tmp_path / "given", tmp_path / "cwd"
    given.mkdir(), cwd.mkdir()
    refusals = {**{what: refused_on_the_run_path(given)[what] for what in POOL_CHECKS},
                "a device this machine lacks": (["backend.device=cuda"], "config error: backend.device=cuda: torch ")}  # fmt: skip
    def served(status: dict) -> tuple:  # its runs and groups (each group's live memory left out: it moves by itself)
        return status["runs"], [(g["group"], g["built_at"], g["runs"], g["pids"]) for g in status["groups"]]

    before = served(pool_status(pool))
    for what, (args, line) in refusals.items():
        result = run_cli(*args, "logger=wandb", cwd=cwd, env=pool)
        assert result.returncode == 2, (what, result.stderr[-3000:])
        (said,) = result.stderr.splitlines()
        assert said.startswith(f"tinker_exp: {line}"), (what, said)
        assert "Traceback" not in result.stdout + result.stderr, what
        assert sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")) == [], what
        wait_until(lambda: pool_status(pool)["holder"] is None, 60, f"{what}: the pool is still held")
        status = pool_status(pool)
        assert served(status) == before, (what, status)  # refused before any worker


def kept_groups(pool: dict) -> list[tuple[str, str, str]]:
    """`pool status`'s kept groups, the most recently used first: (what it trains, when it was built, its pids)."""
    status = run_module("tinker_exp.pool", "status", env=pool).stdout
    return re.findall(r"^    \d+\. (.*); built (\S+) .*; workers' pids ([\d, ]+)$", status, re.MULTILINE)


def test_a_then_b_then_a_trains_a_on_its_kept_group_without_a_rebuild(pool, cosine_trunk, tmp_path):
    """A (the default full fine-tuning group, built by `up`), B (LoRA rank 8: a group of its own, kept beside A's),
    then A again: A's group, not rebuilt. Told by the run's lines (a kept group; no `group built`), by `pool status`
    (A's group has the same worker pids and build time as before B, and is now the most recently used), and by its
    rows: bitwise the cold run of its command."""
    before = {what: (built, pids) for what, built, pids in kept_groups(pool)}
    full = next(what for what in before if "TinkerTrainingWorker" in what and "full fine-tuning" in what)
    b = run_warm(pool, "lora=r8", "trainer.steps=1", "logger=none", "checkpoint.at_end=false", f"hydra.run.dir={tmp_path / 'b'}")
    assert "LoRA rank 8" in kept_groups(pool)[0][0], b.stdout
    a = run_warm(pool, *COSINE_TRUNK, f"hydra.run.dir={tmp_path / 'a'}")
    assert "pool: training on the warm workers of" in a.stdout and "a kept group" in a.stdout
    assert "group built" not in a.stdout and "no kept group fits" not in a.stdout and "freed a group" not in a.stdout
    after = kept_groups(pool)
    assert after[0][0] == full and (after[0][1], after[0][2]) == before[full]
    assert any("LoRA rank 8" in what for what, _, _ in after[1:])  # B's group still kept
    assert without_timings(metrics_rows(tmp_path / "a")) == without_timings(metrics_rows(cosine_trunk[0]))
    # `up` on this pool (A's group kept: nothing built) with another slot count says it is not applied, not silently
    again = run_module("tinker_exp.pool", "up", "--slots", "8", env=pool)
    assert again.returncode == 0 and "pool already up at" in again.stdout, again.stdout + again.stderr
    assert ("pool: --slots 8 not applied: a pool's slots are set when it starts (it has 4); python -m tinker_exp.pool "
            "down, then up --slots 8") in again.stdout.splitlines(), again.stdout  # fmt: skip


def test_a_sweep_job_tries_first_the_free_pool_that_keeps_its_group(pool, monkeypatch):
    """A sweep's pools, as its job ranks them (client.best_first): the module's pool (it keeps the default group and
    a LoRA rank 8 one) and a pool that keeps none. A job of a kept shape tries the module's pool first; a job of a
    shape neither keeps (LoRA rank 32) tries the empty pool first, so the module's groups stay as they are; a pool
    that does not answer comes last."""
    from tinker_exp.place import wire
    from tinker_exp.pool.__main__ import checked_config
    from tinker_exp.place.lease import best_first
    from tinker_exp.place.pools import end, start_host

    monkeypatch.setenv("TINKER_EXP_POOL_DIR", pool["TINKER_EXP_POOL_DIR"])
    kept = wire.address_of()
    empty = Path(pool["TINKER_EXP_POOL_DIR"]) / "empty.sock"
    gone = Path(pool["TINKER_EXP_POOL_DIR"]) / "gone.sock"
    process = start_host(empty, idle_s=600.0)
    try:
        assert best_first([gone, empty, kept], checked_config(["trainer.steps=2"])) == [kept, empty, gone]
        assert best_first([gone, kept, empty], checked_config(["lora=r8"])) == [kept, empty, gone]
        assert best_first([gone, kept, empty], checked_config(["lora=r32"])) == [empty, kept, gone]
    finally:
        end(empty, process)


SEED_SWEEP = ["-m", "hydra/launcher=local", "hydra.launcher.max_parallel=1", *LORA, "trainer.seed=0,7"]
"""Two points, one at a time: on the sweep's own pool the second job (seed 7) is a seed change on a warm group, which
builds its engine again from the model dir (the seed draws LoRA's initial matrices)."""


@pytest.fixture(scope="module")
def cold_lora_seed_7(ray_address, tmp_path_factory) -> Path:
    """The cold run of LORA with seed 7: another seed draws other LoRA matrices (and another data order)."""
    run_dir = tmp_path_factory.mktemp("cold_lora_seed_7")
    cold(ray_address, *LORA, "trainer.seed=7", f"hydra.run.dir={run_dir}")
    return run_dir


@pytest.mark.real  # a sweep with its own pool (its own Ray cluster and workers)
def test_a_local_sweeps_second_job_on_its_pool_is_its_cold_point_and_a_seed_change_rebuilds_exactly(cold_lora, cold_lora_seed_7, tmp_path):
    """A 2-point sweep on the sweep's pool, each job a thread of the sweep's process leasing it (no process a job):
    each point's rows and LoRA adapter are the cold run's of its command, to the bit (seed 0: the module's cold LoRA
    run; seed 7: its own); the second job ran on the warm pool with another seed than the group's build."""
    cold_runs = {"0": cold_lora, "1": cold_lora_seed_7}
    warm_sweep = run_cli(*SEED_SWEEP, f"hydra.sweep.dir={tmp_path / 'warm'}", env={"TINKER_EXP_POOL": "auto", "RAY_ADDRESS": None}, timeout=600)
    assert warm_sweep.returncode == 0, warm_sweep.stdout[-2000:] + warm_sweep.stderr[-3000:]
    output = warm_sweep.stdout + warm_sweep.stderr
    assert "pool: 1 warm pool(s) for this sweep's jobs" in output and "pool: the sweep's 1 pool(s) ended" in output, output[-3000:]
    assert all(f"job {n} started (a thread of this process, on a pool of the sweep)" in output for n in (0, 1)), output[-3000:]
    assert not (tmp_path / "warm" / ".submitit").exists()  # no job process (submitit's folder)
    adapter = "adapter/adapter_model.safetensors"
    for point, cold_dir in cold_runs.items():
        said = (tmp_path / "warm" / point / "tinker_exp.log").read_text()
        assert "pool: training on the warm workers of" in said or "pool: training on the workers just built" in said, said
        cold_rows, warm_rows = (without_timings(metrics_rows(run_dir)) for run_dir in (cold_dir, tmp_path / "warm" / point))
        assert len(cold_rows) == 3 and warm_rows == cold_rows, point
        assert (tmp_path / "warm" / point / adapter).read_bytes() == (cold_dir / adapter).read_bytes(), point
    # The seed draws LoRA's matrices (the two points' adapters differ): a warm job that kept the first seed's would differ.
    assert (cold_runs["0"] / adapter).read_bytes() != (cold_runs["1"] / adapter).read_bytes()


SLOT_STUDY = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=3", "hydra.launcher.max_parallel=2",
              *LORA, "trainer.seed=choice(3,7,0)", "trainer.eval_every=1", "hydra.sweeper.pruner=threshold",
              "+hydra.sweeper.pruner_args.upper=5.9168", "+hydra.sweeper.pruner_args.interval_steps=100"]  # fmt: skip
"""An Optuna study of 3 LoRA trials (a grid over the seed: trials 0, 1, 2 are seeds 0, 7, 3) on 2 slots of one group
in the sweep's process (hydra.launcher.slots=auto, the default, bounded by max_parallel): seeds 0 and 7 train at once; the threshold pruner, judging only each trial's first evaluation
(interval_steps), prunes seed 7 there (val/loss 5.91701 > 5.9168; seed 0's is 5.91651) and seed 3 (5.91904); seed 3
takes a slot freed by a prune (seed 7's, while seed 0 trains, or seed 0's if it ended first)."""


@pytest.mark.real  # a study whose trials train on slots of one group (on the session's Ray cluster)
def test_a_studys_trials_on_slots_train_at_once_each_its_cold_run(cold_lora, cold_lora_seed_7, ray_address, tmp_path):
    """hydra.launcher.slots=auto (max_parallel=2): the study's trials are threads of its process on 2 slots of one
    LoRA group, built once.
    Each trial's training rows are the cold run's of its point (seeds 0 and 7: the module's cold runs, which evaluate
    only at their end), and seed 0's adapter too, within a packed step's bounds (the trials' steps at once may be
    packed: tests/helpers.py PACKED_RELATIVE); seed 7 is pruned at its first evaluation and the
    third trial takes the slot it freed. Each run dir says which slot its trial held and keeps its own log records;
    the sweep's terminal says the trials' ends, not their lines."""
    sweep = tmp_path / "study"
    result = run_cli(*with_wandb(SLOT_STUDY), f"hydra.sweep.dir={sweep}", env={"RAY_ADDRESS": ray_address}, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "study 'tinker_exp' (" in output and "3 trials, 2 at a time" in output, output[-3000:]
    assert "hydra.launcher.slots=auto: 2 trials at once on slots of one group (at most 8, the sweep's 3 trials, max_parallel=2; about " in output, output[-3000:]
    assert "pool:" not in output and "optimizer built with" not in output and "workers: " not in output  # no pool; no trial's own lines (its group's build's too)
    assert "W&B run" not in output, output[-3000:]  # a trial's W&B run starts in a thread of its run's: its line is the trial's
    import optuna

    from tinker_exp.sweep.study import open_storage, sweep_storage

    study = optuna.load_study(study_name="tinker_exp", storage=open_storage(sweep_storage(sweep)))
    seeds = {t.params["trainer.seed"]: sweep / str(t.number) for t in study.trials}
    states = {t.params["trainer.seed"]: (t.number, t.state.name) for t in study.trials}
    assert states == {0: (0, "COMPLETE"), 7: (1, "PRUNED"), 3: (2, "PRUNED")}, states
    said = {seed: (run_dir / "tinker_exp.log").read_text() for seed, run_dir in seeds.items()}
    slots = {seed: re.search(r"slot (\d) of 2 on this process's group, built for (this|an earlier) trial", text).groups() for seed, text in said.items()}
    assert sorted(built for _, built in slots.values()) == ["an earlier", "an earlier", "this"]  # one build: the first trial's
    assert {index for index, _ in slots.values()} == {"1", "2"}
    for seed, text in said.items():  # each log holds its own trial's records only
        assert f"trainer.seed={seed}" in (seeds[seed] / ".hydra" / "overrides.yaml").read_text().replace("- ", "")
        assert text.count("optimizer built with") == 1 and f"{seeds[seed]}/metrics.jsonl" in text, text[-2000:]
        assert_own_wandb_run(seeds[seed], text)
    adapter = "adapter/adapter_model.safetensors"

    def trained(rows: list[dict]) -> list[dict]:  # the training part of each row (the cold runs evaluate at their end only)
        return [{k: v for k, v in row.items() if not k.startswith("val/")} for row in without_timings(rows)]

    cold_rows = {seed: metrics_rows(cold_dir) for seed, cold_dir in ((0, cold_lora), (7, cold_lora_seed_7))}
    # trials at once: their steps may be packed (runtime/packed.py), within its bounds of the cold run
    assert_rows_close(trained(metrics_rows(seeds[0])), trained(cold_rows[0]))
    assert_rows_close(*([{"val/loss": rows[-1]["val/loss"]}] for rows in (metrics_rows(seeds[0]), cold_rows[0])))
    assert_adapters_close(seeds[0] / adapter, cold_lora / adapter)
    assert_rows_close(trained(metrics_rows(seeds[7])), trained(cold_rows[7])[:1])  # pruned after its first step
    assert [len(metrics_rows(seeds[seed])) for seed in (7, 3)] == [1, 1]


def with_wandb(args: list[str]) -> list[str]:
    """`args` with W&B's logger (offline in the suite) for logger=none."""
    return ["logger=wandb" if arg == "logger=none" else arg for arg in args]


def assert_own_wandb_run(run_dir: Path, logged: str) -> None:
    """A run that trained beside others in one process had a W&B run of its own (not the one another run had active
    then), holding its own rows, and its log (`logged`) says so: the line W&B's start-up thread logs is the run's."""
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert re.search(rf"W&B run {run_id} \(offline\): {re.escape(str(run_dir))}/wandb/", logged), logged[-3000:]
    records = wandb_finished_records(run_dir)
    assert wandb_run_record(records).run_id == run_id
    assert [row["train/loss"] for row in wandb_history(records) if "train/loss" in row] == [row["train/loss"] for row in metrics_rows(run_dir)]


POOL_SLOT_SWEEP = ["-m", *LORA, "trainer.seed=0,7"]
"""A 2-point grid of LoRA runs (seeds 0 and 7) as threads of the sweep's process, each on a slot of the pool: what
hydra.launcher.slots=auto (the default) makes of a LoRA grid."""


@pytest.mark.real  # the module's pool: LoRA runs at once on the slots of its group
def test_lora_runs_at_once_on_the_pools_slots_are_each_their_cold_run_and_a_ctrl_c_frees_a_slot(pool, cold_lora, cold_lora_seed_7, tmp_path):
    """`pool up` keeps 4 slots (the default): a long LoRA run takes one, then a sweep's two trials (hydra.launcher.slots
    =auto, the default: 2 for its 2 LoRA points, seeds 0 and 7) take two more beside it, on the same group, built once. Each trial's rows and adapter are its
    cold run's within a packed step's bounds (runs at once: their steps may pack; tests/helpers.py PACKED_RELATIVE); each run says which slot it holds; `pool status` lists the runs on slots. Ctrl-C of the
    long run stops it as a cold run stops (exit 130) and frees its slot: the pool is idle after."""
    long_dir = tmp_path / "long"
    long_run = subprocess.Popen(
        [sys.executable, "-m", "tinker_exp", *LORA[:-1], *LONG_RUN, f"hydra.run.dir={long_dir}"],
        cwd=REPO, env=environment(pool), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as a terminal delivers it: SIGINT at its default (a suite run under `&` inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        wait_until(lambda: len(metrics_rows(long_dir)) >= 2, 240, "the long run never logged 2 steps", long_run)
        # a process of its own, as the long run's (a run forked from the tests' CLI zygote has another sys.path, and
        # runs at once on slots share theirs)
        sweep = subprocess.run([sys.executable, "-m", "tinker_exp", *with_wandb(POOL_SLOT_SWEEP), f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                               cwd=REPO, env=environment(pool), capture_output=True, text=True, timeout=400)  # fmt: skip
        status = run_module("tinker_exp.pool", "status", env=pool)
        long_run.send_signal(signal.SIGINT)
        out, err = long_run.communicate(timeout=120)
    finally:
        long_run.kill()
    assert sweep.returncode == 0, sweep.stdout[-2000:] + sweep.stderr[-3000:]
    assert "hydra.launcher.slots=auto: 2 trials at once on slots of one group (at most 8, the sweep's 2 trials; about " in sweep.stdout, sweep.stdout[-3000:]
    address = Path(pool["TINKER_EXP_POOL_DIR"]) / "pool.sock"  # the sweep names the pool whose slots it takes
    assert f"slots: the trials train on the slots of the warm pool at {address} (4 slots;" in sweep.stdout, sweep.stdout[-3000:]
    assert f"2 local jobs, 2 at a time on the slots of the warm pool at {address} (hydra.launcher.slots)" in sweep.stdout
    assert long_run.returncode == 130, out[-2000:] + err[-2000:]
    said = re.search(r"pool: slot (\d) of 4 on the pool at \S+: (a group built for this run|a kept group)", out)
    assert said is not None, out[-3000:]
    assert "now running 1 run on the slots of one group (of 4): slot 1 since" in status.stdout, status.stdout
    adapter = "adapter/adapter_model.safetensors"
    slots = set()
    for point, cold_dir in (("0", cold_lora), ("1", cold_lora_seed_7)):
        run_dir = tmp_path / "sweep" / point
        logged = (run_dir / "tinker_exp.log").read_text()
        line = re.search(r"pool: slot (\d) of 4 on the pool at .*: a kept group \(built .*\), beside (\d) other runs?", logged)
        assert line is not None, logged[-3000:]
        assert_own_wandb_run(run_dir, logged)  # started in a thread of its run's in the pool's process: its line came back
        slots.add(line.group(1))
        assert_rows_close(metrics_rows(run_dir), metrics_rows(cold_dir))  # runs at once: their steps may pack
        assert_adapters_close(run_dir / adapter, cold_dir / adapter)
    assert said.group(1) not in slots and len(slots) == 2 or slots == {"2"}  # beside the long run's slot (or one after the other)
    after = run_module("tinker_exp.pool", "status", env=pool)
    assert "now idle" in after.stdout, after.stdout


class FakeWorkers:
    """Bookkeeping only: a kept group's workers, freed or not."""

    def __init__(self) -> None:
        self.freed = False

    def shutdown(self) -> None:
        self.freed = True


def test_kept_groups_free_the_least_recently_used_when_a_new_one_would_not_fit():
    """The count, the memory budget and the cluster's workers each bound the kept groups; the least recently used is
    freed first, and each freeing is said with why."""
    from tinker_exp.runtime.warm import Kept, KeptGroups

    said: list[str] = []
    key = lambda name: {"worker": "W", "model": name, "device": "cpu", "backend": {"num_workers": 2, "nodes": 1},
                        "lora": None, "optimizer": "adamw"}  # fmt: skip
    groups = KeptGroups(max_groups=2, memory_budget_mb=1000.0, say=said.append)
    a, b = (Kept(key(name), FakeWorkers(), 0.0, [1], 300.0, 2) for name in "ab")
    groups.add(a), groups.add(b)
    groups.use(a)  # b is now the least recently used
    groups.make_room(key("c"), 2)
    assert b.workers.freed and not a.workers.freed and list(groups.groups.values()) == [a]
    assert said == ["freed a group, the least recently used (2 groups kept, --max-groups 2): 2 x W on cpu; model b; full fine-tuning; adamw"]

    groups.max_groups = 5
    c = Kept(key("c"), FakeWorkers(), 0.0, [2], 600.0, 2)
    groups.add(c)
    groups.make_room(key("d"), 2)  # 300 + 600 kept + about 600 new > 1000: a goes; 600 + 600 > 1000: c too
    assert a.workers.freed and c.workers.freed and groups.groups == {}
    assert "MiB kept + about 600 MiB for the new one > the budget of 1000 MiB" in said[1]

    groups.memory_budget_mb, groups.capacity = float("inf"), 4.0
    e, f = (Kept(key(name), FakeWorkers(), 0.0, [3], 10.0, 2) for name in "ef")
    groups.add(e), groups.add(f)
    groups.make_room(key("g"), 2)  # 4 workers kept + 2 > 4: e (least recently used) goes
    assert e.workers.freed and not f.workers.freed and "4 workers kept + 2 new > the cluster's 4" in said[-1]
    assert groups.find(key("f")) is f and groups.find(key("e")) is None


@pytest.mark.real  # a pool process (torch, verl and Ray imported; no workers)
def test_a_silent_client_loses_its_lease_and_a_pool_left_idle_ends_by_itself(tmp_path, monkeypatch):
    """A client that leases the pool and then says nothing (stopped, hung) does not hold it: after the lease timeout
    the pool is free; then `up --idle-min`'s rule: no run for its idle time, it ends and says why."""

    from tinker_exp.place import wire
    from tinker_exp.place.pools import start_host

    monkeypatch.setenv("TINKER_EXP_POOL_LEASE_TIMEOUT_S", "2")
    address = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp")) / "idle.sock"
    process = start_host(address, idle_s=3.0)
    try:
        silent = wire.connect(address)
        wire.send(silent, ("lease", {"code": wire.code_fingerprint(), "pid": 1, "who": "a silent client"}))
        assert wire.recv(silent)[0] == "leased"
        assert wire.ask(address, ("status",))["holder"]["who"] == "a silent client"
        process.wait(timeout=120)  # freed after 2 s of silence, then idle for 3 s: it ends
    finally:
        process.kill()
    log = (address.parent / "idle.log").read_text()
    assert "pool: the client (pid 1) said nothing for 2 s; its lease ended" in log, log[-2000:]
    assert process.returncode == 0 and "pool: stopping: idle for" in log and "pool: down" in log, log[-2000:]
    assert not address.exists()
    shutil.rmtree(address.parent, ignore_errors=True)


@pytest.mark.real  # pool processes (their imports; no workers)
def test_two_pools_started_at_once_leave_one_and_a_down_while_it_starts_is_kept():

    from tinker_exp.place import wire
    from tinker_exp.place.pools import end, start_host

    address = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp")) / "pool.sock"
    first, second = (start_host(address, idle_s=600.0, wait=False) for _ in range(2))
    try:
        wait_until(lambda: wire.pid_holding(address) is not None, 60, "no pool process took the address")
        holder = wire.pid_holding(address)
        assert holder in (first.pid, second.pid)
        other = second if holder == first.pid else first
        assert other.wait(timeout=120) == wire.ALREADY_EXIT  # the second one ends at once: no orphan pool
        assert end(address) == holder  # before it listens (its imports take seconds): its SIGTERM is kept
        starter = first if holder == first.pid else second
        assert starter.wait(timeout=120) == 0
    finally:
        first.kill(), second.kill()
    log = wire.log_of(address).read_text()
    assert "another pool process holds" in log and "pool: stopping: SIGTERM while it started" in log and "pool: down" in log, log
    assert not address.exists() and wire.pid_holding(address) is None
    shutil.rmtree(address.parent, ignore_errors=True)


@pytest.fixture
def planted():
    """Another user's listening socket (a child of this process, forked, running as NOBODY), and what it received:
    (start(socket_path) -> listener, received(listener) -> (connections accepted, bytes received))."""
    children = []

    def start(socket_path: Path) -> tuple[int, int, int]:
        ready_r, ready_w = os.pipe()
        done_r, done_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the other user: no exec (it could not run this checkout's interpreter), plain sockets only
            try:
                for fd in (ready_r, done_w, out_r):
                    os.close(fd)
                listen_as_another_user(socket_path, ready_w, done_r, out_w)
            finally:
                os._exit(0)
        for fd in (ready_w, done_r, out_w):
            os.close(fd)
        assert os.read(ready_r, 1) == b"1", "the other user's listener did not start"
        os.close(ready_r)
        children.append(pid)
        return pid, done_w, out_r

    def received(listener: tuple[int, int, int]) -> tuple[int, int]:
        pid, done_w, out_r = listener
        os.close(done_w)
        accepted, size = os.read(out_r, 100).split()
        os.close(out_r)
        os.waitpid(pid, 0)
        children.remove(pid)
        return int(accepted), int(size)

    yield start, received
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_sweep_on_slots_finds_the_warm_pool_whose_slots_its_trials_take():
    """`slot_pool` (the sweep's line naming the pool): the pool backend.pool names (auto: the user's) when it answers
    `status` with more than one slot; none where it keeps one slot, where nothing answers, or with backend.pool=none."""
    import socket
    import threading

    from tinker_exp.place import wire
    from tinker_exp.place.pools import slot_pool

    folder = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp"))  # private (0700), short enough for a socket's path
    try:
        answers = {"four": 4, "one": 1}
        for name in answers:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(folder / f"{name}.sock"))
            server.listen(4)

            def serve(server=server, slots=answers[name]) -> None:  # a pool's `status` answer, once
                conn, _ = server.accept()
                with conn:
                    assert wire.recv(conn) == ("status",)
                    wire.send(conn, {"pid": os.getpid(), "slots": slots})

            threading.Thread(target=serve, daemon=True).start()
        assert slot_pool(str(folder / "four.sock")) == (folder / "four.sock", 4)
        assert slot_pool(str(folder / "one.sock")) is None
        assert slot_pool(str(folder / "none-there.sock")) is None and slot_pool("none") is None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def listen_as_another_user(socket_path: Path, ready_w: int, done_r: int, out_w: int) -> None:
    import select
    import socket

    os.setgid(NOBODY)
    os.setuid(NOBODY)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(socket_path))
    server.listen(8)
    server.settimeout(0.1)
    os.write(ready_w, b"1")
    accepted = size = 0
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # none waiting: done once the test has looked
            if select.select([done_r], [], [], 0)[0]:
                break
            continue
        accepted += 1
        conn.settimeout(5.0)
        try:
            while data := conn.recv(65536):
                size += len(data)
        except OSError:
            pass
        conn.close()
    os.write(out_w, f"{accepted} {size}".encode())


def tempfile_dir() -> str:

    folder = tempfile.mkdtemp(prefix="txp-planted-", dir="/tmp")
    os.chmod(folder, 0o755)
    return folder


@as_root
def test_a_pool_planted_by_another_user_gets_nothing_and_the_run_starts_cold(planted, monkeypatch):
    """The planted-socket attack: another user's folder at the pool's place with a listening pool.sock; then a
    private folder of ours whose socket (chowned to us) is served by another user's process. backend.pool=auto: one
    line and a cold start, nothing sent (nothing to unpickle); an address: one line, exit 2; `pool status`: one line."""
    from helpers import compose

    from tinker_exp import config
    from tinker_exp.place import wire
    from tinker_exp.place import ColdGroup
    from tinker_exp.place.lease import lease_a_pool

    start, received = planted
    theirs = Path(tempfile_dir())
    os.chown(theirs, NOBODY, NOBODY)
    os.chmod(theirs, 0o777)
    listener = start(theirs / "pool.sock")
    monkeypatch.setenv("TINKER_EXP_POOL_DIR", str(theirs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = config.load(compose("backend.pool=auto", "backend.ray_address=null"))
    lease = lease_a_pool(cfg)
    assert isinstance(lease, ColdGroup)
    assert lease.describe() == f"pool: not trusted, nothing sent to it: {theirs}: owned by uid {NOBODY}, not by you (uid 0) (set TINKER_EXP_POOL_DIR to a folder of yours, or remove it); starting cold"
    explicit = config.load(compose(f"backend.pool={theirs / 'pool.sock'}", "backend.ray_address=null"))
    with pytest.raises(wire.UntrustedPool, match=rf"^backend.pool={theirs}/pool.sock: {theirs}: owned by uid {NOBODY}"):
        lease_a_pool(explicit)
    status = run_module("tinker_exp.pool", "status", env={"TINKER_EXP_POOL_DIR": str(theirs)})
    assert status.returncode == 2 and status.stderr.count("\n") == 1 and "pool refused" in status.stderr, status.stderr
    assert received(listener) == (0, 0)  # never connected to

    # Our own private folder, our own socket file, but another user's process listening: the peer is checked.
    ours = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp"))
    listener = start(theirs / "peer.sock")
    os.rename(theirs / "peer.sock", ours / "pool.sock")
    os.chown(ours / "pool.sock", 0, 0)
    monkeypatch.setenv("TINKER_EXP_POOL_DIR", str(ours))
    lease = lease_a_pool(cfg)
    assert lease.describe() == f"pool: not trusted, nothing sent to it: {ours}/pool.sock: the process listening there runs as uid {NOBODY}, not as you (uid 0); starting cold"
    accepted, size = received(listener)
    assert accepted == 1 and size == 0  # connected, checked, closed: nothing sent
    shutil.rmtree(ours), shutil.rmtree(theirs)


def test_a_pool_folder_that_is_not_a_private_folder_is_one_line(tmp_path):
    """`pool up` where the pools' folder is a file, or open to others: one line, exit 2, nothing started."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    for folder, problem in ((tmp_path / "a_file", "not a folder"), (tmp_path / "open", "mode 0755, not private to you")):
        up = run_module("tinker_exp.pool", "up", env={"TINKER_EXP_POOL_DIR": str(folder)})
        assert up.returncode == 2 and up.stderr == f"tinker_exp: pool refused: {folder}: {problem}" + (
            " (chmod 700 it)" if folder.name == "open" else "") + " (set TINKER_EXP_POOL_DIR to a folder of yours, or remove it)\n", up.stderr
        assert not (folder / "pool.log").exists() if folder.is_dir() else True


def test_a_run_sends_its_pool_only_the_environment_it_needs(monkeypatch):
    from helpers import compose

    from tinker_exp import config
    from tinker_exp.place.lease import run_payload

    secrets = {"WANDB_API_KEY": "wk", "HF_TOKEN": "hf", "AWS_SECRET_ACCESS_KEY": "aws", "GITHUB_TOKEN": "gh", "MY_PASSWORD": "pw"}
    for name, value in {**secrets, "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": "1", "NCCL_DEBUG": "INFO", "SSH_AUTH_SOCK": "/s"}.items():
        monkeypatch.setenv(name, value)
    offline = run_payload((), config.load(compose("logger.mode=offline")))
    assert not set(secrets) & set(offline["environ"]) and "SSH_AUTH_SOCK" not in offline["environ"]
    assert offline["environ"]["WANDB_MODE"] == "offline" and offline["environ"]["PATH"] == os.environ["PATH"]
    assert offline["worker_env"]["CUDA_VISIBLE_DEVICES"] == "1" and offline["worker_env"]["NCCL_DEBUG"] == "INFO"
    online = run_payload((), config.load(compose("logger.mode=online")))
    assert set(secrets) & set(online["environ"]) == {"WANDB_API_KEY"}  # an online W&B run logs with it
    assert "WANDB_API_KEY" not in online["worker_env"]


def test_pool_commands_mistakes_and_a_closed_pipe_are_one_line(tmp_path):
    env = {"TINKER_EXP_POOL_DIR": str(tmp_path / "pools")}
    typo = run_module("tinker_exp.pool", "stauts", env=env)
    assert typo.returncode == 2 and typo.stderr == "tinker_exp: config error: stauts: not a pool command; did you mean status? (its commands: up, status, down)\n"
    read, write = os.pipe()
    os.close(read)  # `pool status | head` once head has gone
    status = subprocess.run([sys.executable, "-m", "tinker_exp.pool", "status"], cwd=REPO, env=environment(env),
                            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    os.close(write)
    assert status.returncode == 0 and status.stderr == ""
    for value, meant in (("None", "; did you mean none?"), ("nonsense", "")):
        run = run_cli(f"backend.pool={value}", f"hydra.run.dir={tmp_path / value}", env=env)
        assert run.returncode == 2 and run.stderr == (f"tinker_exp: config error: backend.pool={value}: not one of auto, none or a pool's "
                                                      f"socket path (a path with a '/' or ending in .sock){meant}\n")  # fmt: skip
        assert not (tmp_path / value).exists()
    for args, line in ((["--max-groups", "0"], "--max-groups=0: must be >= 1"), (["--memory-mb=lots"], "--memory-mb=lots: not a number of MiB"),
                       (["--idle-min", "-1"], "--idle-min=-1: must be > 0"),
                       (["--slots", "0"], "--slots=0: must be >= 1 (1: one run at a time)"),
                       (["--slots"], "--slots: no value given (it takes a whole number)"),
                       (["--slot", "4"], "no such flag --slot; did you mean --slots? (pool up's flags: --idle-min, --max-groups, "
                                         "--memory-mb, --slots)")):  # fmt: skip
        up = run_module("tinker_exp.pool", "up", *args, env=env)
        assert up.returncode == 2 and up.stderr == f"tinker_exp: config error: {line}\n", up.stderr
    # status and down take no arguments: refused, not ignored (with a pool up, `down lora=r8` ended the whole pool)
    for command, args, what in (("down", ["lora=r8"], "lora=r8"), ("status", ["lora=r8"], "lora=r8"),
                                ("down", ["--force"], "no such flag --force")):  # fmt: skip
        refused = run_module("tinker_exp.pool", command, *args, env=env)
        assert (refused.returncode, refused.stdout) == (2, "") and refused.stderr == (
            f"tinker_exp: config error: {what}: pool {command} takes no arguments (overrides are pool up's, and a run's)\n"), refused.stderr
    assert not (tmp_path / "pools").exists()  # refused before anything was made


def test_pool_up_refuses_before_it_starts_what_its_pool_would_refuse_only_once_started(tmp_path, monkeypatch, capsys):
    """`pool up` with what its pool's process refused after it started (the device, a LoRA target: a traceback, exit
    1) or never (several nodes: it waited for nodes that never join): one line, exit 2, before the pools' folder is
    made or a pool process started. In this process, as `python -m tinker_exp.pool up` runs it."""
    from test_cli_errors import refused_on_the_run_path

    from tinker_exp.pool.__main__ import main

    monkeypatch.setenv("TINKER_EXP_POOL_DIR", str(tmp_path / "pools"))
    given = tmp_path / "given"
    given.mkdir()
    refusals = {
        "Liger on cpu": (["backend.liger=true"], "config error: backend.liger=true: its kernels are Triton, for GPUs only "
                                                 "(this run: cpu); use null (auto) or false"),
        "a LoRA target the model lacks": refused_on_the_run_path(given)["a LoRA target the model lacks"],
        "several nodes": (["backend.nodes=2"], "config error: backend.nodes=2: a pool holds one machine's workers (a run over "
                                               "several nodes starts its own, cold); pool up takes backend.nodes=1"),
    }  # fmt: skip
    for what, (args, line) in refusals.items():
        assert main(["up", *args]) == 2, what
        out, err = capsys.readouterr()
        (said,) = err.splitlines()
        assert out == "" and said.startswith(f"tinker_exp: {line}"), (what, said)
        assert not (tmp_path / "pools").exists(), what  # no pool's folder: nothing started, nothing written


def test_a_rerun_waits_for_the_pool_that_still_writes_into_its_run_dir(tmp_path):
    """A client SIGKILLed while a pool trains its run: the lock names the pool, so a rerun in that dir waits until
    the pool has released it (then takes the dir, the killed client's lock gone with the pool's release)."""
    import threading

    from tinker_exp.train.rundir_lock import LOCK_FILE, RunDirLock, read_holder, written_by_pool

    client = subprocess.Popen([sys.executable, "-c", f"from tinker_exp.train.rundir_lock import RunDirLock; import sys; "
                               f"lock = RunDirLock(__import__('pathlib').Path({str(tmp_path)!r})); lock.acquire(); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert client.stdout.readline() == "held\n"
    rerun_holds = threading.Event()
    with written_by_pool(tmp_path, client.pid):  # this process is the pool
        assert read_holder(tmp_path / LOCK_FILE)[0].pool_pid == os.getpid()
        client.kill()
        client.wait()

        def rerun() -> None:
            with RunDirLock(tmp_path):
                rerun_holds.set()

        thread = threading.Thread(target=rerun)
        thread.start()
        assert not rerun_holds.wait(1.0)  # the client is gone, but the pool writes: the rerun waits
    thread.join(timeout=30)
    assert rerun_holds.is_set()


def test_a_sweeps_jobs_that_name_pools_run_at_most_one_a_pool_at_once():
    """A pool trains one run at a time (LoRA runs on its slots aside): a local sweep whose jobs all name pools starts
    no more of them at once than the pools they name, where a job beyond them would be refused (pool busy, exit 2:
    seen as an RL study with n_jobs=2 on one named pool, 2 of 3 trials FAILED)."""
    from helpers import compose

    from tinker_exp.place.pools import named_pools

    one, other = compose("backend.pool=/tmp/a/pool.sock"), compose("backend.pool=/tmp/b/pool.sock")
    assert named_pools([one, one, one]) == 1 and named_pools([one, other]) == 2
    assert named_pools([one, compose()]) == 0 and named_pools([compose("backend.pool=none")]) == 0  # not all name one
    assert named_pools([compose("backend.pool=/tmp/a/pool.sock", "dry_run=true")]) == 0  # a dry run trains nowhere


def test_a_runs_output_reaches_a_client_that_reads_slowly_whole_and_its_stop_still_arrives():
    """The pool watches a run's client (its stop, its heartbeat) on the socket its run's output goes out on. A client
    that stops reading for a while (a full pipe, a paused terminal) holds the output back; it must not cut a message in
    two (a send that times out halfway leaves every later message unreadable, and the client waiting for bytes).
    Real sockets; the host's own watch and Outbox."""
    import socket as socket_module
    import threading
    import time
    from types import SimpleNamespace

    from tinker_exp.place import wire
    from tinker_exp.pool.host import Host, Job, Outbox

    pool_end, client_end = socket_module.socketpair()
    client_end.settimeout(20)  # a stream cut halfway would leave this side waiting for bytes that never come
    stopped: list[int] = []
    job = Job("run", {}, pool_end)
    host = SimpleNamespace(lease_timeout_s=60.0, holder=None, _stop_job=lambda job, signum: (stopped.append(signum), job.done.set()))
    watched = threading.Thread(target=Host._watch, args=(host, pool_end, job), daemon=True)
    watched.start()
    out = Outbox(pool_end)
    lines = [f"{i:05d} " + "x" * 20_000 for i in range(60)]  # 1.2 MB: far past the sockets' buffers
    sender = threading.Thread(target=lambda: [out.send(("stdout", line)) for line in lines], daemon=True)
    sender.start()
    time.sleep(1.5)  # the client reads nothing for 3 x the watch's poll: the sends wait, whole
    received = [wire.recv(client_end) for _ in lines]
    sender.join(timeout=30)
    assert received == [("stdout", line) for line in lines]
    wire.send(client_end, ("stop", "SIGINT"))
    watched.join(timeout=30)
    assert stopped == [signal.SIGINT] and not watched.is_alive()


def test_a_run_that_waits_for_the_run_before_to_end_waits_past_its_connections_timeout():
    """A run that leases the pool while the run before is still ending (its client killed or stopped; it closes its
    files) waits for it and then trains there, however long that takes within the pool's bound: the pool says
    `waiting` at once and the client waits for as long as the pool may (it waited only the connection's 5 s, and took
    a pool slow to end a killed run, under load, for gone: `pool: none is up, starting cold`). Real sockets, the
    host's own lease; a connection timeout of 0.2 s stands for the 5 s."""
    import threading
    import time

    from tinker_exp.place import wire
    from tinker_exp.pool.host import Host

    address = Path(tempfile.mkdtemp(prefix="txp-", dir="/tmp")) / "ending.sock"
    host = Host(address, idle_s=600.0)
    server = host.listen()
    host.holder = {"who": "a killed run's", "pid": 1, "since": time.time(), "ending": True}
    answers: list = []
    sock = wire.connect(address, 0.2)
    wire.send(sock, ("lease", {"code": wire.code_fingerprint(), "pid": 2, "who": "the next run"}))
    client = threading.Thread(target=lambda: answers.append(wire.lease_answer(sock)), daemon=True)
    client.start()
    try:
        time.sleep(0.6)  # 3 x the connection's timeout: the client still waits (told to by the pool)
        assert client.is_alive() and answers == []
        with host.free:  # the run before has ended
            host.holder = None
            host.free.notify_all()
        client.join(30)
        assert answers and answers[0][0] == "leased" and host.holder["who"] == "the next run", answers
    finally:
        sock.close()
        host.stopping.set()
        server.close()
        shutil.rmtree(address.parent, ignore_errors=True)


def test_a_lease_answer_reads_past_the_pools_waiting():
    """The client's side of that: `wire.lease_answer` reads every `waiting` and returns the answer after them, its
    socket's timeout the pool's bound plus a margin (None: a sweep's trial waiting for a slot waits as long as it
    must)."""
    import socket as socket_module

    from tinker_exp.place import wire

    pool_end, client_end = socket_module.socketpair()
    client_end.settimeout(0.2)
    wire.send(pool_end, ("waiting", {"for": "the run before to end", "bound_s": 60.0}))
    wire.send(pool_end, ("waiting", {"for": "a slot", "bound_s": None}))
    wire.send(pool_end, ("leased", {"pid": 1}))
    assert wire.lease_answer(client_end) == ("leased", {"pid": 1}) and client_end.gettimeout() is None
    wire.send(pool_end, ("waiting", {"for": "the run before to end", "bound_s": 60.0}))
    wire.send(pool_end, ("busy", {}))
    assert wire.lease_answer(client_end) == ("busy", {}) and client_end.gettimeout() == 60.0 + wire.WAITING_MARGIN_S
    pool_end.close(), client_end.close()


def test_a_run_told_the_pools_slots_are_busy_is_told_why_it_cannot_join_them(tmp_path):
    """A run refused by a pool whose slots hold runs hears how many are held and why it cannot take one: none free
    (a run like theirs), another group or context (what differs), or a run that needs the whole group. The host's own
    answer; the sharing's key and contexts as `_slot_terms` makes them."""
    import time

    from tinker_exp.pool.host import Host, Sharing

    host = Host(tmp_path / "pool.sock", idle_s=600.0, slots=2)
    key, context = {"lora": {"rank": 8}}, ((), "/home/me/project", ("/home/me/project",))
    host.sharing = Sharing(key, context, holders=[{"who": "lora=r8 trainer.seed=1", "pid": 1, "since": time.time()}])
    elsewhere = (key, ((), "/home/me/other", ("/home/me/other",)))
    assert host._busy_info(elsewhere)["slots"] == "1 of 2 slots held; the runs on slots come from another working dir"
    assert host._busy_info(None)["slots"] == "1 of 2 slots held; this run needs the whole group (slots hold LoRA SFT runs on one node)"
    host.sharing.holders.append({"who": "lora=r8 trainer.seed=2", "pid": 2, "since": time.time()})
    assert host._busy_info((key, context)) == {**host.sharing.holders[0], "slots": "2 of 2 slots held"}
