"""LoRA through verl (peft): the HFModelConfig fields, the check before launch, the adapter export on the workers.

verl 0.9.1's FSDP engine wraps the model with ``peft.get_peft_model(LoraConfig(...))`` when ``lora_rank > 0``
(../shared/design/verl-engine-facts.md, "LoRA"); nothing in the Tinker path changes. Its optimizer keeps one
param group over every parameter: the frozen base weights sit in it without gradients, so overrides and their
read-back work as with full fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_exp.config import LoraConfig
from tinker_exp.errors import ConfigError


def model_config_fields(lora: LoraConfig | None) -> dict[str, Any]:
    """verl's HFModelConfig LoRA fields; {} for full fine-tuning (verl's own defaults then apply)."""
    if lora is None or lora.rank == 0:
        return {}
    return {
        "lora_rank": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": lora.target_modules,
        "exclude_modules": lora.exclude_modules,
    }


def peft_config(lora: LoraConfig):
    """The peft LoraConfig verl builds from those fields (FSDPEngine._build_lora_module)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    return PeftLoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        exclude_modules=lora.exclude_modules,
        bias="none",
    )


@dataclass
class LoraSize:
    trainable: int
    total: int

    def __str__(self) -> str:
        return f"{self.trainable:,} trainable of {self.total:,} parameters ({100 * self.trainable / self.total:.2f}%)"


def check(lora: LoraConfig, model_path: Path) -> LoraSize:
    """Check the LoRA settings against the model's architecture and return the adapters' size.

    peft on the model's architecture built on the meta device (no weights read, no memory): a listed module name that
    matches nothing, or targets that leave no module, are a ConfigError here, not a failure on every worker after
    launch."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = [name for name, _ in model.named_modules() if name]
    for key, value in (("lora.target_modules", lora.target_modules), ("lora.exclude_modules", lora.exclude_modules)):
        for wanted in value if isinstance(value, list) else []:  # peft lets a list's typo pass if another name matches
            if not any(name == wanted or name.endswith(f".{wanted}") for name in names):
                leaves = sorted({name.rsplit(".", 1)[-1] for name in names} - {str(i) for i in range(len(names))})
                raise ConfigError(f"{key}: {wanted!r} matches no module of {model_path} (names: {', '.join(leaves)})")
    try:
        peft_model = get_peft_model(model, peft_config(lora))
    except ValueError as e:
        why = " ".join(str(e).split())
        raise ConfigError(
            f"lora.target_modules={lora.target_modules!r}, lora.exclude_modules={lora.exclude_modules!r}: {why}"
        ) from None
    return LoraSize(*peft_model.get_nb_trainable_parameters())


def export_adapter(module, folder: str) -> int | None:
    """Export the trained adapter: rank 0 writes `folder` with peft; called on every rank.

    FSDP2 keeps each adapter tensor sharded over the ranks: the gather is collective. Returns the number of adapter
    parameters on rank 0, None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    state = {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
        for name, tensor in module.state_dict().items()  # the same order on every rank
        if "lora_" in name
    }
    if dist.get_rank() != 0:
        return None
    # peft's own writer: keeps the lora_ entries, drops the adapter name from the keys, adds adapter_config.json
    module.save_pretrained(folder, state_dict=state)
    return sum(tensor.numel() for tensor in state.values())



def init_adapters(module, seed: int) -> None:
    """A trial's initial adapters, the one rule for every path (a cold build, a pool's fresh start, a slot's fill).

    Drawn from a generator seeded with the trial's `seed`, in the module's parameter order, as peft draws them (lora_A:
    kaiming-uniform with a = sqrt(5); lora_B: zeros; an embedding's A zeros and B normal), not from torch's global RNG
    as peft does, so that K slots on one built model each start as their own cold run would: a global draw depends on
    everything the build drew before it. Every rank draws the full tensors and keeps its own shards (no communication).
    Full fine-tuning (no adapters): nothing."""
    import math

    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" not in name:
                continue
            full = torch.zeros(parameter.shape, dtype=torch.float32)
            if "lora_A" in name:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            elif "lora_embedding_B" in name:
                torch.nn.init.normal_(full, generator=generator)
            full = full.to(device=parameter.device, dtype=parameter.dtype)
            if isinstance(parameter, DTensor):
                full = distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None)
            parameter.copy_(full)



def start_trial(module, seed: int) -> None:
    """A trial's start on a built model: its initial adapters and torch's RNG seeded with `seed`.

    The adapters by `init_adapters`, the one rule. A cold build, a pool's rebuild for another seed and a slot's fill all
    end here, so each starts bitwise where the others do."""
    import torch

    init_adapters(module, seed)
    torch.manual_seed(seed)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """An adapter as export_adapter writes it (peft's format), read back.

    Each adapted layer's (A, B) by the base weight it adapts, and its scale (lora_alpha / r). What an RL run's workers
    export to the driver's sampler."""

    layers: dict[str, tuple[Any, Any]]
    """'<module>.weight' (the base model's name) -> (lora_A, lora_B)."""
    scale: float

    @classmethod
    def read(cls, folder: Path) -> "Adapter":
        import json

        from safetensors.torch import load_file

        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(folder / ADAPTER_WEIGHTS)
        layers = {
            key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight": (a, tensors[key.replace(".lora_A.", ".lora_B.")])
            for key, a in tensors.items() if key.endswith(".lora_A.weight")
        }  # fmt: skip
        return cls(layers, config["lora_alpha"] / config["r"])

    def merged(self, base: dict[str, Any]) -> dict[str, Any]:
        """The adapted layers' weights, merged in float32: W + (B @ A) * scale (`base` holds at least those)."""
        return {name: (base[name].float() + (b.float() @ a.float()) * self.scale).to(base[name].dtype)
                for name, (a, b) in self.layers.items()}


def merge_adapter(base: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The model's tensors with the adapter in `folder` merged in float32; `base` is left as it is.

    The adapter in peft's format, as export_adapter writes it: W + (B @ A) * lora_alpha / r for each adapted layer."""
    return {**base, **Adapter.read(folder).merged(base)}
