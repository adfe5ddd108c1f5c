"""Population-based training, the member's side (tinker_exp.sweep.pbt): pure parts, and the member's bookkeeping
through the real entry with FakeWorkers (the real exploit on verl's workers: test_pbt_ray.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution, distribution_to_json

from fakes import fake_workers
from helpers import compose, metrics_rows, read_jsonl
from tinker_exp import config
from tinker_exp.errors import ConfigError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run
from tinker_exp.optim import build_plan
from tinker_exp.sweep.jobs import job_info
from tinker_exp.sweep.pbt import (
    POPULATION_ENV,
    POPULATION_FILE,
    Population,
    decide,
    explored,
    improvements,
    lineage_rows,
    pb2_explored,
    post,
    posts_at,
    quantile_size,
    realized_override,
    realized_values,
    realized_yaml,
    sent_values,
    with_values,
)

LR = FloatDistribution(1e-4, 3e-3, log=True)


def population(tmp_path: Path, **changes) -> Population:
    fields = {"board": tmp_path / "population", "population": 4, "interval": 2, "space": {"override.lr.value": LR}}
    return Population(**{**fields, **changes})


def posts(scores: dict[int, float]) -> dict[int, dict]:
    return {m: {"member": m, "step": 2, "score": s, "checkpoint": f"/ck/{m}", "values": {"k": m}} for m, s in scores.items()}


# --- the environment and the board --------------------------------------------------------------------


def test_the_environment_names_the_population_and_its_space(tmp_path):
    told = {"board": str(tmp_path), "population": 4, "interval": 2, "quantile": 0.25, "perturb": [0.8, 1.2],
            "resample_probability": 0.25, "seed": 7, "force_exploit": {"member": 1, "step": 2, "donor": 0}, "explore": "pb2",
            "space": {"override.lr.value": distribution_to_json(LR), "override.weight_decay": distribution_to_json(FloatDistribution(0.0, 0.1))}}  # fmt: skip
    got = Population.from_environment({POPULATION_ENV: json.dumps(told)})
    assert (got.board, got.population, got.interval, got.perturb, got.seed) == (tmp_path, 4, 2, (0.8, 1.2), 7)
    assert got.space == {"override.lr.value": LR, "override.weight_decay": FloatDistribution(0.0, 0.1)}
    assert got.force_exploit == {"member": 1, "step": 2, "donor": 0} and got.explore == "pb2"
    assert Population.from_environment({}) is None
    assert [s for s in range(1, 9) if got.is_boundary(s, 8)] == [2, 4, 6]  # never at the last step


@pytest.mark.parametrize(
    "change, message",
    [({"population": 1}, "population=1 must be >= 2"), ({"quantile": 0.6}, r"quantile=0.6 must be in \(0, 0.5\]"),
     ({"perturb": (0.8, 0.0)}, r"perturb=\[0.8, 0.0\] must be factors > 0"), ({"space": {}}, "space is empty"),
     ({"interval": 0}, "interval=0 must be >= 1"), ({"explore": "pb3"}, "explore='pb3' must be one of perturb, pb2")],
)  # fmt: skip
def test_a_bad_population_is_one_line_naming_the_value(tmp_path, change, message):
    with pytest.raises(ConfigError, match=f"{POPULATION_ENV}: {message}"):
        population(tmp_path, **change)


def test_a_malformed_environment_is_a_config_error():
    with pytest.raises(ConfigError, match=f"^{POPULATION_ENV}: not a population \\(KeyError"):
        Population.from_environment({POPULATION_ENV: json.dumps({"population": 4})})


def test_posts_are_whole_files_one_per_member_and_step(tmp_path):
    board = tmp_path / "board"
    post(board, 0, 2, 4.5, tmp_path / "ck0", {"override.lr.value": 1e-3})
    post(board, 3, 2, 4.1, tmp_path / "ck3", {"override.lr.value": 2e-3})
    post(board, 3, 4, 4.0, tmp_path / "ck3b", {"override.lr.value": 2e-3})
    assert sorted(p.relative_to(board).as_posix() for p in board.rglob("*") if p.is_file()) == ["0/2.json", "3/2.json", "3/4.json"]
    at2 = posts_at(board, 2)
    assert sorted(at2) == [0, 3]
    assert at2[3] | {"time": 0} == {"member": 3, "step": 2, "score": 4.1, "sign": 1, "checkpoint": str(tmp_path / "ck3"),
                                    "values": {"override.lr.value": 2e-3}, "time": 0, "start": None}  # fmt: skip
    assert posts_at(board, 6) == {} and posts_at(tmp_path / "none", 2) == {}


# --- PB2: the GP bandit on fixed data, and its data from the board ------------------------------------------


def test_the_time_varying_kernel_is_the_squared_exponential_times_the_time_decay():
    from tinker_exp.sweep.pb2 import kernel

    x = np.array([[0.0, 0.0], [0.3, 0.4]])
    k = kernel(x, np.array([1.0, 3.0]), x, np.array([1.0, 3.0]), lengthscale=0.5, epsilon=0.2)
    assert k[0, 0] == k[1, 1] == 1.0
    assert math.isclose(k[0, 1], math.exp(-0.25 / (2 * 0.25)) * 0.8 ** (2 / 2), rel_tol=1e-12) and k[0, 1] == k[1, 0]


def test_the_gp_posterior_is_the_textbook_formula_on_fixed_data():
    """Mean and std at new points equal K*^T (K + noise I)^-1 z and sqrt(1 - K*^T (K + noise I)^-1 K*), y standardised."""
    from tinker_exp.sweep.pb2 import TimeVaryingGP, kernel

    x = np.array([[0.1], [0.4], [0.7], [0.9]])
    t, y = np.array([1.0, 1.0, 2.0, 2.0]), np.array([0.5, 1.5, 1.0, -0.2])
    gp = TimeVaryingGP(x, t, y, lengthscale=0.3, epsilon=0.1, noise=0.05)
    xq, tq = np.array([[0.25], [0.8]]), np.array([3.0, 3.0])
    mean, std = gp.predict(xq, tq)
    z = (y - y.mean()) / y.std()
    gram = kernel(x, t, x, t, 0.3, 0.1) + 0.05 * np.eye(4)
    cross = kernel(xq, tq, x, t, 0.3, 0.1)
    np.testing.assert_allclose(mean, y.mean() + y.std() * cross @ np.linalg.solve(gram, z), rtol=1e-10)
    np.testing.assert_allclose(std, y.std() * np.sqrt(1 - np.diag(cross @ np.linalg.solve(gram, cross.T))), rtol=1e-8)


def test_the_bandit_proposes_near_the_best_improvement_and_follows_the_recent_intervals():
    from tinker_exp.sweep.pb2 import fit, propose

    grid = np.linspace(0, 1, 11)[:, None]
    recent = -((grid[:, 0] - 0.3) ** 2)  # improvements peak at 0.3
    point = propose(grid, np.ones(11), recent, 2.0, np.random.default_rng(0))
    assert abs(point[0] - 0.3) < 0.1
    assert np.array_equal(point, propose(grid, np.ones(11), recent, 2.0, np.random.default_rng(0)))  # seeded
    # The optimum moved: early intervals peaked at 0.2, the recent ones at 0.8; the next interval follows the recent.
    x = np.vstack([grid, grid])
    t = np.r_[np.ones(11), np.full(11, 6.0)]
    y = np.r_[-((grid[:, 0] - 0.2) ** 2), -((grid[:, 0] - 0.8) ** 2)]
    assert fit(x, t, y).epsilon > 0.01  # the fit found the data change with time
    assert abs(propose(x, t, y, 7.0, np.random.default_rng(0))[0] - 0.8) < 0.1


def test_pb2s_data_are_the_improvements_over_each_interval_from_where_it_started(tmp_path):
    """Member 1 exploited member 0 at step 2: its interval to step 4 started from member 0's score at 2."""
    pop = population(tmp_path, explore="pb2", space={"override.lr.value": LR, "override.warmup": CategoricalDistribution([0, 1])})
    board = pop.board
    post(board, 0, 2, 3.0, tmp_path / "a", {"override.lr.value": 1e-4, "override.warmup": 0})
    post(board, 1, 2, 4.0, tmp_path / "b", {"override.lr.value": 3e-3, "override.warmup": 1})
    post(board, 0, 4, 2.5, tmp_path / "c", {"override.lr.value": 1e-4, "override.warmup": 0}, start={"member": 0, "step": 2})
    post(board, 1, 4, 2.0, tmp_path / "d", {"override.lr.value": 3e-3, "override.warmup": 0}, start={"member": 0, "step": 2})
    post(board, 1, 6, 1.0, tmp_path / "e", {"override.lr.value": 3e-3, "override.warmup": 0}, start={"member": 1, "step": 4})
    data = improvements(board, 4, pop)  # step 6's post is not known at step 4
    assert [(x, t) for x, t, _ in data] == [([0.0], 2.0), ([1.0], 2.0)]  # lr at its log bounds; the choice not modelled
    assert [y for _, _, y in data] == pytest.approx([0.5, 1.0])
    assert improvements(board, 6, pop)[-1][1:] == (3.0, pytest.approx(1.0))


