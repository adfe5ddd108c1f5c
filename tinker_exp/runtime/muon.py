"""Muon + AdamW as one multi-optimizer that verl builds, flattens and checkpoints.

verl's build_optimizer calls ``MuonWithAdamW(module.parameters(), lr=..., weight_decay=..., betas=..., **override)``:
no names, so the driver hands the model's parameter names and shapes in (``param_names``, from
``parameter_names``), in ``module.parameters()`` order; every shape is checked, so a model whose order differs
fails at build time instead of putting the wrong tensors in Muon.

The split (Moonlight, VeOmni, torchtitan): Muon on the 2-D weight matrices inside the transformer blocks, AdamW on
everything else (embeddings, the output head, norms, biases). verl's ``_iter_optimizer_param_groups`` flattens
``optimizers_dict`` (``_is_multi_optimizer``); its LambdaLR reads ``param_groups`` (both parts'); its checkpoint
manager saves and loads ``state_dict()``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

BLOCKS = ".layers."
"""Where Hugging Face decoder models keep their transformer blocks (model.layers.N....)."""


def goes_to_muon(name: str, ndim: int) -> bool:
    """A 2-D weight matrix inside a transformer block."""
    return ndim == 2 and BLOCKS in f".{name}"


def parameter_names(model_path: str) -> list[list[Any]]:
    """[name, shape] of each parameter of the model verl will build from `model_path`, in parameters() order.

    Built on the meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [[name, list(parameter.shape)] for name, parameter in model.named_parameters()]


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the blocks' matrices and torch.optim.AdamW on the rest, with one lr.

    Muon's update is scaled to AdamW's RMS (adjust_lr_fn="match_rms_adamw")."""

    _is_multi_optimizer = True  # verl flattens optimizers_dict's param groups

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        muon_momentum: float = 0.95,
        muon_nesterov: bool = True,
        muon_eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        param_names: list[list[Any]] | None = None,
    ):
        params = list(params)
        if param_names is None or len(param_names) != len(params):
            raise ValueError(
                f"MuonWithAdamW: {len(params)} parameters, {None if param_names is None else len(param_names)} names"
            )
        matrices, others, self.names = [], [], {"muon": [], "adamw": []}
        for parameter, (name, shape) in zip(params, param_names):
            if list(parameter.shape) != list(shape):
                raise ValueError(f"MuonWithAdamW: parameter {name} has shape {list(parameter.shape)}, expected {shape}")
            part = "muon" if goes_to_muon(name, parameter.ndim) else "adamw"
            (matrices if part == "muon" else others).append(parameter)
            self.names[part].append(name)
        self.optimizers_dict = {
            "muon": torch.optim.Muon(
                matrices, lr=lr, weight_decay=weight_decay, momentum=muon_momentum, nesterov=muon_nesterov,
                eps=muon_eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            ),
            "adamw": torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
        }
        # Not Optimizer.__init__: the groups and state live in the two parts; these are what torch's schedulers
        # and hooks read from any optimizer.
        self.defaults = {"lr": lr, "weight_decay": weight_decay}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers_dict.values() for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers_dict.values() for p, s in optimizer.state.items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers_dict.values():
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers_dict.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers_dict.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, optimizer in self.optimizers_dict.items():
            optimizer.load_state_dict(state_dict[name])
