"""The RL config nodes (env, rl, loss): their defaults, every option in conf/env and conf/loss, each bad value as
one line naming the key, and check_rl's rules across groups. Pure: composes and checks, starts nothing."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from helpers import CONF_DIR, REPO, compose, run_main
from tinker_exp.config.rl import LOSS_PARAMETERS, RL_LOSSES, LossConfig, LossName, check_rl
from tinker_exp.errors import ConfigError
from tinker_exp.run import validate


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def typed(*overrides: str):
    return OmegaConf.to_object(compose(*overrides))


def test_the_default_run_is_sft_as_before():
    """No env, cross_entropy: check_rl has nothing to say and the SFT checks pass as they did."""
    cfg = typed()
    assert cfg.loss.name is LossName.cross_entropy and cfg.loss.params == {} and not cfg.loss.is_rl
    assert not cfg.env.active
    check_rl(cfg)
    validate(cfg)


def test_the_loss_options_are_tinkers_losses():
    assert options("loss") == sorted(name.value for name in LossName) == sorted(LOSS_PARAMETERS)
    assert set(RL_LOSSES) == set(LOSS_PARAMETERS) - {"cross_entropy"}


@pytest.mark.parametrize("loss", options("loss"))
def test_every_loss_option_composes_with_tinkers_parameter_defaults(loss):
    cfg = typed(f"loss={loss}", *(["env=digits"] if loss != "cross_entropy" else []))
    check_rl(cfg)
    assert cfg.loss.name.value == loss and cfg.loss.params == LOSS_PARAMETERS[loss]


def test_tinkers_documented_defaults():
    """Tinker's docs: ppo clips the ratio to [0.8, 1.2] (epsilon 0.2), cispo caps it at 4 with no lower bound."""
    assert typed("loss=ppo").loss.params == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert typed("loss=cispo").loss.params == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert typed("loss=gspo").loss.params == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}  # GSPO's paper
    assert typed("loss=stable_reinforce").loss.params == {"ratio_cap": 2.0, "sequence_ratio_bound": 2.0}  # ours


def test_a_set_parameter_replaces_its_default_only():
    assert typed("loss=ppo", "loss.clip_high_threshold=1.28").loss.params == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
    }
    assert typed("loss=dro", "loss.beta=0.5").loss.params == {"beta": 0.5}


@pytest.mark.parametrize("env", options("env"))
def test_every_env_option_composes_with_an_rl_loss_and_the_default_data(env):
    """The env replaces the data set: the data group's defaults (and the SFT checks) do not refuse it."""
    cfg = typed(f"env={env}", "loss=importance_sampling")
    assert cfg.env.active and cfg.env.name == env and cfg.env.reward and cfg.env.eval_prompts
    check_rl(cfg)
    validate(cfg)


def test_your_own_env_is_two_keys_without_a_group():
    cfg = typed("env.prompts=rows.jsonl", "env.reward=my_rewards:score", "loss=ppo")
    assert cfg.env.active and cfg.env.name is None and cfg.env.selected_as == "env.prompts=rows.jsonl"
    check_rl(cfg)


def test_the_rl_defaults():
    rl = typed().rl
    assert (rl.group_size, rl.prompts_per_step, rl.temperature, rl.advantage.value, rl.kl_coef) == (8, 4, 1.0, "grpo", 0.0)
    assert (rl.updates_per_batch, rl.kl_estimator, rl.log_kl_ref, rl.max_steps_off_policy) == (1, "k3", False, 0)
    assert rl.responses_per_step == 32 and not rl.uses_reference


def test_a_kl_penalty_and_several_updates_per_batch_are_accepted():
    """kl_coef > 0 was refused before the penalty existed; it needs the initial model's log-probs, as the metric does."""
    cfg = typed("env=digits", "loss=ppo", "rl.kl_coef=0.1", "rl.kl_estimator=k1", "rl.updates_per_batch=4")
    validate(cfg)
    assert cfg.rl.uses_reference and typed("rl.log_kl_ref=true").rl.uses_reference