def test_pb2_explores_numeric_keys_by_the_bandit_and_choices_as_pbt(tmp_path):
    space = {"override.lr.value": LR, "override.weight_decay": FloatDistribution(0.0, 0.1),
             "override.betas.0": CategoricalDistribution([0.8, 0.9, 0.95])}  # fmt: skip
    pop = population(tmp_path, explore="pb2", space=space)
    donor = {"override.lr.value": 1e-3, "override.weight_decay": 0.05, "override.betas.0": 0.9}
    override = {"lr": {"schedule": "cosine", "value": 1e-3}, "weight_decay": 0.05, "betas": [0.9, 0.999]}
    first, note = pb2_explored(donor, pop, 1, 2, override, 10)  # nothing on the board: PBT's explore
    assert first == explored(donor, pop, 1, 2, override, 10) and note == "pb2: 0 improvement(s) known, explored as perturb"
    rng = np.random.default_rng(5)
    for member in range(4):
        post(pop.board, member, 2, 3.0, tmp_path / str(member), donor)
        values = {"override.lr.value": float(np.exp(rng.uniform(np.log(1e-4), np.log(3e-3)))), "override.weight_decay": float(rng.uniform(0, 0.1)), "override.betas.0": 0.9}
        post(pop.board, member, 4, 3.0 - values["override.lr.value"] * 300, tmp_path / f"{member}b", values, start={"member": member, "step": 2})
    proposed, note = pb2_explored(donor, pop, 1, 4, override, 10)
    assert note == "pb2: proposed from 4 improvements" and proposed == pb2_explored(donor, pop, 1, 4, override, 10)[0]
    assert 1e-4 <= proposed["override.lr.value"] <= 3e-3 and 0.0 <= proposed["override.weight_decay"] <= 0.1
    assert proposed["override.betas.0"] == explored(donor, pop, 1, 4, override, 10)["override.betas.0"]
    assert proposed["override.lr.value"] > 1e-3  # the improvements grew with lr: the bandit goes up


