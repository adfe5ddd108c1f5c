"""Which device, precision and attention a run uses, and whether the cluster can hold its workers.

The decisions are pure functions of what was asked for and what this machine has (a `TorchBuild`, the GPUs Ray
reports), so every branch is tested on CPU; `probe()` and `flash_attn_usable()` are the thin parts that look at
the real torch, GPU and flash-attn. All of it runs before Ray starts (the GPU count: before any worker starts).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

from tinker_exp.config import BackendConfig
from tinker_exp.errors import ConfigError

SDPA = "sdpa"
FLASH = "flash_attention_2"


@dataclass(frozen=True)
class TorchBuild:
    """What the driver's torch is and sees."""

    version: str
    """torch.__version__ (2.13.0+cpu, 2.13.0+cu128)."""
    cuda: str | None
    """torch.version.cuda: None for a CPU (or ROCm) build."""
    gpus: int = 0
    """CUDA GPUs this process sees."""
    capability: tuple[int, int] | None = None
    """GPU 0's compute capability (None: no GPU seen)."""
    gpu_name: str | None = None
    nvidia_smi: str | None = None
    """Path of nvidia-smi, if on PATH: a machine with NVIDIA GPUs, whatever torch can use."""

    @property
    def bf16(self) -> bool | None:
        """Native bf16 (Ampere, compute capability 8.0, and later); None when no GPU is seen from here."""
        return None if self.capability is None else self.capability >= (8, 0)

    def describe(self) -> str:
        if not self.gpus:
            return f"torch {self.version}"
        return f"torch {self.version}, {self.gpus} GPU(s): {self.gpu_name} (compute capability {self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class DeviceChoice:
    """The resolved backend: what the workers are built with."""

    device: str  # cpu | cuda
    precision: str  # fp32 | bf16
    attention: str  # sdpa | flash_attention_2
    liger: bool = False  # Liger's kernels patched in (backend.liger)

    def describe(self) -> str:
        return f"{self.device}, {self.precision}, attention {self.attention}" + (", Liger kernels" if self.liger else "")


def choose_device(requested: str, build: TorchBuild) -> tuple[str, str | None]:
    """backend.device -> (cpu or cuda, a warning or None).

    cuda with a torch that cannot drive CUDA is refused here: verl would ask for cuda:nccl inside every worker and crash
    there."""
    if requested == "cpu":
        return "cpu", None
    if requested == "cuda":
        if build.cuda is None:
            raise ConfigError(
                f"backend.device=cuda: torch {build.version} is not a CUDA build (torch.version.cuda is None); "
                "install a CUDA build of torch, or set backend.device=cpu"
            )
        return "cuda", None  # a CUDA build seeing no GPU here may drive the GPUs of a cluster: Ray's count decides
    if build.cuda is not None and build.gpus > 0:
        return "cuda", None
    if build.nvidia_smi:
        why = "is not a CUDA build" if build.cuda is None else f"(CUDA {build.cuda}) sees no GPU"
        return "cpu", (
            f"backend.device=auto: this machine has NVIDIA GPUs ({build.nvidia_smi}) but torch {build.version} {why}: "
            "training on CPU (install a CUDA build of torch to use them; backend.device=cpu silences this)"
        )
    return "cpu", None


def choose_precision(requested: str, device: str, bf16: bool | None, gpu: str = "GPU 0") -> str:
    """backend.precision -> fp32 or bf16.

    auto: bf16 on a GPU with native bf16 (or one not seen from the driver), else fp32. bf16 asked for on a GPU without
    it is refused (emulated, slow, some kernels missing)."""
    if requested == "auto":
        return "bf16" if device == "cuda" and bf16 is not False else "fp32"
    if requested == "bf16" and device == "cuda" and bf16 is False:
        raise ConfigError(f"backend.precision=bf16: {gpu} has no native bf16 (compute capability < 8.0); use fp32 or auto")
    return requested