BAD_VALUES = [
    (["rl.group_size=1"], "rl.group_size: must be >= 2, got 1 (advantages compare the responses to one prompt)"),
    (["rl.prompts_per_step=0"], "rl.prompts_per_step: must be >= 1, got 0"),
    (["rl.temperature=0"], "rl.temperature: must be > 0 (and finite), got 0.0"),
    (["rl.temperature=-1"], "rl.temperature: must be > 0 (and finite), got -1.0"),
    (["rl.temperature=inf"], "rl.temperature: must be > 0 (and finite), got inf"),
    (["rl.kl_coef=-0.1"], "rl.kl_coef: must be >= 0 (and finite), got -0.1"),
    (["rl.kl_estimator=k4"], "rl.kl_estimator: 'k4' is not one of verl's KL estimators: k1, k2, k3, k1+, k3+, kl, mse, low_var_kl, abs"),
    (["rl.updates_per_batch=0"], "rl.updates_per_batch: must be >= 1 (optimizer steps per sampled batch), got 0"),
    (["rl.updates_per_batch=1.5"], "rl.updates_per_batch: expected an integer, got 1.5 (float)"),
    (["rl.max_steps_off_policy=-1"], "rl.max_steps_off_policy: must be >= 0 (0: synchronous), got -1"),
    (
        ["rl.max_steps_off_policy=2", "rl.updates_per_batch=4"],
        "rl.max_steps_off_policy=2 needs rl.updates_per_batch=1, got 4 (an off-policy run samples a batch for every "
        "optimizer step)",
    ),
    (["rl.advantage=gae"], "rl.advantage: expected one of grpo, mean_centred, got 'gae'"),
    (["env=digits", "env.max_new_tokens=0"], "env.max_new_tokens: must be >= 1, got 0"),
    (["env.prompts=rows.jsonl"], "env.prompts=rows.jsonl needs env.reward=package.module:function (the reward)"),
    (["env.reward=m:f"], "env.reward=m:f needs env.prompts=FILE (the training prompts)"),
    (["env.eval_prompts=held.jsonl"], "env.eval_prompts=held.jsonl needs env.prompts=FILE (the training prompts)"),
    (["env.name=mine"], "env.name=mine needs env.prompts=FILE and env.reward=package.module:function"),
    (["loss=foo"], "loss=foo: loss has no option foo (options: cispo, cross_entropy, dro, gspo, importance_sampling, ppo, stable_reinforce)"),
    (["env=foo"], "env=foo: env has no option foo (options: arithmetic, digits)"),
    (["loss.name=foo"], "loss.name: expected one of cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce, got 'foo'"),
    (
        ["loss=importance_sampling", "loss.clip_low_threshold=0.9"],
        "loss.clip_low_threshold: importance_sampling takes no clip_low_threshold (it has no parameters); "
        "set it to null or choose another loss",
    ),
    (
        ["loss=ppo", "loss.beta=0.1"],
        "loss.beta: ppo takes no beta (its parameters: clip_low_threshold, clip_high_threshold); set it to null or "
        "choose another loss",
    ),
    (
        ["loss=ppo", "loss.clip_low_threshold=1.5"],
        "loss.clip_low_threshold=1.5 and loss.clip_high_threshold=1.2: ppo needs 0 <= clip_low_threshold <= 1 <= "
        "clip_high_threshold (bounds of the ratio, which is 1 on-policy)",
    ),
    (
        ["loss=cispo", "loss.clip_high_threshold=0.5"],
        "loss.clip_low_threshold=0.0 and loss.clip_high_threshold=0.5: cispo needs 0 <= clip_low_threshold <= 1 <= "
        "clip_high_threshold (bounds of the ratio, which is 1 on-policy)",
    ),
    (["loss=ppo", "loss.clip_low_threshold=nan"], "loss.clip_low_threshold: expected a finite number, got nan"),
    (["loss=dro", "loss.beta=0"], "loss.beta: dro needs beta > 0, got 0.0"),
    (
        ["loss=gspo", "loss.clip_high_threshold=0.9"],
        "loss.clip_low_threshold=0.9997 and loss.clip_high_threshold=0.9: gspo needs 0 <= clip_low_threshold <= 1 <= "
        "clip_high_threshold (bounds of the ratio, which is 1 on-policy)",
    ),
    (["loss=stable_reinforce", "loss.ratio_cap=0.5"], "loss.ratio_cap: stable_reinforce needs ratio_cap >= 1 (the ratio is 1 on-policy), got 0.5"),
    (["loss=stable_reinforce", "loss.sequence_ratio_bound=1"], "loss.sequence_ratio_bound: stable_reinforce needs sequence_ratio_bound > 1, got 1.0"),
    (
        ["loss=ppo", "loss.ratio_cap=3"],
        "loss.ratio_cap: ppo takes no ratio_cap (its parameters: clip_low_threshold, clip_high_threshold); set it to "
        "null or choose another loss",
    ),
]


