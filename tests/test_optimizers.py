"""The optimizer table held to the real torch optimizers verl builds; overrides refused before launch by it; the
Muon + AdamW multi-optimizer's split, flattening, scheduler and state (in one process; the 2-worker runs are in
test_optimizers_ray.py)."""

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from helpers import compose, run_cli, run_module
from tinker_exp.config.schema import OptimizerConfig, OptimizerName
from tinker_exp.errors import ConfigError
from tinker_exp.optim.convert import RANGES
from tinker_exp.optim.optimizers import AUTO, CHOICE, COEFFS, FLAG, FLOAT, INT, OPTIMIZERS, PAIR, STATE, VOCABULARY, verl_optimizer_fields
from tinker_exp.optim.plan import build_plan, optimizer_values

KIND_TYPES = {FLOAT: float, PAIR: tuple, FLAG: bool, INT: int, COEFFS: tuple, CHOICE: str, AUTO: type(None), STATE: float}
PLAIN = [name for name, spec in OPTIMIZERS.items() if spec.impl == "torch.optim"]


def config(name: str, **fields) -> OptimizerConfig:
    return OptimizerConfig(name=OptimizerName(name), **fields)


def built_by_verl(name: str, model: torch.nn.Module, **fields):
    """The optimizer verl's build_optimizer makes from the FSDPOptimizerConfig fields the workers pass."""
    from verl.workers.config import FSDPOptimizerConfig, build_optimizer

    cfg = config(name, **fields)
    verl_fields = verl_optimizer_fields(name, optimizer_values(cfg))
    if name == "Muon":
        verl_fields["override_optimizer_config"]["param_names"] = [[n, list(p.shape)] for n, p in model.named_parameters()]
    return build_optimizer(model.parameters(), FSDPOptimizerConfig(**verl_fields))


def test_the_schema_offers_exactly_the_tables_optimizers():
    assert [name.value for name in OptimizerName] == list(OPTIMIZERS)
    assert set(VOCABULARY) == set(RANGES)  # every key that can be sent has its range


@pytest.mark.parametrize("name", PLAIN)
def test_the_table_holds_each_real_optimizers_groups(name):
    """Every group key and the type of its value, as verl builds the optimizer from our converted values."""
    optimizer = built_by_verl(name, torch.nn.Linear(4, 3))
    (part,) = OPTIMIZERS[name].parts.values()
    assert type(optimizer) is getattr(torch.optim, name) and part.torch_class == f"torch.optim.{name}"
    for group in optimizer.param_groups:
        assert {key: type(value) for key, value in group.items() if key != "params"} == {
            key: KIND_TYPES[kind] for key, kind in part.keys.items()
        }
        assert all(type(beta) is float for beta in group.get("betas", ()))