def choose_attention(device: str, precision: str, bf16: bool | None, flash_attn: bool, requested: str = "auto") -> str:
    """backend.attention -> the attention transformers builds.

    auto: flash-attn only for bf16 on a GPU known to support it, when it imports against this torch (it has no fp32
    kernels: precision=fp32 would fail at the first forward); torch's SDPA everywhere else. flash_attention_2 asked for
    where it cannot run is refused; sdpa and eager are taken as asked."""
    can_flash = device == "cuda" and precision == "bf16" and bf16 is not False
    if requested == "auto":
        return FLASH if can_flash and bf16 is True and flash_attn else SDPA
    if requested == FLASH and not (can_flash and flash_attn):
        why = (
            "flash-attn is not importable here (transformers' is_flash_attn_2_available, or its CUDA extension)"
            if can_flash
            else f"it runs only for bf16 on a GPU with bf16 (this run: {device}, {precision})"
        )
        raise ConfigError(f"backend.attention=flash_attention_2: {why}; use auto or sdpa")
    return requested


def choose_liger(requested: bool | None, device: str, importable: bool) -> bool:
    """backend.liger -> whether verl patches Liger's kernels in.

    None: on cuda when liger_kernel imports; true where it cannot run is refused (its kernels are Triton: a CPU run
    would fail in every worker's model build)."""
    if requested is None:
        return device == "cuda" and importable
    if requested and not (device == "cuda" and importable):
        why = ("liger_kernel does not import here (pip install liger-kernel)" if device == "cuda"
               else f"its kernels are Triton, for GPUs only (this run: {device})")  # fmt: skip
        raise ConfigError(f"backend.liger=true: {why}; use null (auto) or false")
    return requested


def needs_flash_probe(device: str, precision: str, bf16: bool | None, requested: str = "auto") -> bool:
    """Whether flash-attn's availability matters (importing it costs time: only ask when it could be used)."""
    if requested not in ("auto", FLASH):
        return False
    return device == "cuda" and precision == "bf16" and bf16 is not False and (bf16 is True or requested == FLASH)


