"""The schedule search on RL runs, for real (verl's TinkerActorRolloutRefWorker on the shared Ray cluster, env=digits,
loss=importance_sampling, the objective eval/reward maximised): a population of 2 members over lr (the PBT sweeper,
local launcher) and a pruned Optuna study of 3 trials (journal storage, local launcher). Each is run once for the
module and read by every test about it; both are small (a few steps) because members and trials start their own
workers one after another."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import metrics_rows, read_jsonl, run_cli
from tinker_exp.sweep.pbt import POPULATION_ENV, POPULATION_FILE, posts_at

RL = ["env=digits", "loss=importance_sampling", "trainer.objective=eval/reward", "trainer.objective_mode=max", "logger=none"]
MEMBERS, STEPS, K = 2, 6, 2
POPULATION = [
    "-m", "hydra/sweeper=pbt", "hydra/launcher=local", *RL, "+override=lr_cosine",
    "override.lr.value=tag(log,interval(1e-3,3e-2))", f"trainer.steps={STEPS}", f"trainer.eval_every={K}",
    f"hydra.sweeper.population={MEMBERS}", f"hydra.sweeper.interval={K}",
    "backend.num_workers=1", "hydra.launcher.max_parallel=1",  # a worker each, still one member after another
    # Test-only: one exploit whatever the scores (members run one after another, so member 1 ranks against member 0;
    # member 0, alone at each boundary, always carries on, so its step 4 is its own).
    "hydra.sweeper.force_exploit={member:1,step:4,donor:0}",
]  # fmt: skip
SAMPLED = ("train/reward", "train/reward_std", "train/response_length", "train/loss", "train/grad_norm", "train/mismatch")
"""What a step samples and trains: bitwise equal when two runs sample the same responses from the same weights."""


@pytest.fixture(scope="module")
def rl_population(ray_address, tmp_path_factory) -> tuple[Path, str]:
    """(its sweep dir, what the sweeper printed)."""
    sweep = tmp_path_factory.mktemp("rl_pbt") / "sweep"
    result = run_cli(*POPULATION, f"hydra.sweep.dir={sweep}", env={"RAY_ADDRESS": ray_address, POPULATION_ENV: None}, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return sweep, out


def evaluated(run_dir: Path) -> dict[int, float]:
    """{train/step: eval/reward} of a run's evaluations."""
    return {row["train/step"]: row["eval/reward"] for row in metrics_rows(run_dir) if "eval/reward" in row}


def test_an_rl_population_ranks_by_eval_reward_highest_first_and_its_best_is_the_highest(rl_population):
    from omegaconf import OmegaConf

    sweep, out = rl_population
    summary = read_jsonl(sweep / "summary.jsonl")
    assert [row["status"] for row in summary] == ["COMPLETED"] * MEMBERS and sorted(row["member"] for row in summary) == [0, 1]
    objectives = [row["objective"] for row in summary]
    assert objectives == sorted(objectives, reverse=True) and len(set(objectives)) > 1, summary
    for row in summary:  # a member's objective: the highest eval/reward of its run
        assert row["objective"] == max(evaluated(sweep / str(row["member"])).values())
    saved = OmegaConf.to_container(OmegaConf.load(sweep / "population_results.yaml"))
    assert (saved["best_member"], saved["best_objective"]) == (summary[0]["member"], max(objectives))
    table = out[out.index("population summary"):].splitlines()[3:]
    assert [line.split()[0].lstrip("*") for line in table[:MEMBERS]] == [str(row["member"]) for row in summary]


def test_each_member_ranks_at_its_boundaries_by_eval_reward_highest_first(rl_population):
    """Members run one after another: member m at a boundary ranks against members 0..m-1 there (a higher reward
    first, a tie to the lower member number); the score it posted is its eval/reward at that step."""
    sweep, _ = rl_population
    for member in range(MEMBERS):
        rows = read_jsonl(sweep / str(member) / POPULATION_FILE)
        assert [row["step"] for row in rows] == [2, 4]
        for row in rows:
            posts = posts_at(sweep / "population", row["step"])
            score = posts[member]["score"]
            assert score == row["score"] == evaluated(sweep / str(member))[row["step"] - 1]
            before = [posts[other]["score"] for other in range(member)]
            assert (row["of"], row["rank"]) == (member + 1, 1 + sum(s >= score for s in before))


