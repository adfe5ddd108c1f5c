"""The served model's sampler: the driver's HFSampler (runtime/sampler.py) and each sampling session's weights.

`save_weights_for_sampler` writes what the workers export into a folder: the LoRA adapter (peft's format) for a LoRA
model, the full tensors (safetensors) otherwise; a sampling session's weights are the base model with that adapter
merged in float32, or those tensors. The sampler holds one set at a time and reloads when a request asks for
another session's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

ADAPTER = "adapter"
"""A LoRA model's sampler weights: its adapter, in peft's format."""
FULL = "model.safetensors"
"""A fully fine-tuned model's sampler weights: every tensor."""


class ServedSampler:
    def __init__(self, model_path: Path, seed: int):
        from tinker_exp.runtime.sampler import HFSampler

        self.sampler = HFSampler(model_path, seed)
        self.base = {name: tensor.detach().clone() for name, tensor in self.sampler.model.state_dict().items()}
        self.loaded: Any = None
        """The key of the weights in the sampler's model now."""

    @property
    def positions(self) -> int:
        return self.sampler.positions

    @staticmethod
    def write(workers: Any, folder: Path, lora_rank: int) -> None:
        """The workers' weights into `folder` (which exists): the adapter, or every tensor."""
        if lora_rank:
            workers.export_adapter(folder / ADAPTER)
        else:
            from safetensors.torch import save_file

            save_file(workers.export_weights(), folder / FULL)

    def weights(self, folder: Path) -> dict[str, Any]:
        """The full model's tensors a folder written by `write` stands for."""
        if (folder / ADAPTER).is_dir():
            from tinker_exp.runtime.lora import merge_adapter

            return merge_adapter(self.base, folder / ADAPTER)
        from safetensors.torch import load_file

        return load_file(folder / FULL)

    def use(self, key: Any, tensors: Any) -> None:
        """Sample from these weights (`tensors`: a dict, or a callable that gives it) unless they are loaded."""
        if key != self.loaded:
            self.sampler.load(tensors() if callable(tensors) else tensors)
            self.loaded = key

    def sample(self, prompt: Sequence[int], n: int, max_tokens: int, temperature: float, seed: int | None,
               **limits: Any) -> list:
        """`n` responses (runtime/sampler.py Sample), from `seed`'s random state or the sampler's own.

        With `seed`, from that seed's random state, the sampler's own state left as it was; without, from the sampler's
        state, which it advances. `limits`: HFSampler.sample's stop, top_k, top_p."""
        if seed is None:
            return self.sampler.sample(prompt, n, max_tokens, temperature, **limits)
        running = self.sampler.rng_state()
        self.sampler.set_rng_state(self.sampler.state_for(seed))
        try:
            return self.sampler.sample(prompt, n, max_tokens, temperature, **limits)
        finally:
            self.sampler.set_rng_state(running)

    def prompt_log_probs(self, prompt: Sequence[int]) -> list[float]:
        return self.sampler.prompt_log_probs(prompt)