def check_gpus(per_node: Sequence[float], num_workers: int, nodes: int) -> None:
    """Refuse a cluster that cannot hold `nodes` placement groups of `num_workers` one-GPU workers each.

    Each node's placement group packs `num_workers` one-GPU workers onto one node (verl's STRICT_PACK), and there are
    `nodes` of them: a cluster that cannot hold them would leave Ray waiting forever."""
    groups = sum(int(gpus // num_workers) for gpus in per_node)
    if groups >= nodes:
        return
    over = f"backend.num_workers={num_workers}" + (f" x backend.nodes={nodes}" if nodes > 1 else "")
    have = ", ".join(f"{gpus:g}" for gpus in per_node) or "none"
    hint = f"; set backend.num_workers={int(max(per_node))}" if nodes == 1 and per_node and max(per_node) >= 1 else ""
    raise ConfigError(
        f"{over}: {num_workers * nodes} workers need {num_workers} GPUs on each of {nodes} node(s), but Ray reports "
        f"GPUs per node: {have}{hint}"
    )


def check_own_cluster(backend: BackendConfig, gpus: int) -> None:
    """Refuse more cuda workers than the `gpus` this machine shows, for a run that starts its own Ray cluster.

    Such a run (no backend.ray_address, one node) gets the GPUs this machine shows its driver: more workers than that
    are refused before the run's record is written, as check_gpus would refuse them once Ray reports the same GPUs (a
    cluster joined is checked then)."""
    if not backend.ray_address and backend.nodes == 1:
        check_gpus([gpus], backend.num_workers, 1)


def check_placement(device: str, ranks: Sequence[dict], nodes: int = 1) -> str:
    """Check each rank's report (TinkerExpWorker.device_info) against the device asked for.

    Checked: verl's platform, on cuda parameters on the rank's own current GPU, and the ranks spread over `nodes` Ray
    nodes. Returns a one-line summary; raises RuntimeError naming the rank."""
    for rank, info in enumerate(ranks):
        where = info.get("parameters", "?")
        if info.get("platform") != device:
            raise RuntimeError(f"rank {rank}: verl's platform is {info.get('platform')}, not {device}")
        if device == "cuda" and where != f"cuda:{info.get('cuda_device')}":
            raise RuntimeError(f"rank {rank}: parameters on {where}, but its current CUDA device is {info.get('cuda_device')}")
        if device == "cpu" and where != "cpu":
            raise RuntimeError(f"rank {rank}: parameters on {where}, not cpu")
    attention = sorted({str(info.get("attention")) for info in ranks})
    if device == "cuda":
        gpus = ", ".join(f"{info['parameters']} (CUDA_VISIBLE_DEVICES={info.get('visible')})" for info in ranks[:8])
        where = f"{gpus}{', ...' if len(ranks) > 8 else ''}"
    else:
        where = "cpu"
    spanned = {tuple(info["node"]) for info in ranks if info.get("node")}
    if nodes > 1 and len(spanned) != nodes:  # a node's Ray took more than its allocation (--num-cpus/--num-gpus)
        raise RuntimeError(f"backend.nodes={nodes}, but the {len(ranks)} ranks run on {len(spanned)} Ray node(s)")
    if len(spanned) > 1:  # which rank runs where: Ray node id (short) and host or Slurm node
        where += "; Ray nodes: " + ", ".join(f"rank {r} {info['node'][1]} ({info['node'][0][:8]})" for r, info in enumerate(ranks[:16]))
    return f"{len(ranks)} rank(s) on {where}; attention {', '.join(attention)}"


def resolve(backend: BackendConfig, build: TorchBuild | None = None) -> DeviceChoice:
    """The whole choice for a run (warnings as Python warnings); `build`: None probes this machine."""
    build = probe() if build is None else build
    device, warning = choose_device(backend.device.value, build)
    if warning:
        warnings.warn(warning, stacklevel=2)
    gpu = f"GPU 0 ({build.gpu_name})" if build.gpu_name else "GPU 0"
    precision = choose_precision(backend.precision.value, device, build.bf16, gpu)
    requested = backend.attention.value
    flash = needs_flash_probe(device, precision, build.bf16, requested) and flash_attn_usable()
    attention = choose_attention(device, precision, build.bf16, flash, requested)
    liger = choose_liger(backend.liger, device, device == "cuda" and backend.liger is not False and liger_usable())
    return DeviceChoice(device, precision, attention, liger)


def check_cpu_settings(backend: BackendConfig) -> None:
    """Refuse GPU-only settings with backend.device=cpu, resolved without torch.

    No build can change a CPU run's choice: a GPU-only setting asked for with it (flash_attention_2) is refused by a dry
    run, and before a warm pool's run is recorded, as by a run."""
    if backend.device.value == "cpu":
        resolve(backend, TorchBuild(version="(not asked)", cuda=None))


def probe() -> TorchBuild:
    """This process's torch and GPUs (device properties only: no tensor is put on a GPU)."""
    import shutil

    import torch

    gpus = torch.cuda.device_count() if torch.version.cuda else 0
    return TorchBuild(
        version=torch.__version__,
        cuda=torch.version.cuda,
        gpus=gpus,
        capability=tuple(torch.cuda.get_device_capability(0)) if gpus else None,
        gpu_name=torch.cuda.get_device_name(0) if gpus else None,
        nvidia_smi=shutil.which("nvidia-smi"),
    )


def flash_attn_usable() -> bool:
    """Whether flash-attn can be used: transformers' own check (package, version, CUDA), then the import itself.

    A wheel built against another torch is found by find_spec but fails to load its CUDA extension."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401  (loads flash_attn_2_cuda)
    except Exception as e:  # ImportError, OSError (undefined symbol): any of them means no flash-attn here
        warnings.warn(f"flash-attn is installed but does not import ({type(e).__name__}: {e}); using sdpa", stacklevel=2)
        return False
    return True


def liger_usable() -> bool:
    """Whether Liger's kernels import here (liger_kernel and the Triton it runs on)."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance  # noqa: F401  (what verl calls)
    except Exception:  # not installed, or no Triton for this torch
        return False
    return True


@dataclass(frozen=True)
class Throughput:
    """The throughput knobs of a run (backend.micro_batch_tokens, ...), resolved for its device.

    What `worker_config` hands verl. Pure: tested on CPU for both devices."""

    micro_batch_tokens: int
    """0: micro batches of backend.micro_batch_size sequences; else verl's use_dynamic_bsz at this many tokens."""
    padding_free: bool
    gradient_checkpointing: bool
    torch_compile: bool
    fused_lm_head: bool
    reshard_after_forward: bool
    optimizer_kernel: dict[str, bool]
    """Keyword arguments for the torch optimizer ({"fused": True}, {"foreach": False}, ...; {}: torch's default)."""

    def describe(self) -> str:
        batches = f"micro batches <= {self.micro_batch_tokens} tokens" if self.micro_batch_tokens else "micro batches by sequences"
        kernel = ", ".join(f"{k}={v}" for k, v in self.optimizer_kernel.items()) or "torch's default"
        return (
            f"{batches}, padding-free {'on' if self.padding_free else 'off'}, activation checkpointing "
            f"{'on' if self.gradient_checkpointing else 'off'}, torch.compile {'on' if self.torch_compile else 'off'}, "
            f"fused lm head {'on' if self.fused_lm_head else 'off'}, reshard after forward {'on' if self.reshard_after_forward else 'off'}, optimizer kernel {kernel}"
        )


def throughput(backend: BackendConfig, device: str, optimizer_name: str, attention: str = SDPA) -> Throughput:
    """backend's throughput knobs for `device`, optimizer.name and the attention chosen, auto values resolved.

    `device`: cpu or cuda. On cpu every default steps bitwise as the plain settings do (by sequences, padding-free, no
    checkpointing, no compile, the for loop, resharded after forward): the two defaults that differ there, being faster,
    parameters kept gathered to the backward and foreach where it is exact (CPU_FOREACH_EXACT), move data or batch the
    same operations only (tests/test_optimizers_ray.py checks both bitwise)."""
    from tinker_exp.config.schema import CPU_FOREACH_EXACT, FUSED_OPTIMIZERS, OptimizerKernel

    kernel = backend.optimizer_kernel
    if kernel is OptimizerKernel.auto and device == "cuda":
        kwargs = {"fused": True} if optimizer_name in FUSED_OPTIMIZERS else {}
    elif kernel is OptimizerKernel.auto:  # cpu: torch's own default there is the for loop
        kwargs = {"foreach": True} if optimizer_name in CPU_FOREACH_EXACT else {}
    elif kernel is OptimizerKernel.fused:
        kwargs = {"fused": True}
    elif kernel is OptimizerKernel.foreach:
        kwargs = {"foreach": True}
    else:
        kwargs = {"foreach": False}
    compile_ = device == "cuda" if backend.torch_compile is None else backend.torch_compile
    return Throughput(
        micro_batch_tokens=backend.tokens_per_micro_batch(device),
        padding_free=(device == "cpu" or attention == FLASH) if backend.padding_free is None else backend.padding_free,
        gradient_checkpointing=backend.gradient_checkpointing,
        torch_compile=compile_,
        fused_lm_head=device == "cuda" if backend.fused_lm_head is None else backend.fused_lm_head,
        reshard_after_forward=device == "cuda" if backend.reshard_after_forward is None else backend.reshard_after_forward,
        optimizer_kernel=kwargs,
    )
