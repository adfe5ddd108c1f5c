"""benchmarks/overhead.py runs, and its bare loop is verl's worker built as tinker_exp builds it; benchmarks/pruning.py
runs its studies and times reports to a journal and a PostgreSQL server; benchmarks/pbt_boundary.py runs one boundary
of each kind (tests/test_pbt_ray.py, on a population member's checkpoints; no figure of speed is asserted: speed is
for the benchmark to print, not for tests)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
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
    from tinker_exp.run import validate
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


GPU_BENCH = REPO / "benchmarks" / "gpu.py"


def test_the_gpu_benchmark_runs_on_cpu_with_tiny_shapes_and_the_throughput_knobs(ray_address, tmp_path):
    """benchmarks/gpu.py as on a GPU machine (--tiny --device cpu), with the knobs a GPU run turns on asked for
    explicitly (micro batches by tokens, padded, the fused optimizer, activation checkpointing, verl's fused lm
    head): both loops train through
    verl with them, losses bitwise equal between the loops (one worker config), applied == requested, and every
    figure the GPU run reports is printed."""
    figures = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(GPU_BENCH), "--tiny", "--device", "cpu", "--steps", "4", "--warmup", "1",
         "--set", "backend.micro_batch_tokens=128", "--set", "backend.optimizer_kernel=fused",
         "--set", "backend.gradient_checkpointing=true", "--set", "backend.fused_lm_head=true",
         "--set", "backend.padding_free=false", "--json", str(figures)],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address, "TINKER_EXP_CACHE": str(REPO / ".cache")}),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "checks passed: losses finite, applied == requested, every rank on its device" in out
    assert ("GPU benchmark: cpu, fp32, attention sdpa; micro batches <= 128 tokens, padding-free off, activation "
            "checkpointing on, torch.compile off, fused lm head on, reshard after forward off, optimizer kernel "
            "fused=True") in out  # fmt: skip
    for pattern in (r"\[ *[0-9.]+ s\] tinker_exp's workers ready", r"\[ *[0-9.]+ s\]   step 3: ",
                    r"start-up: +imports [0-9.]+ s, Ray [0-9.]+ s, worker group [0-9.]+ s, workers up [0-9.]+ s, model load [0-9.]+ s, first step [0-9.]+ s",
                    r"step: +[0-9.]+ ms \(median\); forward_backward +[0-9.]+ ms \(worker +[0-9.]+ ms, Ray round trip +-?[0-9.]+ ms\); "
                    r"optimizer_step +[0-9.]+ ms \(worker +[0-9.]+ ms, Ray round trip +-?[0-9.]+ ms\); driver's own work +[0-9.]+ ms",
                    r"tokens/s: +[0-9,]+",
                    r"MFU: +- on the spec peak \(-: no spec peak known for this device \(pass --peak-tflops\); 6 x N x tokens / step time, N = 139,840 parameters",
                    r"MFU: +[0-9.]+ % on the measured matmul \([0-9.]+ TFLOP/s: measured matmul rate; 6 x N x tokens / step time, N = 139,840 parameters",
                    r"bare loop: +[0-9.]+ ms a step \(median\), ready in [0-9.]+ s; tinker_exp / bare = [0-9.]+; losses bitwise equal"):  # fmt: skip
        assert re.search(pattern, out), (pattern, out[-3000:])
    saved = json.loads(figures.read_text())
    assert saved["tokens_per_step"] == 4 * 64 and len(saved["tinker_exp"]["losses"]) == 4
    assert saved["spec_peak_tflops"] is None and saved["mfu_spec_peak"] is None  # a CPU has no spec bf16 peak here
    assert saved["matmul_tflops"] > 0 and saved["mfu_measured_matmul"] == pytest.approx(
        6 * saved["n_params"] * 4 * 64 / saved["tinker_exp"]["step_s"] / (saved["matmul_tflops"] * 1e12))
    assert saved["tinker_exp"]["losses"] == saved["bare"]["losses"]


def test_the_gpu_benchmark_takes_the_spec_peak_from_the_device_s_name_or_the_flag():
    spec = importlib.util.spec_from_file_location("gpu_bench", GPU_BENCH)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    assert gpu.spec_peak("NVIDIA H100 80GB HBM3", None) == (989, "H100 spec, dense bf16")  # the SXM part
    assert gpu.spec_peak("NVIDIA H200", None) == (989, "H200 spec, dense bf16")
    assert gpu.spec_peak("NVIDIA H100 PCIe", None) == (756, "H100 PCIe spec, dense bf16")
    assert gpu.spec_peak("NVIDIA A100-SXM4-80GB", None)[0] == 312
    assert gpu.spec_peak("NVIDIA L40S", None)[0] == 362 and gpu.spec_peak("NVIDIA L4", None)[0] == 121
    assert gpu.spec_peak("NVIDIA H200", 900.0) == (900.0, "--peak-tflops 900")  # the flag wins
    assert gpu.spec_peak("Tesla T4", None) == (None, "no spec peak known for Tesla T4 (pass --peak-tflops)")


PRUNING = REPO / "benchmarks" / "pruning.py"


def test_the_pruning_benchmark_runs_both_studies_of_a_seed_and_prints_their_figures(ray_address, tmp_path):
    """Smallest settings: one seed, 2 trials of 4 steps (one batch, so nothing is pruned: the median pruner waits
    for 2 completed trials). Each study ran as a real CLI sweep in its own dir, and the figures are printed."""
    result = subprocess.run(
        [sys.executable, str(PRUNING), "--seeds", "0", "--trials", "2", "--steps", "4", "--keep", str(tmp_path)],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address}), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for pruner in ("none", "median"):
        assert (tmp_path / f"seed0_{pruner}" / "optimization_results.yaml").exists()
        assert re.search(rf"seed 0 {pruner} *: 2 trials, 0 pruned, 0 failed; steps 8 of 8; best [0-9.]+ \(trial \d\); wall [0-9.]+ s, jobs [0-9.]+ s", out), out
    assert "hydra.sweeper.pruner=median +hydra.sweeper.pruner_args.n_startup_trials=2" in out
    assert re.search(r"seed 0 median / none: steps 1\.000, wall [0-9.]+, jobs [0-9.]+, best [0-9.]+", out), out
    assert re.search(r"medians of the per-seed ratios .*\n  steps: 1\.000\n  wall: [0-9.]+\n  jobs: [0-9.]+\n  best: [0-9.]+\n", out), out
    assert "goal: at most 60 % of the steps: not met (100%)" in out and "keeps 2 trials running" in out


@pytest.mark.parametrize("server", [False, pytest.param(True, marks=pytest.mark.real)], ids=["journal", "postgres"])
def test_the_report_cost_benchmark_times_trial_reports_and_leaves_no_study_behind(server, request):
    import optuna

    url = request.getfixturevalue("postgres_url") if server else None
    storage = ["--storage", url] if server else []
    result = subprocess.run(
        [sys.executable, str(PRUNING), "--report-cost", "--calls", "3", *storage],
        cwd=REPO, env=environment(None), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "4 other completed trials of 3 evaluations each" in out
    assert re.search(r"open \(TrialReport[^)]*\), once per job: [0-9.]+ ms", out), out
    assert re.search(r"3 calls: median [0-9.]+ ms, p90 [0-9.]+ ms, worst [0-9.]+ ms; 0 said prune", out), out
    if server:
        password = url.split(":")[2].split("@")[0]
        assert password not in out and "***@127.0.0.1" in out
        assert not [name for name in optuna.get_all_study_names(url) if name.startswith("report-cost-")]