# --- the decision -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, q", [(1, 0), (2, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_quantile_size_is_ray_tunes_rule_capped_at_half(n, q):
    assert quantile_size(n, 0.25) == q


def test_the_bottom_quantile_exploits_a_top_member_and_the_rest_carry_on(tmp_path):
    pop = population(tmp_path)
    scores = {0: 4.0, 1: 5.0, 2: 3.0, 3: 4.5}
    ranks = {m: decide(pop, m, 2, posts(scores)) for m in scores}
    assert {m: (d.rank, d.of) for m, d in ranks.items()} == {2: (1, 4), 0: (2, 4), 3: (3, 4), 1: (4, 4)}
    assert [m for m, d in ranks.items() if d.donor] == [1] and ranks[1].donor["member"] == 2
    assert decide(pop, 0, 2, posts({0: 9.0})).donor is None  # alone: nobody to rank against


def test_with_objective_mode_max_the_highest_score_ranks_first_and_non_finite_ones_still_last(tmp_path):
    pop = population(tmp_path)
    rewards = {0: 0.4, 1: 0.5, 2: 0.3, 3: float("nan")}
    maximised = {m: {**p, "sign": -1} for m, p in posts(rewards).items()}
    assert [decide(pop, m, 2, maximised).rank for m in range(4)] == [2, 1, 3, 4]
    assert decide(pop, 3, 2, maximised).donor["member"] == 1


