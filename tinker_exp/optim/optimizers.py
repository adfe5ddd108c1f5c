"""Which keys each optimizer's param groups hold, with their kinds: the override vocabulary follows the optimizer.

Pure Python: the table is held to the real torch optimizers by tests/test_optimizers.py (each one built the way the
workers build it), and to the optimizer verl builds by tests/test_optimizers_ray.py.

verl's ``_apply_optim_step_params`` writes one value into every param group of every sub-optimizer (a
multi-optimizer's ``optimizers_dict`` is flattened) and refuses a key some group lacks or holds with another type.
The same rule runs here before any worker starts (``refusal``), with two more: a key that is not a float (or a pair
of floats) cannot be sent per step, and a key whose sub-optimizers give it different meanings (``eps`` of Muon is
the Newton-Schulz eps, of AdamW Adam's) is refused rather than silently set to one value in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tinker_exp.errors import a_or_an

FLOAT = "float"  # a float in every group: can be sent and scheduled
PAIR = "pair of floats"  # betas: a tuple of two floats, each component scheduled on its own
FLAG = "bool"
INT = "int"
COEFFS = "tuple"  # Muon's ns_coefficients
CHOICE = "str"  # Muon's adjust_lr_fn
AUTO = "None"  # torch's "pick for me" (foreach, fused)
STATE = "running state"  # schedule-free's weight_sum, lr_max, scheduled_lr: floats the optimizer updates itself

SENDABLE_KINDS = (FLOAT, PAIR)
SCHEDULED_LR = "scheduled_lr"
"""Where an optimizer that scales its lr itself keeps the lr its last step applied (schedule-free AdamW: its lr times
its own warmup's factor). Read back with the groups after each step, it is that step's applied/lr (train/loop.py)."""

_ADAM_GROUP = {
    "lr": FLOAT, "betas": PAIR, "eps": FLOAT, "weight_decay": FLOAT, "amsgrad": FLAG, "maximize": FLAG,
    "foreach": AUTO, "capturable": FLAG, "differentiable": FLAG, "fused": AUTO, "decoupled_weight_decay": FLAG,
}


@dataclass(frozen=True)
class SubOptimizer:
    """One torch optimizer class and the keys (with kinds) each of its param groups holds."""

    torch_class: str
    """Where it lives, e.g. torch.optim.SGD."""
    keys: Mapping[str, str]
    """Every param-group key but `params` -> its kind (FLOAT, PAIR, FLAG, ...)."""
    meanings: Mapping[str, str] = field(default_factory=dict)
    """Keys that mean something else here than the same key in a usual optimizer (Muon's eps)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer a run can choose (optimizer.name): its sub-optimizers and what its constructor is given."""

    name: str
    parts: Mapping[str, SubOptimizer]
    """Sub-optimizer name -> its table; one entry for a plain torch optimizer."""
    built_with: tuple[str, ...]
    """The OptimizerConfig fields handed to the constructor (converted like overrides)."""
    impl: str = "torch.optim"
    """The module verl imports the class from (FSDPOptimizerConfig.optimizer_impl)."""
    class_name: str = ""
    """The class verl builds (FSDPOptimizerConfig.optimizer); empty: `name`."""
    averaged: bool = False
    """Judged at averaged weights (schedule-free): the workers move the parameters there for an evaluation or an
    export and back, bitwise, before the next step (tinker_exp.runtime.schedule_free)."""

    @property
    def sendable(self) -> tuple[str, ...]:
        """The keys an override may send.

        Those held by every sub-optimizer as a float (or pair), with one meaning; and the keys our worker applies itself
        (WORKER_KEYS)."""
        first = next(iter(self.parts.values()))
        return tuple(key for key in VOCABULARY if (key in first.keys or key in WORKER_KEYS) and self.refusal(key) is None)

    def refusal(self, key: str) -> str | None:
        """Why `key` cannot be sent to this optimizer, in words; None when it can."""
        if key in WORKER_KEYS:
            return None
        holding = [part for part in self.parts.values() if key in part.keys]
        if not holding:
            return f"optimizer {self.name} has no param-group key {key}"
        kinds = {part.keys[key] for part in holding}
        if STATE in kinds:
            return f"optimizer {self.name} updates {key} itself at every step (its running state): it cannot be sent"
        if not kinds <= set(SENDABLE_KINDS):
            kind = " and ".join(sorted(kinds))
            return f"optimizer {self.name} holds {key} as {a_or_an(kind)}: only float keys can be sent per step"
        lacking = [name for name, part in self.parts.items() if key not in part.keys]
        if lacking:
            return f"optimizer {self.name}: its sub-optimizer {', '.join(lacking)} has no param-group key {key}"
        meanings = {part.meanings.get(key, "") for part in holding}
        if len(meanings) > 1:
            told = "; ".join(f"{name}: {part.meanings.get(key) or 'the usual one'}" for name, part in self.parts.items())
            return f"optimizer {self.name}: {key} means different things in its sub-optimizers ({told}); one value cannot serve both"
        return None


def _plain(name: str, keys: Mapping[str, str], built_with: tuple[str, ...]) -> OptimizerSpec:
    return OptimizerSpec(name, {name: SubOptimizer(f"torch.optim.{name}", keys)}, built_with)


_ADAM_BUILT = ("lr", "betas", "eps", "weight_decay")

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        _plain("AdamW", _ADAM_GROUP, _ADAM_BUILT),
        _plain("Adam", _ADAM_GROUP, _ADAM_BUILT),
        _plain(
            "SGD",
            {"lr": FLOAT, "momentum": FLOAT, "dampening": FLOAT, "weight_decay": FLOAT, "nesterov": FLAG,
             "maximize": FLAG, "foreach": AUTO, "differentiable": FLAG, "fused": AUTO},
            ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
        ),
        _plain(
            "RMSprop",
            {"lr": FLOAT, "momentum": FLOAT, "alpha": FLOAT, "eps": FLOAT, "centered": FLAG, "weight_decay": FLOAT,
             "capturable": FLAG, "foreach": AUTO, "maximize": FLAG, "differentiable": FLAG},
            ("lr", "momentum", "alpha", "eps", "centered", "weight_decay"),
        ),
        _plain(
            "Adagrad",
            {"lr": FLOAT, "lr_decay": FLOAT, "eps": FLOAT, "weight_decay": FLOAT, "initial_accumulator_value": FLOAT,
             "foreach": AUTO, "maximize": FLAG, "differentiable": FLAG, "fused": AUTO},
            ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
        ),
        _plain(
            "NAdam",
            {"lr": FLOAT, "betas": PAIR, "eps": FLOAT, "weight_decay": FLOAT, "momentum_decay": FLOAT,
             "decoupled_weight_decay": FLAG, "maximize": FLAG, "foreach": AUTO, "capturable": FLAG,
             "differentiable": FLAG},
            (*_ADAM_BUILT, "momentum_decay", "decoupled_weight_decay"),
        ),
        _plain(
            "RAdam",
            {"lr": FLOAT, "betas": PAIR, "eps": FLOAT, "weight_decay": FLOAT, "maximize": FLAG, "foreach": AUTO,
             "capturable": FLAG, "decoupled_weight_decay": FLAG, "differentiable": FLAG},
            (*_ADAM_BUILT, "decoupled_weight_decay"),
        ),
        _plain(
            "Adamax",
            {"lr": FLOAT, "betas": PAIR, "eps": FLOAT, "weight_decay": FLOAT, "foreach": AUTO, "maximize": FLAG,
             "differentiable": FLAG, "capturable": FLAG},
            _ADAM_BUILT,
        ),
        OptimizerSpec(
            "Muon",
            {
                "muon": SubOptimizer(
                    "torch.optim.Muon",
                    {"lr": FLOAT, "weight_decay": FLOAT, "momentum": FLOAT, "nesterov": FLAG, "ns_coefficients": COEFFS,
                     "eps": FLOAT, "ns_steps": INT, "adjust_lr_fn": CHOICE},
                    meanings={"eps": "the Newton-Schulz iteration's eps"},
                ),
                "adamw": SubOptimizer("torch.optim.AdamW", _ADAM_GROUP),
            },
            (*_ADAM_BUILT, "muon_momentum", "muon_nesterov", "muon_eps", "ns_steps", "adjust_lr_fn"),
            impl="tinker_exp.runtime.muon",
            class_name="MuonWithAdamW",
        ),
        OptimizerSpec(
            "AdamWScheduleFree",
            {
                "AdamWScheduleFree": SubOptimizer(
                    "schedulefree.AdamWScheduleFree",
                    {"lr": FLOAT, "betas": PAIR, "eps": FLOAT, "r": FLOAT, "k": INT, "warmup_steps": FLOAT,
                     "train_mode": FLAG, "weight_sum": STATE, "lr_max": STATE, SCHEDULED_LR: STATE,
                     "weight_lr_power": FLOAT, "weight_decay": FLOAT, "foreach": FLAG},
                )
            },
            (*_ADAM_BUILT, "warmup_steps", "r", "weight_lr_power"),
            impl="tinker_exp.runtime.schedule_free",
            averaged=True,
        ),
    )
}
"""Every optimizer a run can choose, by optimizer.name."""

