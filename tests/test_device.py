"""Device, precision and attention choices and the GPU count: every branch on CPU (pure functions of what the
machine has, tinker_exp.runtime.device), and the probe of this machine's torch."""

from __future__ import annotations

import pytest

from helpers import compose
from tinker_exp import config
from tinker_exp.errors import ConfigError
from tinker_exp.runtime.device import (
    FLASH,
    SDPA,
    DeviceChoice,
    TorchBuild,
    check_gpus,
    choose_attention,
    choose_device,
    choose_precision,
    needs_flash_probe,
    probe,
    resolve,
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


# --- the real probe, this machine -----------------------------------------------------------------------------
def test_the_probe_reads_this_torch():
    import torch

    build = probe()
    assert build.version == torch.__version__ and build.cuda == torch.version.cuda
    if build.gpus:
        assert build.capability is not None and build.gpu_name
    else:
        assert build.capability is None and build.bf16 is None


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
