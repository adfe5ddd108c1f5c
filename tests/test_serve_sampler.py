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