WORKER_KEYS: tuple[str, ...] = ("grad_clip_norm",)
"""Per-step values no param group holds: our worker applies them itself at that step, whatever the optimizer
(grad_clip_norm: the max norm verl's engine clips with at that step; 0 means no clipping, as Tinker defines it)."""

VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(key for spec in OPTIMIZERS.values() for part in spec.parts.values() for key, kind in part.keys.items()
                  if kind in SENDABLE_KINDS)
) + WORKER_KEYS
"""Every float key some optimizer holds, then WORKER_KEYS, in a stable order (the order of plans, rows and tables)."""

GROUP_KEYS: frozenset[str] = frozenset(key for spec in OPTIMIZERS.values() for part in spec.parts.values() for key in part.keys)
"""Every key some optimizer's groups hold (an override naming a non-float one is told why it cannot be sent)."""

TINKER_SPELLINGS = {"learning_rate": "lr", "beta1": "betas[0]", "beta2": "betas[1]"}
"""Tinker's AdamParams names -> verl's keys (a beta is one component of betas)."""

def spec_of(name: str) -> OptimizerSpec:
    return OPTIMIZERS[name]


def sendable_message(spec: OptimizerSpec) -> str:
    return f"keys {spec.name} accepts: {', '.join(spec.sendable)}"


VERL_ARGUMENTS = ("lr", "weight_decay", "betas")
"""What verl's build_optimizer passes itself (betas only to a class whose name contains "adam")."""


def verl_optimizer_fields(name: str, values: Mapping[str, object]) -> dict[str, object]:
    """The FSDPOptimizerConfig fields that make verl's build_optimizer build optimizer `name` from `values`.

    `values`: the converted constructor values (tinker_exp.optim.plan.optimizer_values); the rest goes through
    override_optimizer_config."""
    spec = OPTIMIZERS[name]
    class_name = spec.class_name or spec.name
    fields: dict[str, object] = {
        "optimizer": class_name,
        "optimizer_impl": spec.impl,
        "lr": values["lr"],
        "weight_decay": values["weight_decay"],
        "override_optimizer_config": {key: values[key] for key in spec.built_with if key not in VERL_ARGUMENTS},
    }
    if "betas" in values:
        if "adam" not in class_name.lower():  # verl would drop them: a table error, caught by the tests
            raise ValueError(f"{class_name}: verl passes betas only to a class named *adam*")
        fields["betas"] = values["betas"]
    return fields
