"""The RL config nodes `env`, `rl` and `loss`, and `check_rl`, the rules across them and the other groups. Pure Python.

`env`: prompts and a reward; `rl`: sampling and advantages; `loss`: the loss and its parameters.

Each default lives here once; conf/env/ and conf/loss/ hold only what an option changes. A loss's own parameters
default to Tinker's values (LOSS_PARAMETERS) unless the config sets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Optional

from tinker_exp.errors import ConfigError


class LossName(str, Enum):
    """Tinker's loss names (`forward_backward(loss_fn=...)`)."""

    cross_entropy = "cross_entropy"  # supervised fine-tuning on the data set (no env)
    importance_sampling = "importance_sampling"  # -(ratio * A).sum(): REINFORCE corrected for the sampler
    ppo = "ppo"  # -min(ratio * A, clip(ratio) * A).sum()
    cispo = "cispo"  # -(detach(clip(ratio)) * logp * A).sum()
    dro = "dro"  # -(logp * A - beta/2 * (logp - logp_sampler)^2).sum()
    gspo = "gspo"  # ppo's clip on each sequence's geometric-mean ratio (GSPO-token), summed over tokens
    stable_reinforce = "stable_reinforce"  # -(m * detach(min(ratio, cap)) * logp * A).sum(), m drops far-off sequences


class Advantage(str, Enum):
    grpo = "grpo"  # (reward - group mean) / (group std + 1e-6), the std unbiased (verl's GRPO outcome advantage)
    mean_centred = "mean_centred"  # reward - group mean (tinker-cookbook's RL loop)


RL_LOSSES = tuple(name.value for name in LossName if name is not LossName.cross_entropy)

KL_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+", "kl", "mse", "low_var_kl", "abs")
"""verl's names for its per-token KL estimators (verl.trainer.ppo.core_algos.kl_penalty), with lp the policy's and
ref the initial model's log-prob of the sampled token: k1 (= kl) lp - ref; k2 (= mse) (lp - ref)^2 / 2; k3
(= low_var_kl) exp(ref - lp) - (ref - lp) - 1; abs |lp - ref|; a trailing + keeps the value and takes k2's gradient."""

LOSS_PARAMETERS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},  # Tinker's ratio bounds (epsilon 0.2)
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},  # Tinker's: no lower bound, an upper cap
    "dro": {"beta": 0.05},  # Tinker documents no default (verl has none either): ours
    # the GSPO paper's clip range (epsilon 3e-4 below, 4e-4 above): a sequence's ratio is a geometric mean, near 1
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    # Tinker publishes no formula nor parameters for stable_reinforce: ours (docs/rl-losses.md); 2.0 is verl's
    # rollout_is_threshold (truncated importance sampling)
    "stable_reinforce": {"ratio_cap": 2.0, "sequence_ratio_bound": 2.0},
}
"""Each loss's parameters by Tinker's names, with the values a loss gets when the config leaves them null."""


