"""Device, precision and attention choices, the GPU count, and verl's platform: every branch on CPU.

The decisions are pure functions of what this machine has (tinker_exp.runtime.device), tested here for the
machines we do not have; the thin parts run for real: the probe of this torch (a CPU build), a CLI run asking for
cuda, an nvidia-smi on PATH, verl's platform switched in one process, and Ray's GPU count on the shared cluster.
"""

from __future__ import annotations

import os
import warnings

import pytest

from helpers import compose, read_jsonl, run_cli, run_script
from tinker_exp import config
from tinker_exp.config.schema import CPU_FOREACH_EXACT
from tinker_exp.errors import ConfigError
from tinker_exp.runtime.device import (
    FLASH,
    SDPA,
    DeviceChoice,
    TorchBuild,
    check_gpus,
    check_own_cluster,
    check_placement,
    choose_attention,
    choose_device,
    choose_liger,
    choose_precision,
    needs_flash_probe,
    probe,
    resolve,
    throughput,
)

CPU_BUILD = TorchBuild(version="2.13.0+cpu", cuda=None)
CPU_BUILD_ON_GPU_MACHINE = TorchBuild(version="2.13.0+cpu", cuda=None, nvidia_smi="/usr/bin/nvidia-smi")
CUDA_BUILD_NO_GPU = TorchBuild(version="2.13.0+cu128", cuda="12.8")
CUDA_BUILD_NO_GPU_SMI = TorchBuild(version="2.13.0+cu128", cuda="12.8", nvidia_smi="/usr/bin/nvidia-smi")
H100 = TorchBuild("2.13.0+cu128", "12.8", gpus=8, capability=(9, 0), gpu_name="NVIDIA H100 80GB HBM3", nvidia_smi="/usr/bin/nvidia-smi")
A100 = TorchBuild("2.13.0+cu128", "12.8", gpus=1, capability=(8, 0), gpu_name="NVIDIA A100-SXM4-40GB")
V100 = TorchBuild("2.13.0+cu128", "12.8", gpus=4, capability=(7, 0), gpu_name="Tesla V100-SXM2-16GB")


# --- device -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [CPU_BUILD, CPU_BUILD_ON_GPU_MACHINE, CUDA_BUILD_NO_GPU, H100])
def test_cpu_asked_for_is_cpu_whatever_the_machine(build):
    assert choose_device("cpu", build) == ("cpu", None)


@pytest.mark.parametrize("build", [CPU_BUILD, CPU_BUILD_ON_GPU_MACHINE])
def test_cuda_with_a_cpu_build_of_torch_is_refused_naming_the_build(build):
    with pytest.raises(ConfigError) as info:
        choose_device("cuda", build)
    assert str(info.value) == (
        "backend.device=cuda: torch 2.13.0+cpu is not a CUDA build (torch.version.cuda is None); "
        "install a CUDA build of torch, or set backend.device=cpu"
    )


@pytest.mark.parametrize("build", [H100, A100, CUDA_BUILD_NO_GPU])
def test_cuda_with_a_cuda_build_is_cuda_ray_counts_the_gpus(build):
    # a driver that sees no GPU may drive a cluster's: check_gpus decides, on Ray's count
    assert choose_device("cuda", build) == ("cuda", None)


def test_auto_is_cuda_when_this_torch_sees_a_gpu():
    assert choose_device("auto", H100) == ("cuda", None)
    assert choose_device("auto", V100) == ("cuda", None)


def test_auto_without_any_gpu_is_cpu_silently():
    assert choose_device("auto", CPU_BUILD) == ("cpu", None)
    assert choose_device("auto", CUDA_BUILD_NO_GPU) == ("cpu", None)


def test_auto_on_a_gpu_machine_with_a_cpu_torch_warns_and_trains_on_cpu():
    device, warning = choose_device("auto", CPU_BUILD_ON_GPU_MACHINE)
    assert device == "cpu"
    assert warning == (
        "backend.device=auto: this machine has NVIDIA GPUs (/usr/bin/nvidia-smi) but torch 2.13.0+cpu is not a CUDA "
        "build: training on CPU (install a CUDA build of torch to use them; backend.device=cpu silences this)"
    )
    device, warning = choose_device("auto", CUDA_BUILD_NO_GPU_SMI)  # a driver mismatch, CUDA_VISIBLE_DEVICES=""
    assert device == "cpu" and "torch 2.13.0+cu128 (CUDA 12.8) sees no GPU: training on CPU" in warning


