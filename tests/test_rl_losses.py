"""Tinker's RL losses (runtime/rl_losses.py) on fixed tensors: values and gradients against the formulas written out
by hand, the token-sum aggregation over micro batches and data-parallel ranks, the batch-level metrics, pickling, and
agreement with verl's own policy losses where docs/rl-losses.md says they match."""

import math
import pickle

import pytest

torch = pytest.importorskip("torch")

from tinker_exp.runtime import rl_losses  # noqa: E402

# Four sequences (prompt length; response: trainer log-prob p, sampler log-prob q; one advantage per sequence),
# chosen so that PPO/CISPO clip on both sides, with both signs of advantage, and an unclipped token outside the band.
SEQS = [
    (3, [-1.0, -0.5, -2.0], [-1.0, -0.9, -1.0], 1.0),  # ratios 1, 1.49, 0.37
    (2, [-0.3, -1.5], [-0.8, -1.0], -0.5),  # ratios 1.65, 0.61
    (4, [-2.2, -0.1, -0.7, -1.2], [-2.0, -0.1, -0.2, -1.9], 2.0),  # ratios 0.82, 1, 0.61, 2.01
    (1, [-0.4], [-0.35], 0.0),  # a zero advantage: contributes nothing but its mismatch
    (2, [-0.2, -0.6], [-0.9, -0.7], 1.5),  # ratios 2.01, 1.11: geometric mean 1.49, clipped whole by gspo
]
N_TOKENS = sum(len(s[1]) for s in SEQS)
FILLER = 7.0  # log-prob at prompt positions (and the last position): must get no gradient
PARAMS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},  # sequence ratios 0.82, 1, 1, 0.95, 1.49
    "stable_reinforce": {"ratio_cap": 2.0, "sequence_ratio_bound": 1.4},  # truncates seq 2's last token, drops seq 4
}


def hand_sequence(name: str, ps: list, qs: list, a: float, params: dict) -> list[tuple[float, float, bool]]:
    """Each token's (loss, derivative in its p, clipped) for one sequence: the sequence-level losses written out,
    the token-level ones token by token (hand)."""
    s = math.exp(sum(p - q for p, q in zip(ps, qs)) / len(ps))  # the geometric-mean ratio
    if name == "gspo":  # value s, gradient s d(log p), per token
        lo, hi = params["clip_low_threshold"], params["clip_high_threshold"]
        unclipped, clipped = s * a, min(max(s, lo), hi) * a
        clipped_active = clipped < unclipped
        return [(-min(unclipped, clipped), 0.0 if clipped_active else -s * a, clipped_active)] * len(ps)
    if name == "stable_reinforce":
        bound, cap = params["sequence_ratio_bound"], params["ratio_cap"]
        kept = 1 / bound <= s <= bound
        out = []
        for p, q in zip(ps, qs):
            w = min(math.exp(p - q), cap) if kept else 0.0
            out.append((-w * p * a, -w * a, not kept or math.exp(p - q) > cap))
        return out
    return [hand(name, p, q, a, params) for p, q in zip(ps, qs)]


def hand_tokens(name: str, params: dict, seqs=None) -> list[tuple[float, float, bool]]:
    return [t for _, ps, qs, a in (seqs or SEQS) for t in hand_sequence(name, ps, qs, a, params)]


def hand(name: str, p: float, q: float, a: float, params: dict) -> tuple[float, float, bool]:
    """Tinker's per-token loss, its derivative in p (the trainer's log-prob) and whether the token counts as clipped."""
    r = math.exp(p - q)
    if name == "importance_sampling":
        return -r * a, -r * a, False
    if name == "ppo":
        lo, hi = params["clip_low_threshold"], params["clip_high_threshold"]
        unclipped, clipped = r * a, min(max(r, lo), hi) * a
        clipped_active = clipped < unclipped
        return -min(unclipped, clipped), (0.0 if clipped_active else -r * a), clipped_active
    if name == "cispo":
        lo, hi = params["clip_low_threshold"], params["clip_high_threshold"]
        c = min(max(r, lo), hi)
        return -c * p * a, -c * a, not lo <= r <= hi
    beta = params["beta"]
    return -(p * a - 0.5 * beta * (p - q) ** 2), -(a - beta * (p - q)), False


