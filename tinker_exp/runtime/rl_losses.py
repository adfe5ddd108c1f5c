"""Tinker's RL losses (importance_sampling, ppo, cispo, dro, gspo, stable_reinforce) as verl loss functions for ``worker.set_loss_fn``.

Each loss is Tinker's token-level formula, summed over every response token of the batch with no normalisation
(Tinker's ``loss:sum``). verl's engine (``forward_backward_batch``) calls the loss once per micro batch and runs
``backward`` on each result; FSDP then *averages* the accumulated gradients over the data-parallel ranks. So each
micro batch returns its own token sum times ``dp_size`` (verl's ``agg_loss`` mode "token-sum"): the gradient after one
``forward_backward`` is the gradient of the token sum over the whole batch, whatever its split over ranks and micro
batches. docs/rl-losses.md gives the formulas, the mapping onto verl's policy-loss registry and the metrics.

Inputs, read as verl's own ``ppo_loss`` reads them: ``log_probs`` (the trainer's, nested over whole sequences) from
the model output; ``old_log_probs`` (the sampler's), ``advantages`` and ``response_mask`` (B, R) from the TensorDict;
``dp_size`` and ``batch_num_tokens`` (the engine's sum of ``loss_mask`` over all ranks) as its non-tensor fields.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

# Each RL loss's parameters, by Tinker's names (``loss_fn_config``). Their defaults live in the config (conf/loss/).
LOSS_PARAMS: dict[str, tuple[str, ...]] = {
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
    "stable_reinforce": ("ratio_cap", "sequence_ratio_bound"),
}

# Metric names (verl's where verl has the metric). Every one is a batch-level figure once reduced (batch_metrics).
PG_LOSS = "actor/pg_loss"  # the loss: Tinker's token sum over the whole batch (equals the engine's "loss")
CLIP_FRACTION = "actor/pg_clipfrac"  # share of tokens whose clipped term is the active one (ppo, cispo)
PPO_KL = "actor/ppo_kl"  # token mean of log q - log p: the sampler/trainer mismatch, signed (k1 estimator)
ABS_LOG_RATIO = "actor/abs_log_ratio"  # token mean of |log p - log q|: the mismatch, unsigned
RATIO_MEAN, RATIO_MIN, RATIO_MAX = "actor/ratio_mean", "actor/ratio_min", "actor/ratio_max"  # r = p/q over the tokens
KL_REF = "actor/kl_ref"  # token mean of the KL estimator between the policy and the initial model (ref_log_prob)
KL_LOSS = "actor/kl_loss"  # the KL penalty's part of the loss: kl_coef x the estimator's token sum


def importance_sampling_terms(log_prob, old_log_prob, advantages, mask):
    """Tinker's importance_sampling per token: -(p/q) * A. No clipping."""
    import torch

    return -(torch.exp(log_prob - old_log_prob) * advantages), None


def ppo_terms(log_prob, old_log_prob, advantages, mask, *, clip_low_threshold: float, clip_high_threshold: float):
    """Tinker's ppo per token: -min(r * A, clip(r, low, high) * A), r = p/q; clipped where the second term is smaller."""
    import torch

    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


def cispo_terms(log_prob, old_log_prob, advantages, mask, *, clip_low_threshold: float, clip_high_threshold: float):
    """Tinker's cispo per token: -sg(clip(r, low, high)) * log p * A; clipped where r lies outside [low, high]."""
    import torch

    ratio = torch.exp(log_prob - old_log_prob)
    clipped_ratio = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -(clipped_ratio.detach() * log_prob * advantages), clipped_ratio != ratio


def dro_terms(log_prob, old_log_prob, advantages, mask, *, beta: float):
    """Tinker's dro per token: -(log p * A - beta/2 * (log p - log q)^2). No clipping."""
    return -(log_prob * advantages - 0.5 * beta * (log_prob - old_log_prob) ** 2), None


