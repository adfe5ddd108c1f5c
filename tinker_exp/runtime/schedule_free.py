"""Schedule-free AdamW (Defazio et al. 2024, the `schedulefree` package) as an optimizer verl builds and checkpoints.

The optimizer keeps two points: the parameters hold y (where gradients are taken: the training point), its state
holds z (the base sequence); the averaged weights x = y + (1 - 1/beta1) (z - y) are what it is judged by. Its own
`eval()`/`train()` move the parameters between y and x in place, and a round trip is not exact in floating point.
So this class differs from the package's in what a framework with exact resume needs:

- it is built in train mode (the package's starts in eval mode and refuses to step until `train()` is called);
- `to_averaged()` keeps a copy of y and moves the parameters to x, `to_training()` puts that copy back bitwise:
  an evaluation (or an export) between two steps changes nothing the next step sees;
- `warmup_steps` is held as a float, as every value an override sends (verl's `_apply_optim_step_params` refuses a
  key whose type differs between what is sent and what the group holds).

A checkpoint is written between steps, in train mode: its model weights are y, its optimizer state z and the
running sums (k, weight_sum, lr_max), so a resume continues bitwise; x is derived from both when evaluating.
"""

from __future__ import annotations

from typing import Any

import torch
from schedulefree import AdamWScheduleFree as _PackageAdamWScheduleFree


class AdamWScheduleFree(_PackageAdamWScheduleFree):
    """The package's AdamWScheduleFree, in train mode from its build, with exact moves to the averaged weights and back."""

    def __init__(self, params: Any, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, warmup_steps: float = 0.0, r: float = 0.0, weight_lr_power: float = 2.0,
                 foreach: bool | None = None):  # fmt: skip
        kwargs = {} if foreach is None else {"foreach": foreach}  # None: the package's choice (foreach where torch has it)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=float(warmup_steps),
                         r=r, weight_lr_power=weight_lr_power, **kwargs)  # fmt: skip
        self.training_point: list[torch.Tensor] | None = None  # y while the parameters hold x
        self.train()  # no state yet: only the groups' train_mode flag

    @torch.no_grad()
    def to_averaged(self) -> None:
        """Move the parameters to the averaged weights x (for an evaluation or an export), y kept aside.

        Before the first step (no z) x is y."""
        if self.training_point is not None:
            return
        self.training_point = [p.detach().clone() for group in self.param_groups for p in group["params"]]
        self.eval()

    @torch.no_grad()
    def to_training(self) -> None:
        """The parameters back to y, bitwise as they were before `to_averaged`; train mode."""
        if self.training_point is None:
            return
        parameters = [p for group in self.param_groups for p in group["params"]]
        for parameter, kept in zip(parameters, self.training_point, strict=True):
            parameter.copy_(kept)
        self.training_point = None
        for group in self.param_groups:
            group["train_mode"] = True

    def state_dict(self) -> dict[str, Any]:
        if self.training_point is not None:  # never: checkpoints are written between steps, in train mode
            raise RuntimeError("AdamWScheduleFree: a checkpoint of the averaged weights would not resume; call to_training() first")
        return super().state_dict()