def micro_batch(seqs, *, dp_size=1, batch_num_tokens=N_TOKENS, max_response_len=None, ref=None):
    """A micro batch as verl's engine hands it to the loss: nested whole-sequence log-probs (position t holds the
    log-prob of token t+1), padded (B, R) fields, the engine's non-tensor dp_size and batch_num_tokens."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    R = max_response_len or max(len(s[1]) for s in seqs)
    flat, offsets = [], [0]
    for prompt_len, p, _, _ in seqs:
        flat += [FILLER] * (prompt_len - 1) + p + [FILLER]
        offsets.append(len(flat))
    values = torch.tensor(flat, dtype=torch.float64, requires_grad=True)
    log_probs = torch.nested.nested_tensor_from_jagged(values, torch.tensor(offsets))

    def padded(rows):
        out = torch.zeros(len(seqs), R, dtype=torch.float64)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        return out

    def nested(lengths):
        return torch.nested.as_nested_tensor([torch.ones(n, dtype=torch.long) for n in lengths], layout=torch.jagged)

    mask = padded([[1.0] * len(s[1]) for s in seqs])
    data = TensorDict(
        {
            "prompts": nested([s[0] for s in seqs]),
            "responses": nested([len(s[1]) for s in seqs]),
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "old_log_probs": padded([s[2] for s in seqs]),
            "advantages": padded([[s[3]] * len(s[1]) for s in seqs]),
        },
        batch_size=[len(seqs)],
    )
    if ref is not None:  # the initial model's log-probs of the response tokens (verl's ref_log_prob)
        data["ref_log_prob"] = padded(ref)
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, max_response_len=R, global_batch_size=len(SEQS))
    return {"log_probs": log_probs}, data, values


def run(fn, seqs, **batch):
    """The loss on a micro batch, called as the engine calls it (keywords): (loss, metrics, the log-prob leaf)."""
    model_output, data, values = micro_batch(seqs, **batch)
    loss, metrics = fn(model_output=model_output, data=data, dp_group=None)
    return loss, metrics, values


def response_grads(values, seqs) -> list[float]:
    """The gradient at the response positions, in SEQS order; asserts zero everywhere else."""
    grads, at = [], 0
    for prompt_len, p, _, _ in seqs:
        span = values.grad[at : at + prompt_len + len(p)]
        grads += span[prompt_len - 1 : prompt_len - 1 + len(p)].tolist()
        assert span[: prompt_len - 1].abs().sum() == 0 and span[-1] == 0, "gradient outside the response"
        at += prompt_len + len(p)
    return grads


@pytest.mark.parametrize("name", list(rl_losses.LOSS_PARAMS))
def test_each_loss_is_tinkers_token_sum_formula(name):
    fn = rl_losses.build_loss_fn(name, PARAMS[name])
    loss, _, values = run(fn, SEQS)
    loss.backward()
    expected = hand_tokens(name, PARAMS[name])
    assert loss.item() == pytest.approx(sum(e[0] for e in expected), rel=1e-12)
    assert response_grads(values, SEQS) == pytest.approx([e[1] for e in expected], rel=1e-12, abs=1e-15)


def test_ppo_clips_where_the_clipped_term_is_smaller_on_both_sides():
    # The fixed tensors exercise each case of min(r A, clip(r) A): the gradient is zero exactly on the three clipped
    # tokens (r above the band with A > 0 twice, below it with A < 0 once), not on r outside the band otherwise.
    fn = rl_losses.build_loss_fn("ppo", PARAMS["ppo"])
    loss, _, values = run(fn, SEQS)
    loss.backward()
    zero = [i for i, g in enumerate(response_grads(values, SEQS)) if g == 0.0]
    assert zero == [1, 4, 8, 9, 10]  # 4 clipped tokens + the token of the zero-advantage sequence


def test_gspo_clips_whole_sequences_and_stable_reinforce_truncates_tokens_and_drops_far_sequences():
    # gspo: the 5th sequence (geometric-mean ratio 1.49 > 1.2, A > 0) has no gradient on either token, though its
    # second token's own ratio (1.11) is inside the band; stable_reinforce truncates the 3rd sequence's last token
    # (ratio 2.01 > 2) to weight 2 and drops the 5th sequence (1.49 > 1.4) whole.
    grads = {}
    for name in ("gspo", "stable_reinforce"):
        loss, _, values = run(rl_losses.build_loss_fn(name, PARAMS[name]), SEQS)
        loss.backward()
        grads[name] = response_grads(values, SEQS)
    assert grads["gspo"][10:] == [0.0, 0.0] and all(g != 0.0 for g in grads["gspo"][:9])
    assert grads["stable_reinforce"][10:] == [0.0, 0.0]
    assert grads["stable_reinforce"][8] == pytest.approx(-2.0 * 2.0)  # -cap * A


@pytest.mark.parametrize("name", list(rl_losses.LOSS_PARAMS))
def test_gradient_is_the_batch_token_sum_across_micro_batches_and_ranks(name):
    # The engine backpropagates each micro batch's loss and FSDP averages gradients over ranks: with every loss
    # scaled by dp_size, two ranks of two micro batches give the one-batch gradient (Tinker's sum over tokens).
    fn = rl_losses.build_loss_fn(name, PARAMS[name])
    whole_loss, _, values = run(fn, SEQS)
    whole_loss.backward()
    whole = response_grads(values, SEQS)

    split, losses = [], []
    for rank_seqs in (SEQS[:2], SEQS[2:]):
        for seq in rank_seqs:  # one sequence per micro batch; padded to the batch's response length, as the engine does
            loss, _, values = run(fn, [seq], dp_size=2, max_response_len=4)
            loss.backward()
            losses.append(loss.item())
            split += [g / 2 for g in response_grads(values, [seq])]  # FSDP's mean over the 2 ranks
    assert split == pytest.approx(whole, rel=1e-12, abs=1e-15)
    assert sum(losses) / 2 == pytest.approx(whole_loss.item(), rel=1e-12)  # the engine's "loss": sum, then rank mean


@pytest.mark.parametrize("name", list(rl_losses.LOSS_PARAMS))
def test_metrics_reduce_to_token_weighted_batch_figures(name):
    # Micro batches of unequal token counts on two ranks, reduced as verl reduces them (append_to_dict per rank,
    # then the per-rank Metrics through aggregate_dp): each figure is over the whole batch's tokens.
    from verl.utils.py_functional import append_to_dict

    fn = rl_losses.build_loss_fn(name, PARAMS[name])
    per_rank = []
    for rank_batches in (([SEQS[0]], [SEQS[3]]), ([SEQS[1]], [SEQS[2], SEQS[4]])):  # equal micro batch counts
        gathered: dict = {}
        for seqs in rank_batches:
            append_to_dict(gathered, run(fn, seqs, dp_size=2, max_response_len=4)[1])
        per_rank.append(gathered)
    reduced = rl_losses.batch_metrics({key: [rank[key] for rank in per_rank] for key in per_rank[0]})

    tokens = [(p, q, a) for _, ps, qs, a in SEQS for p, q in zip(ps, qs)]
    expected = {
        rl_losses.PG_LOSS: sum(t[0] for t in hand_tokens(name, PARAMS[name])),
        rl_losses.PPO_KL: sum(q - p for p, q, _ in tokens) / N_TOKENS,
        rl_losses.ABS_LOG_RATIO: sum(abs(p - q) for p, q, _ in tokens) / N_TOKENS,
        rl_losses.RATIO_MEAN: sum(math.exp(p - q) for p, q, _ in tokens) / N_TOKENS,
        rl_losses.RATIO_MIN: min(math.exp(p - q) for p, q, _ in tokens),  # reduced over micro batches and ranks
        rl_losses.RATIO_MAX: max(math.exp(p - q) for p, q, _ in tokens),
    }
    if name in ("ppo", "cispo", "gspo", "stable_reinforce"):
        expected[rl_losses.CLIP_FRACTION] = sum(t[2] for t in hand_tokens(name, PARAMS[name])) / N_TOKENS
    assert reduced == pytest.approx(expected, rel=1e-12)
    assert {"ppo": 4, "cispo": 7, "gspo": 2, "stable_reinforce": 3}.get(name, 0) == round(reduced.get(rl_losses.CLIP_FRACTION, 0.0) * N_TOKENS)


REF = [[-1.2, -0.6, -1.5], [-0.3, -2.0], [-2.0, -0.4, -0.7, -1.0], [-0.9], [-0.5, -0.4]]  # the initial model's log-probs


def hand_kl(estimator: str, p: float, ref: float) -> tuple[float, float]:
    """verl's per-token KL estimator (joschu.net/blog/kl-approx.html) and its derivative in p."""
    if estimator == "k1":
        return p - ref, 1.0
    return math.exp(ref - p) - (ref - p) - 1, 1 - math.exp(ref - p)  # k3


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_kl_penalty_adds_kl_coef_times_the_estimators_token_sum_and_logs_its_mean(estimator):
    """With ref_log_prob in the batch and kl_coef > 0: loss = Tinker's loss + kl_coef x sum of the estimator, its
    gradient likewise, over micro batches and ranks as the policy term; kl_ref is the estimator's token mean and
    kl_loss the penalty's part. kl_coef 0 logs kl_ref and leaves the loss and gradient as they were."""
    from verl.utils.py_functional import append_to_dict

    coef, params = 0.25, PARAMS["ppo"]
    fn = rl_losses.build_loss_fn("ppo", params, kl_coef=coef, kl_estimator=estimator)
    loss, metrics, values = run(fn, SEQS, ref=REF)
    loss.backward()
    tokens = [(p, q, a, r) for (_, ps, qs, a), refs in zip(SEQS, REF) for p, q, r in zip(ps, qs, refs)]
    kls = [hand_kl(estimator, p, r) for p, _, _, r in tokens]
    policy = [hand("ppo", p, q, a, params) for p, q, a, _ in tokens]
    assert loss.item() == pytest.approx(sum(e[0] for e in policy) + coef * sum(k[0] for k in kls), rel=1e-12)
    assert response_grads(values, SEQS) == pytest.approx([e[1] + coef * k[1] for e, k in zip(policy, kls)], rel=1e-12, abs=1e-15)

    per_rank = []
    for rank in (([0], [3]), ([1], [2, 4])):
        gathered: dict = {}
        for micro in rank:
            append_to_dict(gathered, run(fn, [SEQS[i] for i in micro], dp_size=2, max_response_len=4, ref=[REF[i] for i in micro])[1])
        per_rank.append(gathered)
    reduced = rl_losses.batch_metrics({key: [r[key] for r in per_rank] for key in per_rank[0]})
    assert reduced[rl_losses.KL_REF] == pytest.approx(sum(k[0] for k in kls) / N_TOKENS, rel=1e-12)
    assert reduced[rl_losses.KL_LOSS] == pytest.approx(coef * sum(k[0] for k in kls), rel=1e-12)
    assert reduced[rl_losses.PG_LOSS] == pytest.approx(sum(e[0] for e in policy), rel=1e-12)

    unpenalised, metrics, values = run(rl_losses.build_loss_fn("ppo", params, kl_estimator=estimator), SEQS, ref=REF)
    assert unpenalised.item() == pytest.approx(sum(e[0] for e in policy), rel=1e-12)
    assert rl_losses.KL_LOSS not in metrics and metrics[rl_losses.KL_REF].aggregate() == pytest.approx(reduced[rl_losses.KL_REF])
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_log_prob"):
        run(fn, SEQS)


