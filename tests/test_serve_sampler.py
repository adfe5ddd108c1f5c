"""The served sampler's weights without workers: a LoRA adapter as export_adapter writes it (peft's format), merged
into the base weights, gives the adapted model's log-probs; a seeded request leaves the sampler's own state alone."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_path():
    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir

    return model_dir(ModelConfig())


def test_a_merged_adapter_gives_the_adapted_models_logits(model_path, tmp_path):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tinker_exp.config.schema import LoraConfig
    from tinker_exp.runtime.lora import merge_adapter, peft_config

    torch.set_num_threads(1)  # as the driver's sampler runs (runtime/sampler.py); more crawl on a loaded machine
    torch.manual_seed(0)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), peft_config(LoraConfig(rank=4, alpha=8)))
    with torch.no_grad():
        for name, tensor in adapted.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                tensor.normal_(0, 0.05)
    state = {name: tensor for name, tensor in adapted.state_dict().items() if "lora_" in name}
    adapted.save_pretrained(tmp_path, state_dict=state)  # as runtime/lora.py export_adapter writes it
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    merged = merge_adapter(base, tmp_path)
    assert all(torch.equal(base[name], tensor) for name, tensor in plain.state_dict().items())  # base left as it was
    changed = [name for name in base if not torch.equal(base[name], merged[name])]
    assert len(changed) == len(state) // 2  # one weight per adapted layer (its A and B)
    plain.load_state_dict(merged)
    tokens = torch.tensor([[1, 5, 9, 30, 7, 2]])
    with torch.no_grad():
        want, got = adapted(tokens).logits, plain(tokens).logits
    assert not torch.allclose(want, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)(tokens).logits, atol=1e-3)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_a_seeded_sample_repeats_and_leaves_the_samplers_state(model_path):
    from tinker_exp.runtime.serve_sampler import ServedSampler

    sampler = ServedSampler(model_path, seed=3)
    sampler.use("base", sampler.base)
    running = sampler.sampler.rng_state()
    seeded = [sampler.sample([1, 5, 9], 2, 6, 1.0, seed=11) for _ in range(2)]
    assert [s.response_ids for s in seeded[0]] == [s.response_ids for s in seeded[1]]
    assert sampler.sampler.rng_state() == running
    unseeded = sampler.sample([1, 5, 9], 2, 6, 1.0, seed=None)
    assert sampler.sampler.rng_state() != running and unseeded


@pytest.fixture(scope="module")
def base_sampler(model_path):
    from tinker_exp.runtime.serve_sampler import ServedSampler

    sampler = ServedSampler(model_path, seed=3)
    sampler.use("base", sampler.base)
    return sampler


PROMPT = [1, 5, 9, 30]


def test_a_stop_token_or_string_ends_the_response_where_it_first_appears(base_sampler):
    """With one seed the draws are the same with or without stops, so a response with a stop is the unstopped
    one up to and with its first stop: a token id, or the first token whose text completes a stop string."""
    free = base_sampler.sample(PROMPT, 1, 12, 1.0, seed=5, stop=[])[0]
    assert len(free.response_ids) == 12 and not free.stopped  # [] stops at nothing, not even the model's stops
    token = free.response_ids[4]
    first = free.response_ids.index(token)
    by_id = base_sampler.sample(PROMPT, 1, 12, 1.0, seed=5, stop=[token])[0]
    assert by_id.response_ids == free.response_ids[: first + 1] and by_id.stopped
    assert by_id.log_probs == free.log_probs[: first + 1]
    tokenizer = base_sampler.sampler.tokenizer
    texts = [tokenizer.decode(free.response_ids[:i]) for i in range(13)]
    end = next(i for i in range(3, 13) if texts[i][-2:].isalnum() and texts[i][-2:] not in texts[i - 1])
    by_string = base_sampler.sample(PROMPT, 1, 12, 1.0, seed=5, stop=[texts[end][-2:]])[0]
    assert by_string.response_ids == free.response_ids[:end] and by_string.stopped
    default = base_sampler.sample(PROMPT, 1, 12, 1.0, seed=5)[0]  # None: the model's own stop tokens
    stops = base_sampler.sampler.stop_ids
    assert default.stopped == any(t in stops for t in default.response_ids) and (not default.stopped or default.response_ids[-1] in stops)


def test_top_k_one_and_a_tiny_top_p_draw_the_most_likely_token_with_log_prob_zero(base_sampler):
    import torch

    greedy = [base_sampler.sample(PROMPT, 2, 8, 1.0, seed=seed, stop=[], top_k=1) for seed in (1, 2)]
    nucleus = base_sampler.sample(PROMPT, 1, 8, 1.0, seed=3, stop=[], top_p=1e-6)[0]
    rows = [s.response_ids for samples in greedy for s in samples]
    assert all(row == rows[0] for row in rows) and nucleus.response_ids == rows[0]
    assert all(lp == 0.0 for samples in greedy for s in samples for lp in s.log_probs)  # one token kept: all its mass
    with torch.no_grad():  # the most likely token, step by step, as the plain model sees it
        want = base_sampler.sampler.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8,
                                                   eos_token_id=[], pad_token_id=base_sampler.sampler.pad_id)
    assert rows[0] == want[0, len(PROMPT):].tolist()
    # top_p 0.5: each token's log-prob is renormalised over the kept mass (>= 0.5): raw <= it <= raw + log 2
    import math

    gaps = []
    for sample in base_sampler.sample(PROMPT, 4, 8, 1.0, seed=4, stop=[], top_p=0.5):
        raw = base_sampler.prompt_log_probs(PROMPT + sample.response_ids)[len(PROMPT):]
        gaps += [lp - r for lp, r in zip(sample.log_probs, raw)]
    assert all(-1e-5 <= gap <= math.log(2) + 1e-5 for gap in gaps) and max(gaps) > 1e-3, gaps


def test_prompt_log_probs_are_the_sampled_tokens_log_probs_when_they_are_the_prompt(base_sampler):
    """One forward pass over prompt + response scores each response token as sampling did (temperature 1): the
    generation's cached steps and the single pass agree to float rounding; the first prompt token has none (NaN)."""
    import math

    sample = base_sampler.sample(PROMPT, 1, 8, 1.0, seed=7, stop=[])[0]
    scored = base_sampler.prompt_log_probs(PROMPT + sample.response_ids)
    assert len(scored) == len(PROMPT) + len(sample.response_ids) and math.isnan(scored[0])
    assert max(abs(a - b) for a, b in zip(scored[len(PROMPT):], sample.log_probs)) < 1e-5