# --- precision ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requested, device, bf16, expected",
    [
        ("auto", "cpu", None, "fp32"),
        ("auto", "cuda", True, "bf16"),
        ("auto", "cuda", False, "fp32"),  # a V100: no native bf16
        ("auto", "cuda", None, "bf16"),  # GPUs not seen from the driver (a remote cluster)
        ("fp32", "cuda", True, "fp32"),
        ("fp32", "cpu", None, "fp32"),
        ("bf16", "cuda", True, "bf16"),
        ("bf16", "cuda", None, "bf16"),
        ("bf16", "cpu", None, "bf16"),  # slow and inexact, but it runs: asked for by name
    ],
)
def test_precision(requested, device, bf16, expected):
    assert choose_precision(requested, device, bf16) == expected


def test_bf16_on_a_gpu_without_it_is_refused():
    with pytest.raises(ConfigError, match=r"^backend.precision=bf16: GPU 0 \(Tesla V100\) has no native bf16 "):
        choose_precision("bf16", "cuda", False, "GPU 0 (Tesla V100)")


# --- attention ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device, precision, bf16, flash_attn, expected",
    [
        ("cuda", "bf16", True, True, FLASH),  # the one case for flash-attn
        ("cuda", "bf16", True, False, SDPA),  # not installed, or does not import against this torch
        ("cuda", "fp32", True, True, SDPA),  # flash-attn has no fp32 kernels: the first forward would fail
        ("cuda", "bf16", False, True, SDPA),  # a GPU without bf16
        ("cuda", "bf16", None, True, SDPA),  # a GPU not seen from the driver: not known to support it
        ("cpu", "bf16", None, True, SDPA),
        ("cpu", "fp32", None, True, SDPA),
    ],
)
def test_attention(device, precision, bf16, flash_attn, expected):
    assert choose_attention(device, precision, bf16, flash_attn) == expected


def test_flash_attn_is_looked_for_only_where_it_could_be_used():
    assert needs_flash_probe("cuda", "bf16", True)
    assert not any(needs_flash_probe(*case) for case in [("cuda", "fp32", True), ("cuda", "bf16", False), ("cpu", "bf16", None)])


@pytest.mark.parametrize(
    "requested, device, precision, bf16, flash_attn, expected",
    [
        ("sdpa", "cuda", "bf16", True, True, SDPA),  # asked for: taken, flash-attn or not
        ("eager", "cpu", "fp32", None, False, "eager"),
        ("flash_attention_2", "cuda", "bf16", True, True, FLASH),
        ("flash_attention_2", "cuda", "bf16", None, True, FLASH),  # GPUs not seen from the driver: the workers' call
    ],
)
def test_attention_asked_for(requested, device, precision, bf16, flash_attn, expected):
    assert choose_attention(device, precision, bf16, flash_attn, requested) == expected
    assert needs_flash_probe(device, precision, bf16, requested) == (requested == FLASH)


@pytest.mark.parametrize(
    "device, precision, bf16, flash_attn, why",
    [
        ("cuda", "bf16", True, False, "flash-attn is not importable here"),
        ("cuda", "fp32", True, True, r"it runs only for bf16 on a GPU with bf16 \(this run: cuda, fp32\)"),
        ("cpu", "fp32", None, True, r"it runs only for bf16 on a GPU with bf16 \(this run: cpu, fp32\)"),
    ],
)
def test_flash_attention_asked_for_where_it_cannot_run_is_refused(device, precision, bf16, flash_attn, why):
    with pytest.raises(ConfigError, match=rf"^backend.attention=flash_attention_2: {why}.*; use auto or sdpa$"):
        choose_attention(device, precision, bf16, flash_attn, "flash_attention_2")


def test_resolve_refuses_flash_attention_on_this_machine_before_any_worker():
    with pytest.raises(ConfigError, match="^backend.attention=flash_attention_2: it runs only for bf16"):
        resolve(backend(attention="flash_attention_2"), CPU_BUILD)
    assert resolve(backend(attention="eager"), CPU_BUILD) == DeviceChoice("cpu", "fp32", "eager")