def test_non_finite_scores_rank_last_and_ties_go_by_member(tmp_path):
    pop = population(tmp_path)
    scores = {0: float("nan"), 1: 4.0, 2: 4.0, 3: float("inf")}
    assert [decide(pop, m, 2, posts(scores)).rank for m in range(4)] == [3, 1, 2, 4]


def test_the_donor_is_seeded_by_seed_member_and_step(tmp_path):
    scores = {m: float(m) for m in range(8)}  # q = 2: members 6 and 7 exploit 0 or 1
    donors = lambda seed, member: decide(population(tmp_path, population=8, seed=seed), member, 2, posts(scores)).donor["member"]  # noqa: E731
    assert all(donors(seed, 7) == donors(seed, 7) for seed in range(5))  # the same inputs, the same donor
    assert {donors(seed, member) for seed in range(20) for member in (6, 7)} == {0, 1}  # both top members chosen


def test_force_exploit_takes_that_donor_whatever_the_ranks(tmp_path):
    pop = population(tmp_path, force_exploit={"member": 2, "step": 2, "donor": 1})
    scores = {0: 4.0, 1: 5.0, 2: 3.0}
    assert decide(pop, 2, 2, posts(scores)).donor["member"] == 1  # the best takes the worst's
    assert decide(pop, 2, 4, {m: {**p, "step": 4} for m, p in posts(scores).items()}).donor is None
    with pytest.raises(ConfigError, match="force_exploit: member 1 has not posted at step 2"):
        decide(pop, 2, 2, posts({0: 4.0, 2: 3.0}))


# --- explore ------------------------------------------------------------------------------------------------


COSINE = {"lr": {"schedule": "cosine", "value": 1e-3, "warmup_steps": 2, "min_ratio": 0.1}, "weight_decay": 0.01}


def test_perturbing_multiplies_by_one_of_the_factors_within_the_space(tmp_path):
    pop = population(tmp_path, resample_probability=0.0)
    got = {explored({"override.lr.value": 1e-3}, pop, 1, step, COSINE, 8)["override.lr.value"] for step in range(2, 40, 2)}
    assert got == {1e-3 * 0.8, 1e-3 * 1.2}
    assert explored({"override.lr.value": 2.9e-3}, pop, 1, 2, COSINE, 8)["override.lr.value"] in (2.9e-3 * 0.8, 3e-3)  # clipped


def test_resampling_draws_from_the_space(tmp_path):
    pop = population(tmp_path, resample_probability=1.0)
    got = [explored({"override.lr.value": 1e-3}, pop, 1, step, COSINE, 8)["override.lr.value"] for step in range(2, 200, 2)]
    assert all(1e-4 <= lr <= 3e-3 for lr in got) and len(set(got)) == len(got)
    assert sum(lr < 5.5e-4 for lr in got) > 30  # log scale: half the draws below the geometric mean 5.5e-4


def test_clipped_to_the_keys_valid_range_and_the_schedules_length(tmp_path):
    space = {"override.weight_decay": FloatDistribution(-0.5, 0.5), "override.lr.warmup_steps": IntDistribution(0, 100),
             "override.betas.1": FloatDistribution(0.9, 1.5), "override.lr.min_ratio": FloatDistribution(0.0, 3.0)}  # fmt: skip
    override = {**COSINE, "betas": [0.9, 0.999]}
    pop = population(tmp_path, space=space, perturb=(3.0,), resample_probability=0.0)
    got = explored({"override.weight_decay": -0.1, "override.lr.warmup_steps": 7, "override.betas.1": 0.99, "override.lr.min_ratio": 0.9}, pop, 0, 2, override, 8)
    assert got["override.weight_decay"] == 0.0  # >= 0 although the space allows -0.5
    assert got["override.lr.warmup_steps"] == 8 and type(got["override.lr.warmup_steps"]) is int  # within the 8 steps
    assert got["override.betas.1"] == math.nextafter(1.0, 0.0)  # betas in [0, 1)
    assert got["override.lr.min_ratio"] == 1.0  # a ratio in [0, 1]
    explored_override = with_values(override, got)
    plan = build_plan(OmegaConf.create(explored_override), compose().optimizer, 8)
    assert plan[7]["betas"][1] < 1.0 and plan[7]["weight_decay"] == 0.0


