"""A CPU platform for verl 0.9.1, registered through verl's own plugin hook.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at ``import verl``; ``VERL_PLATFORM=cpu``
then selects this platform (see ``tinker_exp.runtime.workers.platform_env``). Without it verl falls back to
'nvidia', calls torch.cuda and asks for NCCL. No verl file is patched.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Optional

import psutil
import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the torch.cuda-style calls verl makes every step (memory stats, rng, ...)."""

    def __init__(self) -> None:
        super().__init__("tinker_exp_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    # Memory statistics: CPU memory is not an accelerator pool; report what the process uses.
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return psutil.Process().memory_info().rss

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"  # verl's flops table has a CPU entry (for mfu)

    @staticmethod
    def empty_cache() -> None: ...

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None: ...

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None: ...

    @staticmethod
    def synchronize(device: Any = None) -> None: ...

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


CPU_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Only when asked for by name (VERL_PLATFORM=cpu): never shadow a real accelerator.
        return os.environ.get("VERL_PLATFORM", "").lower() == "cpu"

    def current_device(self) -> str:
        # verl uses this as a `.to(...)` target (get_device_id()); an int would mean cuda:N.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None: ...

    def synchronize(self, device_index: Optional[int] = None) -> None: ...

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None: ...

    def empty_cache(self) -> None: ...

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "TINKER_EXP_VISIBLE_CPUS"  # nothing to hide on CPU; verl only reads it

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None: ...

    def profiler_stop(self) -> None: ...

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