@dataclass
class LossConfig:
    """The loss `forward_backward` computes.

    cross_entropy is today's SFT; the others are Tinker's RL losses on sampled responses (summed over tokens as Tinker
    defines them; docs/rl.md has each formula). A parameter left null takes the loss's default (LOSS_PARAMETERS);
    setting one the loss does not take is an error."""

    name: LossName = LossName.cross_entropy
    """cross_entropy (SFT on the data set), or an RL loss (needs an env): importance_sampling, ppo, cispo, dro,
    gspo, stable_reinforce."""
    clip_low_threshold: Optional[float] = None
    """ppo, cispo, gspo: the importance ratio's lower bound (Tinker's name; a ratio, not an epsilon; gspo's is the
    sequence's geometric-mean ratio). null: ppo 0.8, cispo 0.0, gspo 0.9997."""
    clip_high_threshold: Optional[float] = None
    """ppo, cispo, gspo: the importance ratio's upper bound. null: ppo 1.2, cispo 4.0, gspo 1.0004."""
    beta: Optional[float] = None
    """dro: weight of the quadratic penalty on the log-ratio to the sampler (> 0). null: 0.05."""
    ratio_cap: Optional[float] = None
    """stable_reinforce: each token's importance ratio is truncated at this value (>= 1) before it weighs the
    token's REINFORCE term. null: 2.0."""
    sequence_ratio_bound: Optional[float] = None
    """stable_reinforce: a sequence whose geometric-mean ratio to the sampler lies outside [1 / bound, bound] adds
    nothing (> 1). null: 2.0."""

    @property
    def params(self) -> dict[str, float]:
        """The loss's parameters, defaults filled in: what `build_loss_fn(name, params)` gets."""
        defaults = LOSS_PARAMETERS[self.name.value]
        return {key: float(default if getattr(self, key) is None else getattr(self, key)) for key, default in defaults.items()}

    @property
    def is_rl(self) -> bool:
        return self.name is not LossName.cross_entropy

    def __post_init__(self) -> None:
        name, takes = self.name.value, LOSS_PARAMETERS[self.name.value]
        for key in (f.name for f in fields(self) if f.name != "name"):
            value = getattr(self, key)
            if value is None:
                continue
            if key not in takes:
                its = f"its parameters: {', '.join(takes)}" if takes else "it has no parameters"
                raise ConfigError(f"loss.{key}: {name} takes no {key} ({its}); set it to null or choose another loss")
            if not math.isfinite(value):
                raise ConfigError(f"loss.{key}: expected a finite number, got {value!r}")
        params = self.params
        if "clip_low_threshold" in params:
            low, high = params["clip_low_threshold"], params["clip_high_threshold"]
            if not 0.0 <= low <= 1.0 <= high:
                raise ConfigError(
                    f"loss.clip_low_threshold={low} and loss.clip_high_threshold={high}: {name} needs "
                    "0 <= clip_low_threshold <= 1 <= clip_high_threshold (bounds of the ratio, which is 1 on-policy)"
                )
        if "beta" in params and params["beta"] <= 0:
            raise ConfigError(f"loss.beta: {name} needs beta > 0, got {params['beta']!r}")
        if "ratio_cap" in params and params["ratio_cap"] < 1:
            raise ConfigError(f"loss.ratio_cap: {name} needs ratio_cap >= 1 (the ratio is 1 on-policy), got {params['ratio_cap']!r}")
        if "sequence_ratio_bound" in params and params["sequence_ratio_bound"] <= 1:
            raise ConfigError(f"loss.sequence_ratio_bound: {name} needs sequence_ratio_bound > 1, got {params['sequence_ratio_bound']!r}")


@dataclass
class EnvConfig:
    """An RL environment: prompt rows and a reward.

    Selected with env=NAME (conf/env/), or your own with env.prompts=FILE env.reward=package.module:function. With an
    env, its prompts replace the data set."""

    name: Optional[str] = None
    """The env's name (the conf/env option sets it); null for your own env."""
    prompts: Optional[str] = None
    """JSONL of prompt rows, one object per line with a string "prompt" (sent as one user turn through the model's
    chat template) and any other fields the reward reads; "builtin:NAME" is a file in tinker_exp/assets. null: no
    env (supervised fine-tuning on the data set)."""
    eval_prompts: Optional[str] = None
    """Held-out prompt rows (the same form) scored at each evaluation (eval/reward); null: no evaluation."""
    reward: Optional[str] = None
    """"package.module:function": called as function(row, response) -> a finite number, with the prompt row (a
    dict) and the sampled response's text (decoded without special tokens: no end-of-turn marker); the module must
    be importable where the run starts."""
    max_new_tokens: int = 8
    """Most tokens sampled per response (a response also ends at the tokenizer's end-of-turn or eos token)."""

    @property
    def active(self) -> bool:
        """True when the run is an RL run on this env (it has prompts)."""
        return self.prompts is not None

    @property
    def selected_as(self) -> str:
        """How the user chose the env, for messages: env=digits, or env.prompts=FILE for their own."""
        return f"env={self.name}" if self.name else f"env.prompts={self.prompts}"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"env.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.prompts is None:
            for key in ("eval_prompts", "reward"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"env.{key}={getattr(self, key)} needs env.prompts=FILE (the training prompts)")
        elif self.reward is None:
            raise ConfigError(f"env.prompts={self.prompts} needs env.reward=package.module:function (the reward)")
        if self.name is not None and self.prompts is None:
            raise ConfigError(f"env.name={self.name} needs env.prompts=FILE and env.reward=package.module:function")