def test_ints_land_on_the_step_grid_and_categoricals_move_to_a_neighbour(tmp_path):
    space = {"override.lr.warmup_steps": IntDistribution(0, 6, step=2), "override.lr.schedule": CategoricalDistribution(["cosine", "linear", "wsd"])}
    pop = population(tmp_path, space=space, perturb=(1.5,), resample_probability=0.0)
    seen = [explored({"override.lr.warmup_steps": 2, "override.lr.schedule": "linear"}, pop, 0, s, COSINE, 20) for s in range(2, 60, 2)]
    assert {v["override.lr.warmup_steps"] for v in seen} == {4}  # 3 rounds onto the grid 0, 2, 4, 6
    assert {v["override.lr.schedule"] for v in seen} == {"cosine", "wsd"}
    ends = {explored({"override.lr.warmup_steps": 6, "override.lr.schedule": "wsd"}, pop, 0, s, COSINE, 20)["override.lr.schedule"] for s in range(2, 30, 2)}
    assert ends == {"linear"}  # the last choice's only neighbour


# --- the realized schedule ----------------------------------------------------------------------------------


def test_the_realized_override_replays_every_step_exactly_floats_and_types():
    """Two plans spliced at an exploit (step 4: another lr peak, another weight decay) with betas: the override
    file written from what was sent gives, through YAML and the plan's own converter, the very same values."""
    optimizer = compose().optimizer
    before = build_plan(OmegaConf.create({**COSINE, "betas": [0.9, {"schedule": "linear", "start": 0.95, "end": 0.999}]}), optimizer, 12)
    after = build_plan(OmegaConf.create(with_values({**COSINE, "betas": [0.9, 0.97]}, {"override.lr.value": 1e-3 * 1.2, "override.weight_decay": 0.012})), optimizer, 12)
    sent = [before[s] for s in range(4)] + [after[s] for s in range(4, 12)]
    text = realized_yaml(realized_override(sent))
    assert text.startswith("# @package override\n")
    replay = build_plan(OmegaConf.create(OmegaConf.to_container(OmegaConf.create(text))), optimizer, 12)
    for step in range(12):
        assert replay[step] == sent[step]
        assert {k: type(v) for k, v in replay[step].items()} == {k: type(v) for k, v in sent[step].items()}
        assert type(replay[step]["betas"][0]) is float
    assert realized_override(sent)["betas"][0] == 0.9  # a value that never changed stays a constant
    assert realized_override(sent)["weight_decay"]["points"] == {0: 0.01, 3: 0.01, 4: 0.012, 11: 0.012}  # only where it changes


def test_sent_values_read_the_rows_requested_values():
    rows = [{"train/step": 0, "requested/lr": 1e-3, "requested/beta1": 0.9, "requested/beta2": 0.95, "applied/lr": 1e-3}]
    assert sent_values(rows) == [{"lr": 1e-3, "betas": (0.9, 0.95)}]


# --- lineage ------------------------------------------------------------------------------------------------


