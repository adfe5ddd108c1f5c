"""hydra.launcher.slots=auto: how many LoRA trials a sweep trains at once on one group (docs/slots.md).

Pure Python: the rule reads the sweep's points (their typed configs), which keys it sweeps, and the memory free
where the group will live (tinker_exp/memory.py); the launchers (hydra_plugins/tinker_exp_plugins) apply it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from tinker_exp.config.validate import why_not_on_slot
from tinker_exp.memory import MEMORY_SHARE

AUTO = "auto"
"""hydra.launcher.slots's default: slots where the sweep's trials can share a group, as many as memory holds."""
AUTO_SLOTS_MAX = 8
"""auto: at most this many trials at once on a group. A packed round of 8 slots costs about 0.4 of their 8 steps
time-shared on this project's CPU workers, of 16 about 0.37 (docs/slots.md): past 8 a slot buys little there, and
every trial more at once is one finished trial fewer for a model-based sampler (TPE, GP) to learn from."""
SHAPE_KEYS = ("lora", "model", "env", "backend.nodes")
"""Swept keys (and their sub-keys) that keep auto at one trial a group: trials of other LoRA shapes or models cannot
share a group (a group holds one base model and slots of one shape), and one over several nodes cannot take a slot
at all."""
ACTIVATION_BYTES_16BIT = 34
"""Bytes a decoder layer keeps per token and hidden unit for its backward, at 16-bit activations without
recomputation (Korthikanti et al. 2022, the s*b*h term; flash attention drops the s^2 one)."""


def auto_slots(configs: Sequence[Any], trials: int, swept: Iterable[str], at_most: int | None, free_mb: float | None,
               device: str) -> tuple[int, str]:  # fmt: skip
    """(K, why) for hydra.launcher.slots=auto: K LoRA trials at once on one group.

    1 (one trial a group, as with slots=1) where the trials cannot share one. `configs`: the points known (a grid's
    every point; a study's base point); `trials`: how many the sweep runs; `swept`: the keys it varies; `at_most`:
    hydra.launcher.max_parallel; `free_mb`: memory free where the group lives (None: unknown); `device`: cpu or cuda,
    the workers'."""
    if trials < 2:
        return 1, "one trial"
    for cfg in configs:
        if why := why_not_on_slot(cfg):
            return 1, why
        if cfg.env.active:  # host memory, not the group's: not in the estimate below
            return 1, (f"env.prompts={cfg.env.prompts}: each RL trial's sampler holds its own copy of the model in the sweep's "
                       "process; hydra.launcher.slots=K puts K on slots")
    if shaping := sorted(k for k in swept if any(k == p or k.startswith(p + ".") for p in SHAPE_KEYS)):
        return 1, f"the sweep varies {', '.join(shaping)}: trials of other shapes cannot share a group"
    k = min(trials, AUTO_SLOTS_MAX, at_most or AUTO_SLOTS_MAX)
    sizes = [slot_mb(cfg, device) for cfg in configs]
    bounds = f"at most {AUTO_SLOTS_MAX}, the sweep's {trials} trials" + (f", max_parallel={at_most}" if at_most else "")
    if free_mb is None or not sizes or None in sizes:
        return k, f"{bounds}; memory not estimated"
    per_slot = max(sizes)
    room = free_mb * MEMORY_SHARE - max(base_mb(cfg, device) or 0.0 for cfg in configs)
    fit = max(1, math.floor(room / per_slot)) if room > 0 else 1
    return min(k, fit), f"{bounds}; about {per_slot:.1f} MiB a slot, room for {fit} in {MEMORY_SHARE:.0%} of {free_mb:.0f} MiB free"


def model_sizes(model: Any) -> tuple[int, int, int, int] | None:
    """(hidden, intermediate, layers, vocab) of a run's model.

    From the tiny model's config, or a local Hugging Face dir's config.json; None where neither is at hand (a hub id not
    in a local dir)."""
    if model.path is None:
        return model.hidden_size, model.intermediate_size, model.num_layers, model.vocab_size
    config = Path(str(model.path)).expanduser() / "config.json"
    try:
        hf = json.loads(config.read_text())
        return int(hf["hidden_size"]), int(hf["intermediate_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def slot_mb(cfg: Any, device: str) -> float | None:
    """About what one slot adds to its group, in MiB.

    Its adapters on every linear layer of each decoder layer (an upper bound for fewer target modules) in fp32 with
    their gradients and AdamW's two moments, and its rows' activations in a packed step (a micro batch's tokens through
    every layer, or only each layer's input with backend.gradient_checkpointing, and their fp32 logits)."""
    sizes = model_sizes(cfg.model)
    if sizes is None:
        return None
    hidden, intermediate, layers, vocab = sizes
    adapter = cfg.lora.rank * layers * (4 * 2 * hidden + 3 * (hidden + intermediate))  # q, k, v, o; gate, up, down
    tokens = cfg.backend.tokens_per_micro_batch(device) or cfg.backend.micro_batch_size * cfg.data.max_length
    width = 1 if device == "cuda" else 2  # cpu workers keep fp32 activations
    if cfg.backend.gradient_checkpointing:  # each layer's input kept, one layer's activations at a time
        per_token = (layers * 2 + ACTIVATION_BYTES_16BIT) * width * hidden
    else:
        per_token = layers * ACTIVATION_BYTES_16BIT * width * hidden
    activations = tokens * (per_token + vocab * 4)
    return (adapter * 16 + activations) / 2**20


def base_mb(cfg: Any, device: str) -> float | None:
    """About what the group's base model holds, in MiB (its weights, bf16 on cuda, fp32 on cpu; untied head)."""
    sizes = model_sizes(cfg.model)
    if sizes is None:
        return None
    hidden, intermediate, layers, vocab = sizes
    params = layers * (4 * hidden * hidden + 3 * hidden * intermediate) + 2 * vocab * hidden
    return params * (2 if device == "cuda" else 4) / 2**20


def varied_keys(points: Sequence[Sequence[str]]) -> set[str]:
    """The keys whose values differ between a sweep's points.

    Each point is a list of `key=value` overrides; a key one point sets and another does not differs too."""
    each = [dict((k.lstrip("+~"), v) for k, _, v in (o.partition("=") for o in overrides)) for overrides in points]
    keys = set().union(*each) if each else set()
    return {key for key in keys if len({point.get(key) for point in each}) > 1}