# --- throughput knobs -------------------------------------------------------------------------------------------
def test_throughput_defaults_keep_cpu_runs_exact_and_choose_throughput_on_cuda():
    cpu, cuda = throughput(backend(), "cpu", "AdamW"), throughput(backend(), "cuda", "AdamW")
    fields = ("micro_batch_tokens", "padding_free", "gradient_checkpointing", "torch_compile", "fused_lm_head",
              "reshard_after_forward", "optimizer_kernel")  # fmt: skip
    # on cpu what every CPU run used before the knobs, but parameters kept gathered to the backward and foreach where
    # it steps bitwise as the for loop (tests/test_optimizers_ray.py): the CPU suite's losses stay bitwise
    assert [getattr(cpu, f) for f in fields] == [0, True, False, False, False, False, {"foreach": True}]
    for name in CPU_FOREACH_EXACT:
        assert throughput(backend(), "cpu", name).optimizer_kernel == {"foreach": True}
    for name in ("NAdam", "RAdam", "Muon", "an optimizer added later"):  # foreach not exact, or not checked
        assert throughput(backend(), "cpu", name).optimizer_kernel == {}
    assert [getattr(cuda, f) for f in fields] == [16384, False, False, True, True, True, {"fused": True}]  # sdpa: padded
    assert throughput(backend(), "cuda", "AdamW", FLASH).padding_free  # flash-attn's variable-length kernel
    assert throughput(backend(), "cuda", "Muon").optimizer_kernel == {}  # no fused kernel: torch's default
    assert throughput(backend(), "cuda", "RMSprop").optimizer_kernel == {}
    assert cuda.describe() == (
        "micro batches <= 16384 tokens, padding-free off, activation checkpointing off, torch.compile on, "
        "fused lm head on, reshard after forward on, optimizer kernel fused=True"
    )


@pytest.mark.parametrize(
    "values, device, field, expected",
    [
        ({"micro_batch_tokens": 4096}, "cpu", "micro_batch_tokens", 4096),
        ({"micro_batch_tokens": 0}, "cuda", "micro_batch_tokens", 0),
        ({"padding_free": "false"}, "cpu", "padding_free", False),
        ({"padding_free": "true"}, "cuda", "padding_free", True),
        ({"gradient_checkpointing": "true"}, "cpu", "gradient_checkpointing", True),
        ({"torch_compile": "false"}, "cuda", "torch_compile", False),
        ({"torch_compile": "true"}, "cpu", "torch_compile", True),
        ({"fused_lm_head": "true"}, "cpu", "fused_lm_head", True),
        ({"fused_lm_head": "false"}, "cuda", "fused_lm_head", False),
        ({"reshard_after_forward": "true"}, "cpu", "reshard_after_forward", True),
        ({"reshard_after_forward": "false"}, "cuda", "reshard_after_forward", False),
        ({"optimizer_kernel": "fused"}, "cpu", "optimizer_kernel", {"fused": True}),
        ({"optimizer_kernel": "for_loop"}, "cpu", "optimizer_kernel", {"foreach": False}),
        ({"optimizer_kernel": "foreach"}, "cuda", "optimizer_kernel", {"foreach": True}),
        ({"optimizer_kernel": "for_loop"}, "cuda", "optimizer_kernel", {"foreach": False}),
    ],
)
def test_throughput_knobs_asked_for_are_taken_on_either_device(values, device, field, expected):
    assert getattr(throughput(backend(**values), device, "AdamW"), field) == expected