@pytest.mark.parametrize("args, line", BAD_VALUES, ids=[" ".join(args) for args, _ in BAD_VALUES])
def test_a_bad_rl_value_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, args, line):
    """Through the CLI's entry, as typed: nothing is written to the run dir."""
    code, out, err = run_main(monkeypatch, capsys, *args, f"hydra.run.dir={tmp_path / 'run'}", "dry_run=true")
    assert code == 2, err
    assert err.strip().splitlines() == [f"tinker_exp: config error: {line}"], err
    assert "Traceback" not in out + err
    assert not (tmp_path / "run").exists()


CROSS_GROUP = [
    (
        ["loss=ppo"],
        "loss.name=ppo needs an env to sample from (env=digits, env=arithmetic, or your own: env.prompts=FILE "
        "env.reward=package.module:function); without one, use loss=cross_entropy",
    ),
    (
        ["env=digits"],
        "env=digits trains with an RL loss, not loss.name=cross_entropy: add loss=importance_sampling (or ppo, cispo, dro, gspo, stable_reinforce)",
    ),
    (
        ["env.prompts=rows.jsonl", "env.reward=m:f"],
        "env.prompts=rows.jsonl trains with an RL loss, not loss.name=cross_entropy: add loss=importance_sampling "
        "(or ppo, cispo, dro, gspo, stable_reinforce)",
    ),
    (
        ["env=digits", "loss=ppo", "rl.prompts_per_step=3", "rl.group_size=2"],
        "rl.prompts_per_step=3 x rl.group_size=2 = 6 responses per step do not split over backend.num_workers=2 x "
        "backend.micro_batch_size=2 = 4: make prompts_per_step x group_size a multiple of 4, or change "
        "backend.micro_batch_size",
    ),
    (
        ["env=digits", "loss=ppo", "backend.num_workers=3"],
        "rl.prompts_per_step=4 x rl.group_size=8 = 32 responses per step do not split over backend.num_workers=3 x "
        "backend.micro_batch_size=2 = 6: make prompts_per_step x group_size a multiple of 6, or change "
        "backend.micro_batch_size",
    ),
    (
        ["env=digits", "loss=ppo", "backend.nodes=3", "backend.micro_batch_size=1"],
        "rl.prompts_per_step=4 x rl.group_size=8 = 32 responses per step do not split over backend.num_workers=2 x "
        "backend.nodes=3 x backend.micro_batch_size=1 = 6: make prompts_per_step x group_size a multiple of 6, or "
        "change backend.micro_batch_size",
    ),
]


@pytest.mark.parametrize("args, message", CROSS_GROUP, ids=[" ".join(args) for args, _ in CROSS_GROUP])
def test_check_rl_refuses_what_no_group_can_see_alone(args, message):
    with pytest.raises(ConfigError) as info:
        check_rl(typed(*args))
    assert str(info.value) == message


def test_docs_quote_the_split_refusal_as_check_rl_words_it():
    _, message = CROSS_GROUP[3]
    assert f"tinker_exp: config error: {message}" in (REPO / "docs" / "rl.md").read_text().splitlines()


@pytest.mark.parametrize(
    "prompts, group, workers, micro, nodes, splits",
    [(4, 8, 2, 2, 1, True), (3, 4, 2, 2, 1, True), (3, 2, 2, 2, 1, False), (1, 2, 2, 1, 1, True), (1, 2, 1, 4, 1, False),
     (4, 3, 2, 2, 3, True), (5, 3, 2, 1, 1, False)],  # fmt: skip
)
def test_the_split_rule_is_whole_micro_batches_on_every_worker(prompts, group, workers, micro, nodes, splits):
    """Refused exactly when some worker would get a share that is not whole micro batches."""
    responses = prompts * group
    per_worker, left = divmod(responses, workers * nodes)
    assert splits == (left == 0 and per_worker % micro == 0)  # the rule, stated independently
    cfg = typed("env=digits", "loss=ppo", f"rl.prompts_per_step={prompts}", f"rl.group_size={group}",
                f"backend.num_workers={workers}", f"backend.micro_batch_size={micro}", f"backend.nodes={nodes}")  # fmt: skip
    if splits:
        check_rl(cfg)
    else:
        with pytest.raises(ConfigError, match="do not split over"):
            check_rl(cfg)


def test_check_rl_reads_any_config_like_object():
    """rl-core passes the root Config; anything with the four nodes works (the rule names no type)."""
    base = typed("env=digits", "loss=ppo")
    check_rl(SimpleNamespace(env=base.env, rl=base.rl, loss=LossConfig(name=LossName.dro), backend=base.backend))