def member_dir(root: Path, member: int, lrs: list[float], exploits: dict[int, int] = {}) -> Path:
    """A member's run dir as a job leaves it: metrics rows of its own steps, population.jsonl (exploit at step s of
    member d: {s: d}), its boundary checkpoints' folders."""
    run_dir = root / str(member)
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [{"train/step": s, "train/loss": 10.0 * member + s, "requested/lr": lr} for s, lr in enumerate(lrs)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    population_rows = [
        {"step": s, "score": 1.0, "rank": 1, "of": 2, "values": {}, "previous": {},
         "exploit": {"member": exploits[s], "step": s, "checkpoint": str(root / str(exploits[s]) / "checkpoints" / f"step_{s:08d}")} if s in exploits else None}
        for s in (2, 4, 6)
    ]  # fmt: skip
    (run_dir / POPULATION_FILE).write_text("".join(json.dumps(r) + "\n" for r in population_rows))
    return run_dir


def test_lineage_rows_follow_each_exploit_back_through_the_donors(tmp_path):
    """Member 2 took member 1's checkpoint at step 4, which had taken member 0's at step 2; member 0 itself took
    member 3's at step 4, after posting: member 1's checkpoint at 4 holds member 0's steps before 4, not member 3's."""
    member_dir(tmp_path, 0, [1.0] * 8, {4: 3})
    member_dir(tmp_path, 1, [2.0] * 8, {2: 0})
    member_dir(tmp_path, 2, [3.0] * 8, {4: 1})
    member_dir(tmp_path, 3, [4.0] * 8)
    rows = lineage_rows(tmp_path / "2")
    assert [(r["train/step"], r["train/loss"]) for r in rows] == [(0, 0), (1, 1), (2, 12), (3, 13), (4, 24), (5, 25), (6, 26), (7, 27)]
    assert [r["train/step"] for r in lineage_rows(tmp_path / "0")] == list(range(8))
    assert [r["train/loss"] for r in lineage_rows(tmp_path / "0")][3:5] == [33, 4]  # member 3's before 4, its own after
    assert realized_values(tmp_path / "2") == {"lr": [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]}


def test_an_exploit_at_the_last_step_trained_is_the_members_lineage_already(tmp_path):
    member_dir(tmp_path, 0, [1.0] * 4)
    member_dir(tmp_path, 1, [2.0] * 4, {4: 0})  # decided at step 4, nothing trained after it yet
    assert [r["requested/lr"] for r in lineage_rows(tmp_path / "1")] == [1.0] * 4
    assert [r["requested/lr"] for r in lineage_rows(tmp_path / "1", until=4)] == [2.0] * 4  # its checkpoint at 4: its own


# --- a member in its job (FakeWorkers for verl: the bookkeeping) ---------------------------------------------


MEMBER = ["+override=lr_cosine", "override.lr.warmup_steps=2", "trainer.steps=8", "trainer.eval_every=2", "logger=none",
          "checkpoint.every_steps=0", "checkpoint.keep_last=1"]  # fmt: skip


def run_member(tmp_path: Path, monkeypatch, number: int, lr: float, **told) -> tuple[Path, object]:
    pop = {"board": str(tmp_path / "population"), "population": 2, "interval": 2, "seed": 3, "resample_probability": 0.0,
           "space": {"override.lr.value": distribution_to_json(LR)}, **told}  # fmt: skip
    monkeypatch.setenv(POPULATION_ENV, json.dumps(pop))
    run_dir = tmp_path / str(number)
    start = fake_workers()
    run(compose(*MEMBER, f"override.lr.value={lr!r}"), run_dir, job=job_info(number, []), place=GivenWorkers(start))
    return run_dir, start


def test_a_member_posts_decides_and_exploits_in_its_own_workers(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="tinker_exp")
    first, _ = run_member(tmp_path, monkeypatch, 0, 3e-3)  # the fake's loss falls faster with a larger lr
    second, start = run_member(tmp_path, monkeypatch, 1, 1e-4)
    (workers,) = start.started  # one worker group for the whole member: exploits load into it
    board = tmp_path / "population"
    assert sorted(p.relative_to(board).as_posix() for p in board.rglob("*.json")) == ["0/2.json", "0/4.json", "0/6.json", "1/2.json", "1/4.json", "1/6.json"]
    rows = read_jsonl(second / POPULATION_FILE)
    assert [(r["step"], r["rank"], r["of"], r["exploit"]["member"]) for r in rows] == [(2, 2, 2, 0), (4, 2, 2, 0), (6, 2, 2, 0)]
    assert rows[0]["exploit"] == {"member": 0, "step": 2, "checkpoint": str(first / "checkpoints" / "step_00000002")}
    assert rows[0]["previous"] == {"override.lr.value": 1e-4}
    assert rows[0]["values"]["override.lr.value"] in (3e-3 * 0.8, 3e-3)  # 3e-3 * 1.2 is clipped to the space
    assert all(r["previous"] == before["values"] for before, r in zip(rows, rows[1:]))
    # every boundary checkpoint is kept (keep_last=1): other members may load it
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_00000002", "step_00000004", "step_00000006", "step_00000008"]
    # from each boundary on, the plan of the explored values: the member's own schedule with the new peak
    sent = [r["requested/lr"] for r in metrics_rows(second)]
    for row in rows:
        lr = {"schedule": "cosine", "value": row["values"]["override.lr.value"], "warmup_steps": 2, "min_ratio": 0.1}
        explored_plan = build_plan(OmegaConf.create({"lr": lr}), compose().optimizer, 8)
        assert sent[row["step"] : row["step"] + 2] == [explored_plan[s]["lr"] for s in range(row["step"], row["step"] + 2)]
    # after the exploit the member starts from the donor's state: its step 2 is the donor's step 2 when the lr agrees
    own, donor = metrics_rows(second), metrics_rows(first)
    # step 1's lrs differ (5e-5, 1.5e-3), so only the donor's weights loaded in place give its step-2 loss
    assert own[2]["train/loss"] == donor[2]["train/loss"] and own[1]["requested/lr"] != donor[1]["requested/lr"]
    lineage = lineage_rows(second)
    assert [r["train/loss"] for r in lineage[:2]] == [r["train/loss"] for r in donor[:2]]
    realized = OmegaConf.load(second / "override" / "realized.yaml")
    replay = build_plan(realized, compose().optimizer, 8)
    assert [replay[s]["lr"] for s in range(8)] == [r["requested/lr"] for r in lineage]
    line = next(m for m in caplog.messages if m.startswith("boundary at step 2: val/loss") and "exploit member 0" in m)
    assert line.endswith(f"(rank 2 of 2): exploit member 0 at step 2, lr.value 0.003 -> {rows[0]['values']['override.lr.value']:.3g}")
    assert any(m.startswith("boundary at step 2: val/loss") and m.endswith("(rank 1 of 1): carries on") for m in caplog.messages)


def test_a_member_killed_after_an_exploit_resumes_with_the_donors_state_and_its_plan(tmp_path, monkeypatch):
    """Killed after it exploited at step 4 and before its next checkpoint: its own newest checkpoint is from before
    the exploit, so it loads the donor's again and trains what it would have trained (the fake is deterministic)."""
    force = {"member": 1, "step": 4, "donor": 0}
    run_member(tmp_path, monkeypatch, 0, 3e-3, force_exploit=force)
    whole, _ = run_member(tmp_path, monkeypatch, 1, 1e-4, force_exploit=force)
    keep = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time", "perf/"))} for r in rows]  # noqa: E731
    uninterrupted = keep(metrics_rows(whole))
    assert read_jsonl(whole / POPULATION_FILE)[1]["exploit"]["member"] == 0
    for at in (6, 8):
        shutil.rmtree(whole / "checkpoints" / f"step_{at:08d}")
    (whole / POPULATION_FILE).write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(whole / POPULATION_FILE)[:2]))
    _, start = run_member(tmp_path, monkeypatch, 1, 1e-4, force_exploit=force)
    assert start.started[0].steps_done == 8  # the donor's checkpoint at 4 loaded, then 4 steps
    assert keep(metrics_rows(whole)) == uninterrupted
    assert [r["step"] for r in read_jsonl(whole / POPULATION_FILE)] == [2, 4, 6]