def test_the_knobs_reach_verl_s_worker_config():
    """worker_config hands verl what `throughput` resolved: by tokens (training and validation), padding-free,
    checkpointing, compile, and the optimizer kernel beside the optimizer's own values."""
    from tinker_exp.config import LoraConfig, OptimizerConfig, TrainerConfig
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.workers import worker_config

    cfg = config.load(compose("backend.micro_batch_tokens=2048", "backend.gradient_checkpointing=true",
                              "backend.padding_free=false", "backend.optimizer_kernel=for_loop", "backend.fused_lm_head=true",
                              "backend.reshard_after_forward=true"))  # fmt: skip
    values = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    built = worker_config(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), values,
                          DeviceChoice("cpu", "fp32", SDPA), cfg.lora)  # fmt: skip
    engine, model = built.engine_config, built.model_config
    assert (engine.use_dynamic_bsz, engine.max_token_len_per_gpu, engine.infer_max_token_len_per_gpu) == (True, 2048, 2048)
    assert (model.use_remove_padding, model.enable_gradient_checkpointing, engine.use_torch_compile) == (False, True, False)
    assert engine.reshard_after_forward is True
    assert (model.use_fused_kernels, model.fused_kernel_options) == (True, {"impl_backend": "torch"})
    assert built.optimizer_config.override_optimizer_config == {"eps": 1e-8, "foreach": False}
    default = worker_config(cfg.backend.__class__(), OptimizerConfig(), TrainerConfig(), str(model_dir(cfg.model)), values,
                            DeviceChoice("cpu", "fp32", SDPA), LoraConfig())  # fmt: skip
    assert (default.engine_config.use_dynamic_bsz, default.engine_config.max_token_len_per_gpu) == (False, None)
    assert default.engine_config.reshard_after_forward is False  # cpu's default
    assert default.optimizer_config.override_optimizer_config == {"eps": 1e-8, "foreach": True}


def backend(**values):
    return config.load(compose(*(f"backend.{k}={v}" for k, v in values.items()))).backend


def test_resolve_puts_the_choices_together():
    assert resolve(backend(), CPU_BUILD) == DeviceChoice("cpu", "fp32", SDPA)
    assert resolve(backend(precision="fp32"), A100) == DeviceChoice("cuda", "fp32", SDPA)
    assert resolve(backend(device="cpu"), H100) == DeviceChoice("cpu", "fp32", SDPA)
    assert resolve(backend(), V100) == DeviceChoice("cuda", "fp32", SDPA)
    # on an H100 flash-attn is asked for; this machine has none (transformers says so): sdpa
    assert resolve(backend(), H100) == DeviceChoice("cuda", "bf16", SDPA)
    with pytest.raises(ConfigError, match=r"backend.precision=bf16: GPU 0 \(Tesla V100-SXM2-16GB\) has no native bf16"):
        resolve(backend(precision="bf16"), V100)
    with pytest.warns(UserWarning, match=r"backend.device=auto: this machine has NVIDIA GPUs"):
        assert resolve(backend(), CPU_BUILD_ON_GPU_MACHINE) == DeviceChoice("cpu", "fp32", SDPA)


@pytest.mark.parametrize(
    "requested, device, importable, expected",
    [
        (None, "cuda", True, True), (None, "cuda", False, False), (None, "cpu", True, False), (False, "cuda", True, False),
        (True, "cuda", True, True), (False, "cpu", False, False),
        (True, "cpu", True, "backend.liger=true: its kernels are Triton, for GPUs only (this run: cpu); use null (auto) or false"),
        (True, "cuda", False, "backend.liger=true: liger_kernel does not import here (pip install liger-kernel); use null (auto) or false"),
    ],
)  # fmt: skip
def test_liger_is_on_where_it_can_run_and_refused_where_asked_for_and_it_cannot(requested, device, importable, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as refused:
            choose_liger(requested, device, importable)
        assert str(refused.value) == expected
    else:
        assert choose_liger(requested, device, importable) is expected


def test_liger_on_cpu_is_refused_before_ray_and_auto_leaves_it_off_here():
    """This machine: a CPU run (liger_kernel or not, Triton needs a GPU); the worker config says what was chosen."""
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.workers import worker_config

    with pytest.raises(ConfigError, match=r"^backend.liger=true: its kernels are Triton, for GPUs only \(this run: cpu\)"):
        resolve(backend(liger="true"), CPU_BUILD)
    choice = resolve(backend(), CPU_BUILD)
    assert choice.liger is False and choice.describe() == "cpu, fp32, attention sdpa"
    assert DeviceChoice("cuda", "bf16", SDPA, liger=True).describe() == "cuda, bf16, attention sdpa, Liger kernels"
    cfg = config.load(compose())
    values = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    for liger in (False, True):
        built = worker_config(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), values,
                              DeviceChoice("cuda", "bf16", SDPA, liger), cfg.lora)  # fmt: skip
        assert built.model_config.use_liger is liger


