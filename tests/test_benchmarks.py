"""benchmarks/overhead.py runs, and its bare loop is verl's worker built as tinker_exp builds it (no figure is
asserted: speed is for the benchmark to print, not for tests)."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO, environment

SCRIPT = REPO / "benchmarks" / "overhead.py"


def overhead():
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpu_variant", [False, True], ids=["default", "gpu-variant-tiny-on-cpu"])
def test_the_bare_loop_builds_verl_s_worker_exactly_as_tinker_exp_does(gpu_variant, tmp_path, monkeypatch):
    """Same model, engine, optimizer and checkpoint config: the two loops differ only in what drives them."""
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.main import validate
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.workers import worker_config

    bench = overhead()
    monkeypatch.setenv("TINKER_EXP_CACHE", str(REPO / ".cache"))
    overrides = ["+override=constant", "trainer.steps=3"]
    if gpu_variant:
        model = bench.bench_model(bench.TINY_QWEN2, REPO / ".cache", "float32")
        overrides += [f"model.path={model}", f"data.path={bench.bench_data(tmp_path)}", "data.max_length=64",
                      "data.val_fraction=null", "backend.precision=bf16", "backend.num_workers=1"]  # fmt: skip
    spec, facts = bench.prepare(overrides, tmp_path)
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = config.load(compose("config", overrides=overrides))
    ours = worker_config(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), validate(cfg).optimizer_values,
                         resolve(cfg.backend), cfg.lora)  # fmt: skip
    bare = bench.bare_worker_config(spec)
    assert (bare.engine_config, bare.optimizer_config, bare.checkpoint_config) == (
        ours.engine_config, ours.optimizer_config, ours.checkpoint_config
    )
    skip = {"tokenizer", "processor"}  # loaded objects without equality; their files are the same path
    fields = [f.name for f in dataclasses.fields(ours.model_config) if f.name not in skip]
    assert [getattr(bare.model_config, f) for f in fields] == [getattr(ours.model_config, f) for f in fields]
    assert spec["step_params"] == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # both send it
    assert len(spec["batches"]) == 3 and facts["tokens"][0] > 0


def test_the_gpu_variant_runs_on_cpu_with_tiny_shapes(ray_address):
    """The same script as on a GPU machine (--device cpu): both loops train, the smoke checks pass, and the two
    loops compute the same losses, bitwise (same worker config, batches and overrides)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--gpu", "--tiny", "--device", "cpu", "--pairs", "1", "--steps", "4"],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address, "TINKER_EXP_CACHE": str(REPO / ".cache")}),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "smoke check passed: loss finite and falling in both loops, applied == requested, every rank on its device" in out
    assert "losses of the two loops: bitwise equal" in out
    assert "attention: sdpa" in out and "workers (tinker_exp): 1 rank(s) on cpu; attention sdpa" in out
    for line in ("median step time:", "start to end of step 1:", "tokens/s (median step):"):
        assert line in out, out


def test_the_pbt_boundary_benchmark_runs_tiny(ray_address, tmp_path):
    """benchmarks/pbt_boundary.py with one round of 4 steps (one boundary): a plain run, a member that carries on and
    one that exploits the donor's checkpoint (the script checks each member's decisions); no figure is asserted."""
    import json

    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pbt_boundary.py"), "--rounds", "1", "--steps", "4", "--interval", "2",
         "--keep", str(tmp_path)],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address}), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "round 0 (plain then carry on then exploit): between steps at the boundaries: plain " in result.stdout
    for line in ("medians: one training step ", "a boundary that carries on: ", "a boundary that exploits: "):
        assert line in result.stdout, result.stdout
    exploit = [json.loads(line) for line in (tmp_path / "exploit_0" / "0" / "population.jsonl").read_text().splitlines()]
    assert [(row["step"], row["rank"], row["of"], row["exploit"]["member"]) for row in exploit] == [(2, 2, 2, 1)]