def test_a_member_killed_between_its_boundary_save_and_decision_decides_on_resume(tmp_path, monkeypatch):
    force = {"member": 1, "step": 4, "donor": 0}
    run_member(tmp_path, monkeypatch, 0, 3e-3, force_exploit=force)
    whole, _ = run_member(tmp_path, monkeypatch, 1, 1e-4, force_exploit=force)
    before = read_jsonl(whole / POPULATION_FILE)
    uninterrupted = [r["train/loss"] for r in metrics_rows(whole)]
    for at in (6, 8):
        shutil.rmtree(whole / "checkpoints" / f"step_{at:08d}")
    (whole / POPULATION_FILE).write_text(json.dumps(before[0]) + "\n")  # the decision at 4 never written
    run_member(tmp_path, monkeypatch, 1, 1e-4, force_exploit=force)
    after = read_jsonl(whole / POPULATION_FILE)
    assert [(r["step"], r["exploit"], r["values"]) for r in after] == [(r["step"], r["exploit"], r["values"]) for r in before]
    assert [r["train/loss"] for r in metrics_rows(whole)] == uninterrupted


def test_a_member_whose_config_lacks_a_key_of_the_space_stops_before_any_worker(tmp_path, monkeypatch):
    monkeypatch.setenv(POPULATION_ENV, json.dumps({"board": str(tmp_path), "population": 2, "interval": 2,
                                                   "space": {"override.weight_decay": distribution_to_json(FloatDistribution(0.0, 0.1))}}))  # fmt: skip
    start = fake_workers()
    with pytest.raises(ConfigError, match=r"^override.weight_decay: a member's config must set every key of the space"):
        run(compose(*MEMBER), tmp_path / "run", job=job_info(0, []), place=GivenWorkers(start))
    assert start.started == []