# --- the real probe, this machine -----------------------------------------------------------------------------
def test_the_probe_reads_this_torch():
    import torch

    build = probe()
    assert build.version == torch.__version__ and build.cuda == torch.version.cuda
    if build.gpus:
        assert build.capability is not None and build.gpu_name
    else:
        assert build.capability is None and build.bf16 is None


def test_an_nvidia_smi_on_path_is_seen_and_with_a_cpu_torch_warns(tmp_path, monkeypatch):
    import torch

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    build = probe()
    assert build.nvidia_smi == str(smi)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = resolve(backend(), build)
    said = [str(w.message) for w in caught if "backend.device=auto" in str(w.message)]
    if torch.version.cuda is None:  # ours: a CPU build
        assert choice == DeviceChoice("cpu", "fp32", SDPA)
        assert len(said) == 1 and f"({smi}) but torch {torch.__version__} is not a CUDA build: training on CPU" in said[0]
    else:  # a CUDA build: cuda when it sees a GPU, else the warning
        assert (choice.device, bool(said)) == (("cuda", False) if build.gpus else ("cpu", True))


def test_cuda_asked_for_with_this_torch(tmp_path):
    """A CPU build (ours): the CLI stops before Ray starts, naming the build. A CUDA build: cuda is chosen."""
    import torch

    if torch.version.cuda is not None:
        assert resolve(backend(device="cuda")).device == "cuda"
        return
    result = run_cli("backend.device=cuda", "trainer.steps=2", f"hydra.run.dir={tmp_path}", env={"RAY_ADDRESS": None})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"tinker_exp: config error: backend.device=cuda: torch {torch.__version__} is not a CUDA build "
        "(torch.version.cuda is None); install a CUDA build of torch, or set backend.device=cpu"
    ]
    assert not (tmp_path / "workers.log").exists()  # Ray never connected: no worker output was ever routed


# --- GPU count --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "per_node, workers, nodes",
    [([1], 1, 1), ([8], 8, 1), ([8], 2, 1), ([8, 8], 8, 2), ([4, 8], 4, 2), ([8], 4, 2), ([0, 2, 2], 2, 2)],
)
def test_gpus_enough_for_every_placement_group(per_node, workers, nodes):
    check_gpus(per_node, workers, nodes)


def test_two_workers_on_a_one_gpu_machine_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        check_gpus([1.0], 2, 1)
    assert str(info.value) == (
        "backend.num_workers=2: 2 workers need 2 GPUs on each of 1 node(s), but Ray reports GPUs per node: 1; "
        "set backend.num_workers=1"
    )


def test_a_cluster_of_the_runs_own_is_checked_against_this_machines_gpus_before_ray_starts():
    """No backend.ray_address, one node: the run's own cluster gets the GPUs the driver sees, so too many workers are
    refused before the run's record is written (check_gpus' line); a cluster joined or several nodes: checked once
    Ray reports them."""
    backend = config.load(compose("backend.num_workers=2")).backend
    with pytest.raises(ConfigError, match=r"^backend.num_workers=2: 2 workers need 2 GPUs on each of 1 node\(s\), .*: 1; set backend.num_workers=1$"):
        check_own_cluster(backend, 1)
    check_own_cluster(backend, 2)
    for joined in ("backend.ray_address=10.0.0.1:6379", "backend.nodes=2"):
        check_own_cluster(config.load(compose("backend.num_workers=2", joined)).backend, 1)


@pytest.mark.parametrize(
    "per_node, workers, nodes, message",
    [
        ([], 1, 1, "but Ray reports GPUs per node: none$"),
        ([0], 1, 1, "but Ray reports GPUs per node: 0$"),
        ([8, 4], 8, 2, r"^backend.num_workers=8 x backend.nodes=2: 16 workers need 8 GPUs on each of 2 node\(s\), but Ray reports GPUs per node: 8, 4$"),
        ([6], 4, 2, r"need 4 GPUs on each of 2 node\(s\), but Ray reports GPUs per node: 6$"),  # 8 GPUs, but not 2 x 4 on a node
    ],
)
def test_too_few_gpus_is_a_clear_error(per_node, workers, nodes, message):
    with pytest.raises(ConfigError, match=message):
        check_gpus(per_node, workers, nodes)