def test_an_exploiting_member_continues_the_donors_run_its_weights_and_its_prompt_cursor_and_sampler(rl_population):
    """An exploit loads the donor's whole checkpoint: weights, optimizer and the batch source's state (prompt cursor,
    sampler RNG: docs/rl.md). So the exploiting member's next step samples the donor's responses to the donor's
    prompts from the donor's weights: its reward, loss, grad norm and mismatch are the donor's at that step, bit for
    bit, wherever the donor carried on there (computed before the member's new lr acts)."""
    sweep, _ = rl_population
    checked = []
    for member in range(MEMBERS):
        for row in read_jsonl(sweep / str(member) / POPULATION_FILE):
            exploit = row["exploit"]
            if exploit is None:
                continue
            donor, step = exploit["member"], row["step"]
            assert Path(exploit["checkpoint"]) == sweep / str(donor) / "checkpoints" / f"step_{step:08d}"
            if read_jsonl(sweep / str(donor) / POPULATION_FILE)[step // K - 1]["exploit"]:
                continue  # the donor took another's state at this step: its own row there is not what it posted
            own, theirs = metrics_rows(sweep / str(member))[step], metrics_rows(sweep / str(donor))[step]
            assert [own[key] for key in SAMPLED] == [theirs[key] for key in SAMPLED]
            assert own["requested/lr"] != theirs["requested/lr"]  # its own explored plan from here
            checked.append((member, step, donor))
    assert (1, 4, 0) in checked


# --- a pruned study ----------------------------------------------------------------------------------------------

LOWER = 0.05
"""The threshold pruner's lower bound on eval/reward: a trial whose reward at an evaluation is below it is pruned. The
untrained policy's responses are about 4% digits (docs/rl.md): a trial that has not beaten it is pruned."""
STUDY = [
    "-m", "hydra/sweeper=optuna", "hydra/launcher=local", *RL, "+override=constant", "override.lr=choice(1e-6,3e-2)",
    "trainer.steps=4", "trainer.eval_every=2", "backend.num_workers=1", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2",
    "hydra.sweeper.pruner=threshold", f"+hydra.sweeper.pruner_args.lower={LOWER}",
]  # fmt: skip


@pytest.fixture(scope="module")
def rl_study(ray_address, tmp_path_factory) -> tuple[Path, str]:
    """(its sweep dir, what the sweeper printed). Two trials at a time, a worker each."""
    sweep = tmp_path_factory.mktemp("rl_study") / "sweep"
    result = run_cli(*STUDY, f"hydra.sweep.dir={sweep}", env={"RAY_ADDRESS": ray_address}, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return sweep, out


def test_a_pruned_rl_study_maximises_eval_reward_and_prunes_below_the_lower_bound(rl_study):
    """The study maximises (trainer.objective_mode=max, no direction given); each trial's intermediate values are its
    run's eval/reward rows at their train/step; a trial is pruned at the first evaluation whose reward is below the
    lower bound (1e-6 barely moves the policy; 3e-2 raises its reward at once), the others run to the end; the
    best is the highest value."""
    import optuna
    from omegaconf import OmegaConf
    from optuna.trial import TrialState

    sweep, out = rl_study
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep / "optuna.journal")))
    study = optuna.load_study(study_name="tinker_exp", storage=storage)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    trials = study.trials
    for trial in trials:
        run_dir = sweep / str(trial.number)
        rewards = evaluated(run_dir)
        assert trial.intermediate_values == rewards, (trial.params, rewards)
        below = [step for step, reward in rewards.items() if reward < LOWER]
        if below:
            assert trial.state == TrialState.PRUNED and max(rewards) == below[0] == 1, (trial.params, rewards)
            assert trial.value == rewards[below[0]]
            assert f"trial {trial.number}: pruned at step 2: {trial.value:.6g}" in out
        else:
            assert trial.state == TrialState.COMPLETE and sorted(rewards) == [1, 3], (trial.params, rewards)
            assert trial.value == max(rewards.values())  # objective_mode=max: the run's highest
    states = [t.state for t in trials]
    assert TrialState.PRUNED in states and TrialState.COMPLETE in states, [(t.params, t.intermediate_values) for t in trials]
    saved = OmegaConf.load(sweep / "optimization_results.yaml")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value)
    assert (saved.direction, saved.best_trial, saved.best_value) == ("maximize", best.number, best.value)
    assert [row["num"] for row in read_jsonl(sweep / "summary.jsonl")][0] == best.number


def test_an_rl_studys_table_and_its_trials_last_lines_say_the_reward_not_the_policy_loss(rl_study):
    """The printed table's columns are the final train/reward and the objective by name; a completed trial's last
    line (its run dir's log: what its terminal shows) says its last reward and its best eval/reward, where it was."""
    sweep, out = rl_study
    table = out[out.index("study summary"):].splitlines()
    assert "final reward" in table[1] and "objective: eval/reward (max)" in table[1] and "final loss" not in table[1]
    summary = read_jsonl(sweep / "summary.jsonl")
    for row in summary:
        rows = metrics_rows(Path(row["run_dir"]))
        assert row["final_reward"] == rows[-1]["train/reward"] and (row["metric"], row["mode"]) == ("eval/reward", "max")
        if row["status"] == "COMPLETED":
            best = max((r for r in rows if "eval/reward" in r), key=lambda r: r["eval/reward"])
            done = [line for line in (Path(row["run_dir"]) / "tinker_exp.log").read_text().splitlines() if "- done: " in line]
            assert done[-1].split("- done: ")[1].startswith(
                f"4 steps, last reward {rows[-1]['train/reward']:.4f}, best eval/reward {best['eval/reward']:.4f} "
                f"after {best['train/step'] + 1} steps; "
            )