@pytest.mark.parametrize(
    "name, sendable",
    [
        ("AdamW", ("lr", "betas", "eps", "weight_decay", "grad_clip_norm")),
        ("Adam", ("lr", "betas", "eps", "weight_decay", "grad_clip_norm")),
        ("SGD", ("lr", "weight_decay", "momentum", "dampening", "grad_clip_norm")),
        ("RMSprop", ("lr", "eps", "weight_decay", "momentum", "alpha", "grad_clip_norm")),
        ("Adagrad", ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value", "grad_clip_norm")),
        ("NAdam", ("lr", "betas", "eps", "weight_decay", "momentum_decay", "grad_clip_norm")),
        ("RAdam", ("lr", "betas", "eps", "weight_decay", "grad_clip_norm")),
        ("Adamax", ("lr", "betas", "eps", "weight_decay", "grad_clip_norm")),
        ("Muon", ("lr", "weight_decay", "grad_clip_norm")),
        ("AdamWScheduleFree", ("lr", "betas", "eps", "weight_decay", "r", "warmup_steps", "weight_lr_power", "grad_clip_norm")),
    ],
)
def test_each_optimizer_accepts_its_own_keys(name, sendable):
    assert OPTIMIZERS[name].sendable == sendable
    plan = build_plan(OmegaConf.create({key: [0.5, 0.5] if key == "betas" else 0.5 for key in sendable}), config(name), 3)
    assert set(plan[2]) == set(sendable)


@pytest.mark.parametrize(
    "name, override, message",
    [
        ("Muon", {"betas": [0.9, 0.95]},
         "override.betas: optimizer Muon: its sub-optimizer muon has no param-group key betas; "
         "keys Muon accepts: lr, weight_decay, grad_clip_norm"),
        ("Muon", {"eps": 1e-8},
         "override.eps: optimizer Muon: eps means different things in its sub-optimizers (muon: the Newton-Schulz "
         "iteration's eps; adamw: the usual one); one value cannot serve both; keys Muon accepts: lr, weight_decay, grad_clip_norm"),
        ("Muon", {"momentum": 0.9}, "override.momentum: optimizer Muon: its sub-optimizer adamw has no param-group key momentum"),
        ("Muon", {"ns_steps": 3}, "override.ns_steps: optimizer Muon holds ns_steps as an int: only float keys can be sent per step"),
        ("SGD", {"betas": [0.9, 0.95]}, "override.betas: optimizer SGD has no param-group key betas; keys SGD accepts: lr, weight_decay, momentum, dampening, grad_clip_norm"),
        ("SGD", {"nesterov": True}, "override.nesterov: optimizer SGD holds nesterov as a bool: only float keys can be sent per step"),
        ("AdamW", {"amsgrad": True}, "override.amsgrad: optimizer AdamW holds amsgrad as a bool: only float keys"),
        ("AdamW", {"foreach": None, "momentum": 0.9}, "override.momentum: optimizer AdamW has no param-group key momentum"),
        ("AdamW", {"foreach": False}, "override.foreach: optimizer AdamW holds foreach as a None: only float keys"),
        ("AdamW", {"grad_clip_norm": -1.0}, "override.grad_clip_norm: must be >= 0, got -1.0"),
        ("Muon", {"grad_clip_norm": {"schedule": "linear", "start": 1.0, "end": -1.0}}, "override.grad_clip_norm.end: must be >= 0, got -1.0"),
        ("RMSprop", {"momentum": 1.0}, "override.momentum: 1.0 is not in [0, 1)"),
        ("SGD", {"momentum": {"schedule": "linear", "start": 0.5, "end": 1.5}}, "override.momentum.end: 1.5 is not in [0, 1)"),
        ("SGD", {"beta1": 0.9}, "override.beta1 (betas[0]): optimizer SGD has no param-group key betas"),
        ("AdamW", {"learning_rate": 1e-3, "lr": 1e-3}, "override.learning_rate: lr is set too (one key in two spellings: Tinker's and verl's); keep one"),
        ("AdamW", {"beta2": 0.95, "betas": [0.9, 0.95]}, "override.beta2: betas is set too (one key in two spellings: Tinker's and verl's); keep one"),
    ],
)
def test_overrides_the_optimizer_cannot_take_are_refused_before_launch(name, override, message):
    with pytest.raises(ConfigError) as info:
        build_plan(OmegaConf.create(override), config(name), total_steps=5)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_tinker_adam_params_spellings_become_verls_keys():
    ramp = {"schedule": "linear", "start": 0.8, "end": 0.9}
    plan = build_plan(OmegaConf.create({"learning_rate": 2e-4, "beta1": ramp}), OptimizerConfig(), total_steps=3)
    verl_spelling = build_plan(OmegaConf.create({"lr": 2e-4, "betas": [ramp, 0.999]}), OptimizerConfig(), total_steps=3)
    assert list(plan) == list(verl_spelling)
    assert [step["lr"] for step in plan] == [2e-4] * 3 and plan[1]["betas"][0] > plan[0]["betas"][0] == 0.8
    assert set(plan.schedules) == {"betas[0]"}  # a schedule on beta1 is one on betas[0]
    assert build_plan(OmegaConf.create({"beta2": 0.95}), OptimizerConfig(), 1)[0] == {"betas": (0.9, 0.95)}


def test_sgd_nesterov_needs_momentum_and_no_dampening():
    with pytest.raises(ConfigError, match=r"optimizer.nesterov: true needs momentum > 0 and dampening 0"):
        config("SGD", nesterov=True, momentum=0.0)
    assert optimizer_values(config("SGD", nesterov=True, momentum=0.9))["nesterov"] is True


def test_cli_refuses_betas_for_muon_in_one_line_before_any_worker(tmp_path):
    result = run_cli("optimizer=muon", "+override.betas=[0.9,0.95]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["tinker_exp: config error: override.betas: optimizer Muon: its sub-optimizer muon has no "
                     "param-group key betas; keys Muon accepts: lr, weight_decay, grad_clip_norm"]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("option", ["adamw", "adam", "sgd", "rmsprop", "adagrad", "nadam", "radam", "adamax", "muon", "adamw_schedulefree"])
def test_every_optimizer_option_composes_and_plans(option):
    from tinker_exp.config.validate import load

    cfg = load(compose(f"optimizer={option}"))
    assert cfg.optimizer.name.value in OPTIMIZERS
    build_plan(None, cfg.optimizer, cfg.trainer.steps)


def test_muon_with_lora_is_refused():
    from tinker_exp.config.validate import check, load

    with pytest.raises(ConfigError, match=r"optimizer.name: Muon with lora.rank=8 is not supported"):
        check(load(compose("optimizer=muon", "lora=r8")))


# --- Muon + AdamW in one process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir
    from transformers import AutoModelForCausalLM

    path = model_dir(ModelConfig())
    return path, AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def test_muon_holds_the_blocks_matrices_and_adamw_the_rest(tiny_llama):
    path, model = tiny_llama
    optimizer = built_by_verl("Muon", model)
    layer = [f"model.layers.{i}.{m}.weight" for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") for i in (0, 1)]
    assert sorted(optimizer.names["muon"]) == sorted(layer)
    assert sorted(optimizer.names["adamw"]) == sorted(
        ["model.embed_tokens.weight", "model.norm.weight"]
        + [f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")]
    )  # the output head is tied to the embeddings (the tiny model ties them): one parameter
    from tinker_exp.runtime.muon import parameter_names

    assert parameter_names(str(path)) == [[n, list(p.shape)] for n, p in model.named_parameters()]
    muon, adamw = optimizer.optimizers_dict["muon"], optimizer.optimizers_dict["adamw"]
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    (muon_group,), (adamw_group,) = muon.param_groups, adamw.param_groups
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw" and muon_group["eps"] == 1e-7 and muon_group["momentum"] == 0.95
    assert adamw_group["betas"] == (0.9, 0.999) and adamw_group["eps"] == 1e-8
    for part_name, part in OPTIMIZERS["Muon"].parts.items():
        (group,) = optimizer.optimizers_dict[part_name].param_groups
        assert {k: type(v) for k, v in group.items() if k != "params"} == {k: KIND_TYPES[kind] for k, kind in part.keys.items()}


def test_muon_refuses_parameters_in_another_order(tiny_llama):
    _, model = tiny_llama
    names = [[n, list(p.shape)] for n, p in model.named_parameters()][::-1]
    from tinker_exp.runtime.muon import MuonWithAdamW

    with pytest.raises(ValueError, match=r"has shape"):
        MuonWithAdamW(model.parameters(), lr=1e-3, weight_decay=0.0, param_names=names)


def test_verl_flattens_muon_and_adamw_applies_shared_keys_and_refuses_betas(tiny_llama):
    """The seed's own check on our multi-optimizer: what the pre-launch table says, verl does."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.engine_workers_tinker import _apply_optim_step_params, _iter_optimizer_param_groups

    _, model = tiny_llama
    optimizer = built_by_verl("Muon", model)
    scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)  # as verl's engine does
    assert scheduler.get_last_lr() == [1e-3, 1e-3]  # verl's LambdaLR took both parts' groups
    groups = _iter_optimizer_param_groups(optimizer)
    assert len(groups) == 2 and groups == optimizer.param_groups
    _apply_optim_step_params(optimizer, build_plan(OmegaConf.create({"lr": 5e-4, "weight_decay": 0.1}), config("Muon"), 1)[0])
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(5e-4, 0.1)] * 2
    with pytest.raises(ValueError, match="betas"):
        _apply_optim_step_params(optimizer, {"betas": (0.9, 0.95)})


def test_muon_state_round_trips_through_state_dict(tiny_llama):
    _, model = tiny_llama
    ids = torch.arange(12).reshape(2, 6)

    def step(optimizer):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    start = {k: v.clone() for k, v in model.state_dict().items()}
    first = built_by_verl("Muon", model)
    step(first)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(first.state_dict())  # torch hands out the live tensors; verl torch.save()s them
    assert set(saved) == {"muon", "adamw"} and saved["muon"]["state"] and saved["adamw"]["state"]
    step(first)
    continued = {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(saved_model)
    second = built_by_verl("Muon", model)
    second.load_state_dict(saved)
    step(second)
    assert all(torch.equal(continued[k], v) for k, v in model.state_dict().items())  # bitwise
    assert not all(torch.equal(start[k], v) for k, v in model.state_dict().items())
    model.load_state_dict(start)


# --- schedule-free AdamW: the package's optimizer in train mode, exact moves to its averaged weights and back -------


def schedule_free_pair(**fields):
    """Ours as verl builds it from optimizer=adamw_schedulefree's values, and the package's reference implementation
    (which keeps x, the averaged weights, as a tensor of its own), on two copies of one model."""
    from schedulefree.adamw_schedulefree_reference import AdamWScheduleFreeReference

    torch.manual_seed(0)
    ours_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference_model = copy.deepcopy(ours_model)
    ours = built_by_verl("AdamWScheduleFree", ours_model, lr=0.05, **fields)
    values = optimizer_values(config("AdamWScheduleFree", lr=0.05, **fields))
    reference = AdamWScheduleFreeReference(reference_model.parameters(), lr=0.05, betas=values["betas"], eps=values["eps"],
                                           weight_decay=values["weight_decay"], warmup_steps=int(values["warmup_steps"]))  # fmt: skip
    reference.train()
    return ours_model, ours, reference_model, reference


def train(model, optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(8, 6, generator=generator)
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()


def test_schedule_free_groups_hold_the_table_and_it_is_built_in_train_mode():
    ours_model, ours, _, _ = schedule_free_pair(warmup_steps=3)
    (part,) = OPTIMIZERS["AdamWScheduleFree"].parts.values()
    assert type(ours).__module__ == "tinker_exp.runtime.schedule_free" and isinstance(ours, __import__("schedulefree").AdamWScheduleFree)
    for group in ours.param_groups:
        assert {key: type(value) for key, value in group.items() if key != "params"} == {k: KIND_TYPES[kind] for k, kind in part.keys.items()}
        assert group["train_mode"] is True and group["warmup_steps"] == 3.0
    train(ours_model, ours, 1)  # the package's own class would refuse: "not in train mode"


def test_schedule_free_evaluates_at_the_averaged_weights_and_trains_on_bitwise():
    """to_averaged(): the parameters are x (the reference implementation's, which averages explicitly); to_training():
    y again, bitwise, so the steps after an evaluation are the steps without one."""
    ours_model, ours, reference_model, reference = schedule_free_pair(warmup_steps=2, weight_decay=0.01)
    train(ours_model, ours, 5)
    train(reference_model, reference, 5)
    training_point = [p.detach().clone() for p in ours_model.parameters()]
    ours.to_averaged()
    reference.eval()  # its parameters are x now
    for x, averaged, y in zip(reference_model.parameters(), ours_model.parameters(), training_point):
        torch.testing.assert_close(averaged, x, rtol=1e-5, atol=1e-6)
        assert not torch.equal(averaged, y)
    ours.to_training()
    assert all(torch.equal(p, y) for p, y in zip(ours_model.parameters(), training_point))
    assert all(group["train_mode"] for group in ours.param_groups)
    train(ours_model, ours, 3, seed=2)
    after_evaluation = [p.detach().clone() for p in ours_model.parameters()]

    plain_model, plain, _, _ = schedule_free_pair(warmup_steps=2, weight_decay=0.01)  # the same run, never evaluated
    train(plain_model, plain, 5)
    train(plain_model, plain, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(after_evaluation, plain_model.parameters()))


def test_schedule_free_state_round_trips_and_its_warmup_and_lr_are_sent_per_step():
    from verl.workers.engine_workers_tinker import _apply_optim_step_params

    model, first, _, _ = schedule_free_pair(warmup_steps=4)
    train(model, first, 2)
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(first.state_dict())
    assert saved["param_groups"][0]["k"] == 2 and saved["param_groups"][0]["train_mode"] is True
    plan = build_plan(OmegaConf.create({"lr": 0.02, "warmup_steps": 1, "betas": [0.8, 0.99]}), config("AdamWScheduleFree"), 1)
    _apply_optim_step_params(first, plan[0])  # verl's own per-step write: the types match the groups'
    assert [(g["lr"], g["warmup_steps"], g["betas"]) for g in first.param_groups] == [(0.02, 1.0, (0.8, 0.99))]
    train(model, first, 2, seed=3)
    continued = copy.deepcopy(model.state_dict())

    model.load_state_dict(saved_model)
    second = built_by_verl("AdamWScheduleFree", model, lr=0.05)
    second.load_state_dict(saved)
    _apply_optim_step_params(second, plan[0])
    train(model, second, 2, seed=3)
    assert all(torch.equal(continued[k], v) for k, v in model.state_dict().items())  # bitwise
    second.to_averaged()
    with pytest.raises(RuntimeError, match="call to_training"):  # a checkpoint of x would not resume
        second.state_dict()


def test_schedule_free_refuses_its_running_state_as_an_override_and_rl():
    from tinker_exp.config.validate import check, load

    with pytest.raises(ConfigError) as info:
        build_plan(OmegaConf.create({"weight_sum": 1.0}), config("AdamWScheduleFree"), 2)
    assert "optimizer AdamWScheduleFree updates weight_sum itself at every step (its running state): it cannot be sent" in str(info.value)
    with pytest.raises(ConfigError, match=r"optimizer.name: AdamWScheduleFree with an env \(RL\) is not supported yet"):
        check(load(compose("optimizer=adamw_schedulefree", "env=digits", "loss=importance_sampling")))
    served = run_module("tinker_exp.serve", "optimizer=adamw_schedulefree")  # the server samples its parameters
    assert served.returncode == 2 and served.stderr.strip() == (
        "tinker_exp: config error: optimizer.name: AdamWScheduleFree is not served yet (its averaged weights are not "
        "what the server samples); choose another optimizer"
    )


# --- one_cycle against torch's OneCycleLR ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"anneal": "linear"},
        {"pct_start": 0.1, "div_factor": 10.0, "final_div_factor": 100.0},
        {"three_phase": True},
        {"three_phase": True, "anneal": "linear", "pct_start": 0.45},
    ],
)
@pytest.mark.parametrize("total", [7, 100, 1013])
def test_one_cycle_matches_torch_one_cycle_lr_and_its_momentum(params, total):
    """lr and momentum at every step, as torch's OneCycleLR sets them on SGD (momentum) and AdamW (beta1)."""
    from tinker_exp.optim.schedules import compile_schedule

    torch_args = {"anneal_strategy": {"cosine": "cos", "linear": "linear"}[params.get("anneal", "cosine")],
                  **{k: v for k, v in params.items() if k != "anneal"}}
    for optimizer_class, momentum_key in ((torch.optim.SGD, "momentum"), (torch.optim.AdamW, "betas")):
        model = torch.nn.Linear(2, 1)
        extra = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
        optimizer = optimizer_class(model.parameters(), lr=0.1, **extra)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.1, total_steps=total, base_momentum=0.8, max_momentum=0.95, **torch_args
        )
        want_lr, want_momentum = [], []
        for _ in range(total):
            group = optimizer.param_groups[0]
            want_lr.append(group["lr"])
            want_momentum.append(group["momentum"] if momentum_key == "momentum" else group["betas"][0])
            optimizer.step()
            scheduler.step()
        lr = compile_schedule({"schedule": "one_cycle", "value": 0.1, **params}, total, "override.lr")
        momentum = compile_schedule(
            {"schedule": "one_cycle_momentum", "base_momentum": 0.8, "max_momentum": 0.95,
             **{k: v for k, v in params.items() if k in ("pct_start", "anneal", "three_phase")}},
            total, "override.momentum",
        )
        steps = np.arange(total)
        np.testing.assert_allclose(lr.values(steps), want_lr, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(momentum.values(steps), want_momentum, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name, keys", [("adamw_one_cycle", ("lr", "betas")), ("sgd_one_cycle", ("lr", "momentum"))])
def test_one_cycle_override_files_plan(name, keys):
    from tinker_exp.config.validate import load

    option = "sgd" if name.startswith("sgd") else "adamw"
    cfg = load(compose(f"optimizer={option}", f"+override={name}", "trainer.steps=50"))
    plan = build_plan(cfg.override, cfg.optimizer, cfg.trainer.steps)
    assert plan.keys == keys
    lr = plan.column("lr")
    assert lr.argmax() == 14 and lr[0] < lr[14] and lr[-1] < lr[0]  # up over 30% of the run, then down
    inverse = plan.column("beta1" if "betas" in keys else "momentum")
    own = plan.optimizer_values["betas"][0] if "betas" in keys else plan.optimizer_values["momentum"]  # 0.9 both
    assert inverse.argmin() == 14 and inverse.min() == 0.85 and inverse[0] == inverse[-1] == own == 0.9