# --- where each rank's model ended up ---------------------------------------------------------------------------
def gpu_rank(rank: int, parameters: str | None = None, platform: str = "cuda") -> dict:
    """A rank's report as TinkerExpWorker.device_info gives it on a GPU machine (Ray sets CUDA_VISIBLE_DEVICES)."""
    return {"platform": platform, "parameters": parameters or "cuda:0", "cuda_device": 0, "visible": str(rank), "attention": FLASH}


def test_each_rank_on_its_own_gpu_is_summarised():
    summary = check_placement("cuda", [gpu_rank(0), gpu_rank(1)])
    assert summary == "2 rank(s) on cuda:0 (CUDA_VISIBLE_DEVICES=0), cuda:0 (CUDA_VISIBLE_DEVICES=1); attention flash_attention_2"
    assert check_placement("cpu", [{"platform": "cpu", "parameters": "cpu", "attention": SDPA}] * 2) == "2 rank(s) on cpu; attention sdpa"


@pytest.mark.parametrize(
    "device, rank1, message",
    [
        ("cuda", gpu_rank(1, parameters="cpu"), "rank 1: parameters on cpu, but its current CUDA device is 0"),
        ("cuda", gpu_rank(1, parameters="cuda:1"), "rank 1: parameters on cuda:1, but its current CUDA device is 0"),
        ("cuda", gpu_rank(1, platform="cpu"), "rank 1: verl's platform is cpu, not cuda"),
        ("cpu", {"platform": "cpu", "parameters": "cuda:0"}, "rank 1: parameters on cuda:0, not cpu"),
    ],
)
def test_a_rank_off_its_device_stops_the_run_naming_it(device, rank1, message):
    rank0 = gpu_rank(0) if device == "cuda" else {"platform": "cpu", "parameters": "cpu"}
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        check_placement(device, [rank0, rank1])


# --- verl's platform in one process, Ray's GPU count --------------------------------------------------------------
def test_verl_platform_follows_each_run_in_one_process(tmp_path):
    """A CPU run leaves VERL_PLATFORM=cpu and verl's cached platform behind; a cuda run after it must get GPU
    bundles, and a CPU run after that CPU ones again (in a process of its own, forked from the CLI zygote: verl's
    cache is per process, and there it is a CPU run's, as a run's is once it has started its workers)."""
    code = """
import os
from tinker_exp.runtime.workers import use_platform, platform_env
from verl.plugin.platform import get_platform
from verl.utils.device import get_resource_name
use_platform("cpu")
print(os.environ["VERL_PLATFORM"], get_platform().device_name, get_resource_name())
use_platform("cuda")
print(os.environ["VERL_PLATFORM"], get_platform().device_name, get_resource_name(), platform_env("cuda")["VERL_PLATFORM"])
use_platform("cpu")
print(os.environ["VERL_PLATFORM"], get_platform().device_name, get_resource_name())
"""
    (tmp_path / "platforms.py").write_text(code)
    out = run_script(tmp_path / "platforms.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["cpu cpu CPU", "nvidia cuda GPU nvidia", "cpu cpu CPU"]


def test_workers_asking_for_more_gpus_than_ray_has_fail_before_any_placement_group(ray_address, tmp_path):
    """The shared Ray cluster has no GPU: 2 cuda workers (the default) are refused at once, in this process, and
    a CPU run after it in the same process trains (verl's platform put back)."""
    import ray

    from tinker_exp.runtime.workers import TinkerWorkers

    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import model_dir

    cfg = config.load(compose("trainer.steps=2", "logger=none"))
    values = validate(cfg).optimizer_values
    groups_before = len(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match=r"^backend.num_workers=2: 2 workers need 2 GPUs on each of 1 node\(s\), but Ray reports GPUs per node: 0$"):
        TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), values, DeviceChoice("cuda", "bf16", SDPA))
    assert len(ray.util.placement_group_table()) == groups_before  # nothing asked of Ray's scheduler
    from verl.plugin.platform import get_platform

    assert get_platform().device_name == "cuda"  # what that cuda attempt's bundles would have asked for

    from tinker_exp.run import run

    run(compose("trainer.steps=2", "logger=none", "checkpoint.at_end=false", "data.val_fraction=null", "backend.num_workers=1"), tmp_path)
    assert get_platform().device_name == "cpu"
    assert [row["train/step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