def test_batch_metrics_reduces_the_engines_plain_numbers_to_their_mean():
    # beside the loss's Metrics the engine reports plain numbers: one per rank, or per micro batch per rank
    reduced = rl_losses.batch_metrics({"loss": 4.5, "per_rank": [[1.0, 2.0], [6.0]], "name": "x", "none": None})
    assert reduced == {"loss": 4.5, "per_rank": 3.0}


def test_loss_fn_survives_pickling():
    # Ray ships the loss to every worker: the partial of a module-level function pickles and computes the same.
    fn = rl_losses.build_loss_fn("ppo", PARAMS["ppo"])
    again = pickle.loads(pickle.dumps(fn))
    assert again.func is rl_losses.tinker_rl_loss and again.keywords == fn.keywords
    first, second = run(fn, SEQS)[0], run(again, SEQS)[0]
    assert torch.equal(first, second)


def test_build_loss_fn_refuses_unknown_names_and_parameters():
    with pytest.raises(ValueError, match="unknown RL loss 'cross_entropy'"):
        rl_losses.build_loss_fn("cross_entropy", {})
    with pytest.raises(ValueError, match=r"takes parameters \['clip_high_threshold', 'clip_low_threshold'\], got \['beta'\]"):
        rl_losses.build_loss_fn("ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match=r"takes parameters \['beta'\], got \[\]"):
        rl_losses.build_loss_fn("dro", {})


def test_loss_mask_must_be_the_response_mask():
    model_output, data, _ = micro_batch(SEQS)
    data["loss_mask"][0, 0] = 0.0
    with pytest.raises(ValueError, match="loss_mask must equal response_mask"):
        rl_losses.build_loss_fn("importance_sampling", {})(model_output=model_output, data=data)


@pytest.mark.parametrize(
    "name, verl_mode",
    [("ppo", "vanilla"), ("cispo", "cispo"), ("dro", "dro"), ("gspo", "gspo")],
)
def test_agrees_with_verls_policy_loss_in_token_sum_mode(name, verl_mode):
    # verl's ppo_loss with its registry's loss and loss_agg_mode="token-sum" computes the same loss and gradient
    # (Tinker's thresholds on the ratio are verl's 1 - clip_ratio_low, 1 + clip_ratio_high; dual clip off). It
    # differs only where |log p - log q| > 20, which verl clamps (vanilla, cispo): not on these tensors.
    from functools import partial

    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    params = PARAMS[name]
    clip = {}
    if "clip_low_threshold" in params:
        clip = {"clip_ratio_low": 1 - params["clip_low_threshold"], "clip_ratio_high": params["clip_high_threshold"] - 1}
    config = ActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=verl_mode, dro_beta=params.get("beta", 0.1)),
        loss_agg_mode="token-sum", clip_ratio_c=1e9, use_kl_loss=False, entropy_coeff=0.0, **clip,
    )  # fmt: skip
    results = []
    for fn in (rl_losses.build_loss_fn(name, params), partial(ppo_loss, config=config)):
        loss, metrics, values = run(fn, SEQS)
        loss.backward()
        results.append((loss.item(), response_grads(values, SEQS), metrics))
    (ours, our_grads, our_metrics), (verls, verl_grads, verl_metrics) = results
    assert ours == pytest.approx(verls, rel=1e-12)
    assert our_grads == pytest.approx(verl_grads, rel=1e-12, abs=1e-15)
    # verl's ppo_kl is a micro-batch mean; with one micro batch on one rank it is the batch's too
    assert our_metrics[rl_losses.PPO_KL].aggregate() == pytest.approx(verl_metrics[rl_losses.PPO_KL].aggregate(), rel=1e-12)