@dataclass
class RLConfig:
    """How an RL step samples and weighs responses (used only with an env).

    prompts_per_step prompts, each sampled group_size times from the current weights, each response's advantage taken
    within its group."""

    group_size: int = 8
    """Responses sampled per prompt (>= 2: advantages compare responses to the same prompt)."""
    prompts_per_step: int = 4
    """Prompts per optimizer step; the step trains on prompts_per_step x group_size responses."""
    temperature: float = 1.0
    """Sampling temperature (> 0); no other logits processing (top_k 0, top_p 1), so the sampler's log-probs are
    the policy's."""
    advantage: Advantage = Advantage.grpo
    """grpo: (reward - group mean) / (group std + 1e-6); mean_centred: reward - group mean (tinker-cookbook). A
    group whose rewards are all equal has zero advantages either way."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial model (0: none): the loss adds kl_coef x the token sum of the KL
    estimator (kl_estimator) between the policy and the initial model on the sampled tokens."""
    kl_estimator: str = "k3"
    """The per-token KL estimator, by verl's name (KL_ESTIMATORS): k3 (= low_var_kl, verl's default kl_loss_type),
    k1 (= kl), k2 (= mse), abs, k1+ / k3+ (the value of k1 / k3 with k2's gradient)."""
    log_kl_ref: bool = False
    """Log train/kl_ref (the token mean of kl_estimator against the initial model) even with kl_coef 0; with
    kl_coef > 0 it is always logged. Costs one forward pass of the initial model per sampled batch, on the driver."""
    updates_per_batch: int = 1
    """Optimizer steps per sampled batch: a batch is sampled at every step that is a multiple of it and trained on by
    that many optimizer steps (each forward_backward + optimizer_step, the ratio against the sampler's log-probs).
    trainer.steps counts optimizer steps; one that is not a multiple leaves a last batch with fewer updates."""
    max_steps_off_policy: int = 0
    """0: synchronous (each batch sampled from the current weights, then trained on). k >= 1: the driver samples the
    next batches while the workers train; step s's batch is sampled from the weights after optimizer step
    max(s - k, first step), exactly k steps old once past the first k (train/staleness), so a run is as
    deterministic as a synchronous one. Needs updates_per_batch 1."""

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def uses_reference(self) -> bool:
        """Whether each sampled batch needs the initial model's log-probs (the penalty, or its metric)."""
        return self.kl_coef > 0 or self.log_kl_ref

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"rl.group_size: must be >= 2, got {self.group_size} (advantages compare the responses to one prompt)"
            )
        if self.prompts_per_step < 1:
            raise ConfigError(f"rl.prompts_per_step: must be >= 1, got {self.prompts_per_step}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"rl.temperature: must be > 0 (and finite), got {self.temperature!r}")
        if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):
            raise ConfigError(f"rl.kl_coef: must be >= 0 (and finite), got {self.kl_coef!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"rl.kl_estimator: {self.kl_estimator!r} is not one of verl's KL estimators: {', '.join(KL_ESTIMATORS)}")
        if self.updates_per_batch < 1:
            raise ConfigError(f"rl.updates_per_batch: must be >= 1 (optimizer steps per sampled batch), got {self.updates_per_batch}")
        if self.max_steps_off_policy < 0:
            raise ConfigError(f"rl.max_steps_off_policy: must be >= 0 (0: synchronous), got {self.max_steps_off_policy}")
        if self.max_steps_off_policy and self.updates_per_batch > 1:
            raise ConfigError(
                f"rl.max_steps_off_policy={self.max_steps_off_policy} needs rl.updates_per_batch=1, got "
                f"{self.updates_per_batch} (an off-policy run samples a batch for every optimizer step)"
            )


def check_rl(cfg: Any) -> None:
    """The RL rules across groups: an RL loss and an env need each other; a step's responses split into micro batches.

    `cfg`: anything with .env, .rl, .loss and .backend, as the root Config. An RL loss needs an env, an env needs an RL
    loss, and a step's responses split over the workers into micro batches. The env's files and reward are checked by
    tinker_exp.rl.env.load_env (it reads the rows and tries the reward)."""
    env, rl, loss, backend = cfg.env, cfg.rl, cfg.loss, cfg.backend
    active = env.active
    if loss.is_rl and not active:
        raise ConfigError(
            f"loss.name={loss.name.value} needs an env to sample from (env=digits, env=arithmetic, or your own: "
            "env.prompts=FILE env.reward=package.module:function); without one, use loss=cross_entropy"
        )
    if active and not loss.is_rl:
        raise ConfigError(
            f"{env.selected_as} trains with an RL loss, not loss.name=cross_entropy: add loss=importance_sampling "
            f"(or {', '.join(RL_LOSSES[1:])})"
        )
    if not active:
        return
    workers, micro = backend.num_workers * backend.nodes, backend.micro_batch_size
    responses = rl.responses_per_step
    if responses % (workers * micro):
        over = f"backend.num_workers={backend.num_workers}" + (f" x backend.nodes={backend.nodes}" if backend.nodes > 1 else "")
        raise ConfigError(
            f"rl.prompts_per_step={rl.prompts_per_step} x rl.group_size={rl.group_size} = {responses} responses per "
            f"step do not split over {over} x backend.micro_batch_size={micro} = {workers * micro}: make "
            f"prompts_per_step x group_size a multiple of {workers * micro}, or change backend.micro_batch_size"
        )