def sequence_log_ratio(log_prob, old_log_prob, mask):
    """Each sequence's mean of log p - log q over its response tokens (B, 1); no gradient flows through it.

    The log of GSPO's geometric-mean ratio s = (p(y) / q(y)) ^ (1 / |y|)."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    return ((log_prob - old_log_prob).detach() * mask).sum(-1, keepdim=True) / lengths


def gspo_terms(log_prob, old_log_prob, advantages, mask, *, clip_low_threshold: float, clip_high_threshold: float):
    """GSPO-token per token (the GSPO paper's token form, verl's ``gspo``).

    -min(s_t * A, clip(s_t, low, high) * A) with s_t = sg(s) * exp(log p - sg(log p)): its value is the sequence's ratio
    s, its gradient s * d log p. A sequence is clipped whole (every token where the clipped term is smaller)."""
    import torch

    ratio = torch.exp(sequence_log_ratio(log_prob, old_log_prob, mask) + log_prob - log_prob.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


def stable_reinforce_terms(log_prob, old_log_prob, advantages, mask, *, ratio_cap: float, sequence_ratio_bound: float):
    """Our stable_reinforce per token (Tinker does not publish its formula; docs/rl-losses.md).

    REINFORCE weighted by the truncated, detached importance ratio, -m * sg(min(r, ratio_cap)) * log p * A, where m
    drops a whole sequence (0) whose geometric-mean ratio s lies outside [1 / sequence_ratio_bound,
    sequence_ratio_bound]. Counted as clipped: a truncated token, and every token of a dropped sequence."""
    import torch

    ratio = torch.exp(log_prob - old_log_prob).detach()
    log_bound = math.log(sequence_ratio_bound)
    kept = (sequence_log_ratio(log_prob, old_log_prob, mask).abs() <= log_bound).to(log_prob.dtype).expand_as(log_prob)
    weight = torch.clamp(ratio, max=ratio_cap) * kept
    return -(weight * log_prob * advantages), (ratio > ratio_cap) | (kept == 0)


TOKEN_TERMS: dict[str, Callable] = {
    "importance_sampling": importance_sampling_terms,
    "ppo": ppo_terms,
    "cispo": cispo_terms,
    "dro": dro_terms,
    "gspo": gspo_terms,
    "stable_reinforce": stable_reinforce_terms,
}


def tinker_rl_loss(model_output, data, dp_group=None, *, loss: str, kl_coef: float = 0.0, kl_estimator: str = "k3", **params):
    """verl's loss signature: one micro batch -> (its share of the batch's token-sum loss, times dp_size; metrics).

    Metrics are verl ``Metric``s aggregated by SUM, each micro batch's value already divided by the batch's token
    count and multiplied by dp_size, so that verl's reduction (sum over micro batches, mean over ranks:
    ``Metric.aggregate_dp``) gives the token-weighted figure over the whole batch; the ratio's min and max are MIN /
    MAX ``Metric``s (verl reduces those over every micro batch of every rank).

    With ``ref_log_prob`` in the batch (the initial model's log-probs of the sampled tokens), the KL estimator
    `kl_estimator` (verl's ``kl_penalty``) is logged as its token mean; with `kl_coef` > 0 the loss adds kl_coef x
    its token sum, aggregated as the policy term is.
    """
    import torch

    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    dp_size, batch_num_tokens = data["dp_size"], data["batch_num_tokens"]
    fields = data.select("response_mask", "loss_mask", "old_log_probs", "advantages").to_padded_tensor()
    mask = fields["response_mask"].to(bool)
    if not torch.equal(fields["loss_mask"].to(bool), mask):
        # the engine counts loss_mask into batch_num_tokens, which normalises the metrics below
        raise ValueError("loss_mask must equal response_mask for an RL loss (the engine counts loss_mask tokens)")
    old_log_prob, advantages = fields["old_log_probs"], fields["advantages"]

    per_token, clipped = TOKEN_TERMS[loss](log_prob, old_log_prob, advantages, mask.to(log_prob.dtype), **params)
    pg_loss = agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode="token-sum", dp_size=dp_size)

    def batch_share(values) -> Metric:  # this micro batch's part of a token mean over the whole batch
        share = values.detach().double().masked_fill(~mask, 0.0).sum() / batch_num_tokens * dp_size
        return Metric(AggregationType.SUM, share)

    log_ratio = (log_prob - old_log_prob).detach()
    ratio = torch.exp(log_ratio).double()
    metrics = {
        PG_LOSS: Metric(AggregationType.SUM, pg_loss.detach()),
        PPO_KL: batch_share(-log_ratio),
        ABS_LOG_RATIO: batch_share(log_ratio.abs()),
        RATIO_MEAN: batch_share(ratio),
        RATIO_MIN: Metric(AggregationType.MIN, ratio[mask].min()),  # every response has a token: never empty
        RATIO_MAX: Metric(AggregationType.MAX, ratio[mask].max()),
    }
    if clipped is not None:
        metrics[CLIP_FRACTION] = batch_share(clipped)
    total = pg_loss
    if "ref_log_prob" in data.keys():
        ref_log_prob = data.select("ref_log_prob").to_padded_tensor()["ref_log_prob"]
        kl = kl_penalty(log_prob, ref_log_prob, kl_penalty=kl_estimator)
        metrics[KL_REF] = batch_share(kl)
        if kl_coef > 0:
            kl_loss = kl_coef * agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode="token-sum", dp_size=dp_size)
            metrics[KL_LOSS] = Metric(AggregationType.SUM, kl_loss.detach())
            total = pg_loss + kl_loss
    elif kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_log_prob in the batch (the initial model's log-probs)")
    return total, metrics


def build_loss_fn(name: str, params: dict[str, Any], kl_coef: float = 0.0, kl_estimator: str = "k3") -> Callable:
    """The loss function for ``set_loss_fn``.

    A picklable partial of ``tinker_rl_loss`` with this loss's parameters and the KL penalty's (rl.kl_coef,
    rl.kl_estimator).

    `params` holds exactly the loss's parameters (LOSS_PARAMS[name]); their values are the config's to check (it
    names the key as typed), so they are taken as they are.
    """
    if name not in LOSS_PARAMS:
        raise ValueError(f"unknown RL loss {name!r}: one of {', '.join(LOSS_PARAMS)}")
    expected, given = set(LOSS_PARAMS[name]), set(params)
    if expected != given:
        raise ValueError(f"loss {name!r} takes parameters {sorted(expected)}, got {sorted(given)}")
    return partial(tinker_rl_loss, loss=name, kl_coef=float(kl_coef), kl_estimator=kl_estimator,
                   **{key: float(value) for key, value in params.items()})  # fmt: skip


def batch_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The worker's ``forward_backward`` metrics reduced to floats as verl reduces them.

    A list of per-rank ``Metric``s through ``Metric.aggregate_dp`` (sum over micro batches, mean over ranks), a single
    ``Metric`` through ``aggregate``, (nested) lists of numbers to their mean, a number as it is; anything else is left
    out."""
    from verl.utils.metric import Metric

    def numbers(value) -> list[float]:  # a plain metric: a number, or lists of them (per micro batch, per rank)
        if isinstance(value, list):
            return [n for v in value for n in numbers(v)]
        return [float(value)] if isinstance(value, (int, float)) else []

    out = {}
    for key, value in metrics.items():
        if isinstance(value, list) and value and all(isinstance(v, Metric) for v in value):
            out[key] = float(Metric.aggregate_dp(value))
        elif isinstance(value, Metric):
            out[key] = float(value.aggregate())
        elif values := numbers(value):
            out[key] = sum(values) / len(values)
    return out