def test_one_step_gradient_through_verls_engine_is_the_batch_token_sum(ray_address):
    # The scale the unit tests derive, checked on verl's real engine: 8 sequences over 2 CPU ranks x 2 micro
    # batches; the grad norm the workers report (no clipping) equals the norm of the driver's gradient of Tinker's
    # token sum over the whole batch. A token mean would be 27x smaller, a missing dp_size factor 2x.
    import ray
    from helpers import compose
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu

    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.workers import TinkerWorkers

    cfg = config.load(compose("optimizer.clip_grad=null", "backend.micro_batch_size=2", "trainer.steps=1"))
    path = str(model_dir(cfg.model))
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, path, validate(cfg).optimizer_values, "cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        prompt_lens, response_lens = [3, 5, 4, 2, 6, 3, 4, 5], [4, 2, 5, 3, 1, 6, 2, 4]
        advantages = [1.0, -0.5, 2.0, -1.0, 0.5, -2.0, 1.5, -1.5]
        seqs = [torch.randint(0, model.config.vocab_size, (p + r,), generator=gen) for p, r in zip(prompt_lens, response_lens)]
        driver_loss, sampler_log_probs = 0.0, []
        for seq, p, a in zip(seqs, prompt_lens, advantages):
            log_probs = torch.log_softmax(model(seq[None]).logits[0], -1)[p - 1 : -1].gather(-1, seq[p:, None])[:, 0]
            sampler_log_probs.append(log_probs.detach())  # the "sampler" is the same weights: ratio 1 up to numerics
            driver_loss = driver_loss - (torch.exp(log_probs - log_probs.detach()) * a).sum()
        driver_loss.backward()
        driver_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()

        B, R = len(seqs), max(response_lens)
        mask, old, adv = torch.zeros(B, R), torch.zeros(B, R), torch.zeros(B, R)
        for i, (r, lp, a) in enumerate(zip(response_lens, sampler_log_probs, advantages)):
            mask[i, :r], old[i, :r], adv[i, :r] = 1.0, lp, a

        def nested(rows):
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

        batch = TensorDict(
            {
                "input_ids": nested(seqs),
                "position_ids": nested([torch.arange(len(s)) for s in seqs]),
                "prompts": nested([s[:p] for s, p in zip(seqs, prompt_lens)]),
                "responses": nested([s[p:] for s, p in zip(seqs, prompt_lens)]),
                "attention_mask": torch.ones(B, max(len(s) for s in seqs), dtype=torch.long),
                "response_mask": mask,
                "loss_mask": mask.clone(),
                "old_log_probs": old,
                "advantages": adv,
            },
            batch_size=[B],
        )
        tu.assign_non_tensor(batch, global_batch_size=B, temperature=1.0, calculate_entropy=False, max_response_len=R,
                             global_token_num=[len(s) for s in seqs])  # fmt: skip
        workers.ready()
        ray.get(workers.group.execute_all_async("set_loss_fn", rl_losses.build_loss_fn("importance_sampling", {})))
        output = workers.group.forward_backward(batch).get()
        metrics = rl_losses.batch_metrics(output.get_non_tensor("metrics"))
        grad_norm = workers.group.optimizer_step(optim_step_params={"lr": 0.0})[0]["grad_norm"]
    finally:
        workers.shutdown()
    print(f"engine grad norm {grad_norm:.6g}, driver token-sum grad norm {driver_norm:.6g}, loss {metrics['loss']:.6g}, "
          f"mismatch {metrics[rl_losses.ABS_LOG_RATIO]:.3g}")  # fmt: skip
    assert grad_norm == pytest.approx(driver_norm, rel=1e-4)
    assert metrics["loss"] == pytest.approx(driver_loss.item(), rel=1e-4)
    assert metrics[rl_losses.PG_LOSS] == pytest.approx(driver_loss.item(), rel=1e-4)
    assert metrics[rl_losses.ABS_LOG_RATIO] < 1e-5