def test_without_the_environment_a_sweep_job_is_an_ordinary_run(tmp_path, monkeypatch):
    monkeypatch.delenv(POPULATION_ENV, raising=False)
    run(compose(*MEMBER), tmp_path, job=job_info(0, []), place=GivenWorkers(fake_workers()))
    assert not (tmp_path / POPULATION_FILE).exists() and not (tmp_path / "override").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000008"]


@pytest.mark.parametrize("change", ["trainer.eval_every=4", "trainer.steps=3", "data.val_fraction=null"])
def test_a_member_whose_boundaries_are_not_evaluations_stops_before_any_worker(tmp_path, monkeypatch, change):
    monkeypatch.setenv(POPULATION_ENV, json.dumps({"board": str(tmp_path), "population": 2, "interval": 2,
                                                   "space": {"override.lr.value": distribution_to_json(LR)}}))  # fmt: skip
    start = fake_workers()
    with pytest.raises(ConfigError, match=r"a member's boundaries \(every 2 steps, at least one before the last step\) must be evaluation steps"):
        run(compose(*MEMBER, "override.lr.value=1e-3", change), tmp_path / "run", job=job_info(0, []), place=GivenWorkers(start))
    assert start.started == []


def test_a_maximised_objective_ranks_the_highest_first_in_grid_and_population_summaries(tmp_path):
    """A maximised objective (objective_mode=max, or a reward's last value: an RL run's eval/reward by default): the
    summary's best is the highest, for a sweep's jobs and a population's members alike (each run's objective.json says
    whether it was maximised); a loss's last value: the lowest."""
    from tinker_exp.sweep.jobs import ranked as ranked_jobs, read_outcome
    from tinker_exp.sweep.pbt_report import ranked as ranked_members, read_member
    from tinker_exp.sweep.report import best_run, read_run
    from tinker_exp.train.objective import write_objective

    def run(n: int, value: float, metric: str, mode: str):
        run_dir = tmp_path / metric.replace("/", "_") / mode / str(n)
        run_dir.mkdir(parents=True)
        write_objective(run_dir, metric, mode, value)
        return run_dir

    for metric, mode, order in (("eval/reward", "max", [1, 2, 0]), ("eval/reward", "last", [1, 2, 0]),
                                ("val/loss", "last", [0, 2, 1]), ("val/loss", "max", [1, 2, 0])):  # fmt: skip
        dirs = [run(n, value, metric, mode) for n, value in enumerate([0.43, 0.92, 0.59])]
        jobs = [read_outcome(n, [], "COMPLETED", d, None, objective=v) for n, (d, v) in enumerate(zip(dirs, [0.43, 0.92, 0.59]))]
        members = [read_member(n, {}, d, v, None) for n, (d, v) in enumerate(zip(dirs, [0.43, 0.92, 0.59]))]
        assert [o.num for o in ranked_jobs(jobs)] == order
        assert [m.member for m in ranked_members(members)] == order
        assert best_run([read_run(d) for d in dirs]).dir == dirs[order[0]]  # report.png's thick line and title
