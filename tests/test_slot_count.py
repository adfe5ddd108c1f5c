"""hydra.launcher.slots=auto: how many trials a sweep trains at once on one group (tinker_exp/sweep/slot_count.py).
The rule's bookkeeping on real configs; the real sweep that takes it is tests/test_pool.py's slot tests."""

import json

import pytest

from helpers import compose
from tinker_exp import config
from tinker_exp.sweep.slot_count import AUTO_SLOTS_MAX, auto_slots, model_sizes, slot_mb, varied_keys

LORA = config.load(compose("lora=r8"))


def test_lora_trials_take_as_many_slots_as_the_sweep_has_trials_up_to_the_cap():
    assert auto_slots([LORA], 3, {"trainer.seed"}, None, 20_000, "cpu")[0] == 3
    k, why = auto_slots([LORA], 50, {"optimizer.lr"}, None, 20_000, "cpu")
    assert k == AUTO_SLOTS_MAX, why
    assert "MiB a slot" in why and f"at most {AUTO_SLOTS_MAX}" in why
    assert auto_slots([LORA], 50, {"optimizer.lr"}, 3, 20_000, "cpu")[0] == 3  # max_parallel bounds it too


@pytest.mark.parametrize(
    "overrides, swept, why",
    [
        ([], set(), "lora.rank=0: full fine-tuning keeps one trial per group"),
        (["lora=r8", "env=digits", "loss=importance_sampling"], set(), "each RL trial's sampler holds its own copy of the model"),
        (["lora=r8"], {"lora.rank", "optimizer.lr"}, "the sweep varies lora.rank: trials of other shapes cannot share a group"),
        (["lora=r8"], {"lora"}, "the sweep varies lora:"),
        (["lora=r8"], {"model.path"}, "the sweep varies model.path:"),
    ],
    ids=["full-fine-tuning", "rl", "lora-rank-swept", "lora-group-swept", "model-swept"],
)  # fmt: skip
def test_trials_that_cannot_share_a_group_keep_a_process_each(overrides, swept, why):
    k, said = auto_slots([config.load(compose(*overrides))], 8, swept, None, 20_000, "cpu")
    assert k == 1 and why in said, said


def test_one_trial_and_no_memory_room_keep_a_process_each():
    assert auto_slots([LORA], 1, set(), None, 20_000, "cpu") == (1, "one trial")
    per_slot = slot_mb(LORA, "cpu")
    k, why = auto_slots([LORA], 8, set(), None, 2 * (3.5 * per_slot + 1.0), "cpu")  # half of it for slots: 3 fit
    assert k == 3, why
    assert auto_slots([LORA], 8, set(), None, 0.001, "cpu")[0] == 1


def test_a_slots_memory_grows_with_its_rank_and_its_tokens_and_is_counted_at_16_bits_on_a_gpu():
    r32, long_rows = config.load(compose("lora=r32")), config.load(compose("lora=r8", "data.max_length=256"))
    assert slot_mb(r32, "cpu") > slot_mb(LORA, "cpu")
    assert slot_mb(long_rows, "cpu") > slot_mb(LORA, "cpu")
    assert slot_mb(LORA, "cuda") != slot_mb(LORA, "cpu")
    assert slot_mb(config.load(compose("lora=r8", "backend.gradient_checkpointing=true")), "cpu") < slot_mb(LORA, "cpu")


def test_a_local_models_sizes_come_from_its_config_json_and_an_unknown_one_bounds_by_the_cap_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "vocab_size": 151936}))
    cfg = config.load(compose("lora=r8"))
    cfg.model.path = str(tmp_path)
    assert model_sizes(cfg.model) == (1536, 8960, 28, 151936)
    assert slot_mb(cfg, "cuda") > 100 * slot_mb(LORA, "cuda")  # a 1.5B model's rows: far more than the tiny model's
    cfg.model.path = str(tmp_path / "absent")
    k, why = auto_slots([cfg], 20, set(), None, 80_000, "cuda")
    assert k == AUTO_SLOTS_MAX and "memory not estimated" in why


def test_the_keys_a_sweep_varies():
    points = [["lora=r8", "trainer.seed=0", "+x=1"], ["lora=r8", "trainer.seed=1"], ["lora=r8", "trainer.seed=1", "+x=1"]]
    assert varied_keys(points) == {"trainer.seed", "x"}
    assert varied_keys([["a=1"]]) == set()
