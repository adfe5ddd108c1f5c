"""The optimizer plan, checked before any worker starts; pure Python and numpy (no torch, verl or ray).

OmegaConf values -> verl OptimStepParams (convert), per-step schedules, the whole plan checked before any worker starts,
and its preview (table, plan.json, plot)."""

from tinker_exp.optim.convert import OVERRIDE_KEYS, convert_params, flat_values
from tinker_exp.optim.plan import Plan, build_plan

__all__ = ["OVERRIDE_KEYS", "Plan", "build_plan", "convert_params", "flat_values"]
