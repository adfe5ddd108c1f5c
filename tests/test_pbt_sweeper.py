"""Population-based training through its sweeper (hydra/sweeper=pbt): every bad input one line and exit 2 before any
member starts, the members' start values, the end of a population (table, population_results.yaml, the replay
command, report.png read back as data), and real populations on the local launcher and the local Slurm cluster."""

from __future__ import annotations

import math
import os

import pytest

from helpers import run_main

BASE = ["-m", "hydra/sweeper=pbt", "hydra/launcher=local", "+override=lr_cosine", "logger=none"]
LR = "override.lr.value=tag(log,interval(1e-4,3e-3))"
POPULATION_ENV = "TINKER_EXP_POPULATION"  # the contract with the member side (tinker_exp.sweep.pbt.POPULATION_ENV)
GOOD = [LR, "trainer.steps=8", "trainer.eval_every=2", "hydra.sweeper.interval=2"]


def without(args: list[str], key: str) -> list[str]:
    return [a for a in args if not a.startswith(key + "=")]


# --- bad input: one line, exit 2, nothing written, no member started ------------------------------------------

FROZEN = "cannot change within a run"
BAD = [
    (["hydra.sweeper.population=1"], "hydra.sweeper.population: 1 must be an int >= 2 (a population exploits its other members)"),
    (["hydra.sweeper.population=two"], "hydra.sweeper.population: 'two' must be an int >= 2"),
    (["hydra.sweeper.interval=0"], "hydra.sweeper.interval: 0 must be an int >= 1 (steps between boundaries)"),
    (["hydra.sweeper.interval=3"], "hydra.sweeper.interval=3: not a multiple of trainer.eval_every=2; each boundary must be an evaluation step"),
    (["trainer.eval_every=0"], "hydra.sweeper.interval=2: trainer.eval_every=0 evaluates only after the last step; each boundary must be an evaluation step"),
    (["hydra.sweeper.interval=6"], "hydra.sweeper.interval=6: trainer.steps=8 leaves no boundary to train on from (needs trainer.steps >= 2 * interval = 12)"),
    (["data.val_fraction=null"], "hydra.sweeper=pbt: members are scored at evaluations, and there is no validation data (data.val_path or data.val_fraction)"),
    (["env=digits", "loss=importance_sampling", "env.eval_prompts=null"],
     "hydra.sweeper=pbt: members are scored at evaluations, and the env has no held-out prompts (env.eval_prompts)"),
    (["hydra.sweeper.quantile=0"], "hydra.sweeper.quantile: 0 must be in (0, 0.5]"),
    (["hydra.sweeper.quantile=0.6"], "hydra.sweeper.quantile: 0.6 must be in (0, 0.5]"),
    (["hydra.sweeper.perturb=[0.8,0]"], "hydra.sweeper.perturb: 0 in [0.8, 0] must be a number > 0"),
    (["hydra.sweeper.perturb=[0.8,-1.2]"], "hydra.sweeper.perturb: -1.2 in [0.8, -1.2] must be a number > 0"),
    (["hydra.sweeper.perturb=[]"], "hydra.sweeper.perturb: [] must be a non-empty list of factors, e.g. [0.8, 1.2]"),
    (["hydra.sweeper.resample_probability=1.5"], "hydra.sweeper.resample_probability: 1.5 must be in [0, 1]"),
    (["hydra.sweeper.explore=pb3"], "hydra.sweeper.explore: 'pb3' must be one of perturb, pb2 (perturb: PBT's; pb2: a GP bandit)"),
    (["hydra.sweeper.explore=pb2", "override.lr.value=choice(1e-4,1e-3)"], "hydra.sweeper.explore=pb2: its GP models numeric keys, "
     "and the space has only choices (override.lr.value); use explore=perturb or search a number too"),
    (["hydra.sweeper.force_exploit={member:0,step:3,donor:1}"],
     "hydra.sweeper.force_exploit: {'member': 0, 'step': 3, 'donor': 1}: step 3 is not a boundary (a multiple of 2 below trainer.steps=8)"),
    (["hydra.sweeper.force_exploit={member:1,step:2,donor:1}"],
     "hydra.sweeper.force_exploit: {'member': 1, 'step': 2, 'donor': 1}: member and donor must be two members in 0..3"),
    # the space: empty, malformed, or over a key a member cannot change in flight
    (["~" + LR], "hydra.sweeper.params: no search space; give one in hydra.sweeper.params or on the command line"),
    (["override.lr.value=tag(log,interval(0,3e-3))"], "override.lr.value: a log-scale interval must start above 0, not 0"),
    (["override.lr.value=interval(3e-3,1e-4)"], "override.lr.value: interval(0.003, 0.0001) is empty"),
    (["override.lr.value=tag(log,interval(1e-4,3e-3"], "'override.lr.value=tag(log,interval(1e-4,3e-3': no viable alternative at input"),
    (["model.init_seed=choice(1,2)"], f"hydra.sweeper.params: model.init_seed: {FROZEN}: the model is built once, when the member's workers start"),
    (["lora=r8,r32"], f"hydra.sweeper.params: lora: {FROZEN}: the LoRA adapters are built once"),
    (["optimizer=adamw,sgd"], f"hydra.sweeper.params: optimizer: {FROZEN}: the optimizer's class and construction values are fixed when the workers start"),
    (["optimizer.lr=interval(1e-4,1e-3)"], f"hydra.sweeper.params: optimizer.lr: {FROZEN}: the optimizer's class"),
    (["backend.num_workers=1,2"], f"hydra.sweeper.params: backend.num_workers: {FROZEN}: the member's workers"),
    (["trainer.seed=choice(0,1)"], f"hydra.sweeper.params: trainer.seed: {FROZEN}: every member shares trainer.seed (the data order)"),
    (["trainer.steps=8,10"], f"hydra.sweeper.params: trainer.steps: {FROZEN}: members share their steps"),
    (["trainer.batch_size=4,8"], f"hydra.sweeper.params: trainer.batch_size: {FROZEN}: members share their batches"),
    (["data.split_seed=choice(0,1)"], f"hydra.sweeper.params: data.split_seed: {FROZEN}: every member reads the same data"),
    (["+override=lr_cosine,lr_wsd"], f"hydra.sweeper.params: +override: {FROZEN}: a preset is chosen once per run"),
    (["override.weight_decay=interval(0.0,0.1)"], "hydra.sweeper.params: override.weight_decay=interval(0.0,0.1): the selected "
     "override does not set weight_decay; type '+override.weight_decay=interval(0.0,0.1)' (the + adds a key the file does not set)"),
    (["~+override=lr_cosine"], "hydra.sweeper.params: override.lr.value=tag(log,interval(1e-4,3e-3)): no override is selected; "
     "select a preset first (+override=NAME)"),
    (["trainer.eval_every=2,4"], "hydra.sweeper.params: trainer.eval_every: not a value sent with every optimizer step; PBT searches override.* keys"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_population_is_one_line_and_exit_2_before_any_member(monkeypatch, capsys, tmp_path, args, line):
    args = [*BASE, f"hydra.sweep.dir={tmp_path / 'sweep'}", *GOOD, *args]
    if args[-1].startswith("~"):  # left out: the space, or the override
        args = [a for a in args if a != args[-1] and a != args[-1][1:]]
    if args[-1].startswith("+override="):  # the preset searched instead of given
        args = [a for a in args if a != "+override=lr_cosine"]
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.strip().startswith(f"tinker_exp: config error: {line}"), err
    assert "Traceback" not in out + err and "HYDRA_FULL_ERROR" not in out + err
    assert not (tmp_path / "sweep").exists() and POPULATION_ENV not in os.environ


def test_a_member_whose_start_values_fail_the_runs_checks_is_named_with_them_before_any_member(monkeypatch, capsys, tmp_path):
    """A negative weight decay is refused by the override's checks: every member is named, nothing is written."""
    args = [*BASE, f"hydra.sweep.dir={tmp_path / 'sweep'}", *GOOD, "+override.weight_decay=interval(-0.2,-0.1)"]
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[0] == "tinker_exp: config error: 4 of 4 sweep points are wrong; no job was started:", err
    assert [line.split(" [")[0].strip() for line in lines[1:]] == [f"job {m}" for m in range(4)]
    assert all("weight_decay" in line for line in lines[1:]) and not (tmp_path / "sweep").exists()



def test_failed_members_are_named_and_a_population_none_of_which_completed_exits_1(tmp_path):
    """Members whose jobs fail once started (a device this torch cannot drive: refused inside each job, before any
    worker): each named with why and its run dir, the summary and population_results.yaml say so, exit 1."""
    from omegaconf import OmegaConf

    from helpers import read_jsonl, run_cli

    sweep = tmp_path / "sweep"
    result = run_cli(*BASE, f"hydra.sweep.dir={sweep}", *GOOD, "hydra.sweeper.population=2", "backend.device=cuda",
                     "hydra.launcher.max_parallel=2", timeout=600)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"tinker_exp: error: none of the 2 members completed; {sweep / 'population_results.yaml'}"
    for member in (0, 1):
        assert f"member {member} failed: config error: backend.device=cuda: " in out and f"run dir {sweep / str(member)}" in out
    assert [(row["member"], row["status"]) for row in read_jsonl(sweep / "summary.jsonl")] == [(0, "FAILED"), (1, "FAILED")]
    saved = OmegaConf.load(sweep / "population_results.yaml")
    assert saved.best_member is None and saved.replay_command is None and [f.member for f in saved.failed] == [0, 1]
    assert "Traceback" not in result.stderr

# --- the members' start values ----------------------------------------------------------------------------------


def test_start_values_are_drawn_from_the_space_seeded():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.tinker_exp_plugins.pbt_sweeper import start_values

    space = {
        "override.lr.value": FloatDistribution(1e-4, 3e-3, log=True),
        "+override.weight_decay": FloatDistribution(0.0, 0.1),
        "override.lr.warmup_steps": IntDistribution(0, 4, step=2),
        "override.lr.schedule": CategoricalDistribution(["cosine", "linear"]),
    }
    drawn = start_values(space, 16, seed=3)
    assert drawn == start_values(space, 16, seed=3) and drawn != start_values(space, 16, seed=4)
    assert len({d["override.lr.value"] for d in drawn}) == 16  # each member its own
    for values in drawn:
        assert set(values) == set(space) and all(space[k]._contains(space[k].to_internal_repr(v)) for k, v in values.items())
    assert {d["override.lr.warmup_steps"] for d in drawn} <= {0, 2, 4}
    lrs = sorted(d["override.lr.value"] for d in drawn)  # log-uniform: as many below the geometric mean as above
    assert sum(lr < (1e-4 * 3e-3) ** 0.5 for lr in lrs) in range(4, 13)


# --- the end of a population, from member run dirs written as members write them ---------------------------------


def write_member(run_dir, lrs, losses, boundaries=(), objective=None, eval_every=2):
    """A member's run dir as a finished member leaves it: metrics.jsonl (requested/lr and weight_decay at every
    step, val/loss every eval_every steps), population.jsonl (one row per boundary), objective.json."""
    import json

    from tinker_exp.train.objective import write_objective

    run_dir.mkdir(parents=True)
    rows = []
    for step, (lr, loss) in enumerate(zip(lrs, losses)):
        row = {"train/step": step, "train/loss": loss, "requested/lr": lr, "requested/weight_decay": 0.01}
        if (step + 1) % eval_every == 0:
            row["val/loss"] = loss + 0.5
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "population.jsonl").write_text("".join(json.dumps(r) + "\n" for r in boundaries))
    if objective is not None:
        write_objective(run_dir, "val/loss", "last", objective)
    return run_dir


def boundary(step, score, values, previous, donor=None, sweep=None):
    exploit = None if donor is None else {"member": donor, "step": step, "checkpoint": str(sweep / str(donor) / "checkpoints" / f"step_{step}")}
    return {"step": step, "score": score, "rank": 0, "of": 3, "exploit": exploit, "values": values, "previous": previous}


@pytest.fixture
def population(tmp_path):
    """Three members, a boundary at steps 2 and 4 of 6: member 2 exploits member 0 at step 2 (its lr perturbed to
    1.2e-3), member 1 exploits member 0 at step 4 (to 8e-4); member 0 never exploits and ends best."""
    from tinker_exp.sweep.pbt_report import read_member

    sweep = tmp_path / "sweep"
    key = "override.lr.value"
    write_member(sweep / "0", [0.0] + [1e-3] * 5, [3.0, 2.8, 2.6, 2.4, 2.2, 2.0],
                 [boundary(2, 3.3, {key: 1e-3}, {key: 1e-3}), boundary(4, 2.9, {key: 1e-3}, {key: 1e-3})], 2.5)
    write_member(sweep / "1", [3e-4] * 4 + [8e-4] * 2, [3.0, 2.9, 2.85, 2.8, 2.3, 2.1],
                 [boundary(2, 3.4, {key: 3e-4}, {key: 3e-4}), boundary(4, 3.3, {key: 8e-4}, {key: 3e-4}, donor=0, sweep=sweep)], 2.6)
    write_member(sweep / "2", [5e-4] * 2 + [1.2e-3] * 4, [3.0, 2.95, 2.5, 2.35, 2.25, 2.15],
                 [boundary(2, 3.45, {key: 1.2e-3}, {key: 5e-4}, donor=0, sweep=sweep), boundary(4, 2.85, {key: 1.2e-3}, {key: 1.2e-3})], 2.65)
    starts = {0: 1e-3, 1: 3e-4, 2: 5e-4}
    members = [read_member(m, {key: starts[m]}, sweep / str(m), objective, None)
               for m, objective in ((0, 2.5), (1, 2.6), (2, 2.65))]  # fmt: skip
    members.append(read_member(3, {key: 2e-3}, sweep / "3", None, "ended by the scheduler (CANCELLED)", "CANCELLED"))
    return sweep, members


def test_the_summary_lists_members_by_final_objective_with_their_exploits_and_donors(population):
    from tinker_exp.sweep.pbt_report import results, table, write_summary

    sweep, members = population
    lines = table(members).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["*0", "1", "2", "3"]
    assert lines[0].split()[:6] == ["member", "objective:", "val/loss", "(last)", "exploits", "donors"]  # by its metric
    cells = {line.split()[0].lstrip("*"): line.split() for line in lines[2:]}
    assert cells["0"][1:4] == ["2.5000", "0", "-"] and cells["1"][1:4] == ["2.6000", "1", "0@4"]
    assert cells["2"][1:4] == ["2.6500", "1", "0@2"] and cells["3"][1:4] == ["-", "0", "-"] and "CANCELLED" in cells["3"]
    assert "override.lr.value=0.0008" in lines[3] and "override.lr.value=0.0003" in lines[3]  # final, start

    summary = write_summary(sweep, members)
    assert summary.read_text().startswith("```\n" + table(members) + "\n```\n")
    assert "- member 3 (CANCELLED): ended by the scheduler (CANCELLED)" in summary.read_text()
    rows = [__import__("json").loads(line) for line in (sweep / "summary.jsonl").read_text().splitlines()]
    assert [(r["member"], r["n_exploits"], r["exploits"]) for r in rows] == [
        (0, 0, []), (1, 1, [{"donor": 0, "step": 4}]), (2, 1, [{"donor": 0, "step": 2}]), (3, 0, [])]

    saved = results(members, ["+override=lr_cosine", "trainer.steps=6", "override.lr.warmup_steps=1", "logger=none"], 4, 2)
    assert (saved["best_member"], saved["best_objective"], saved["best_values"]) == (0, 2.5, {"override.lr.value": 1e-3})
    assert saved["best_run_dir"] == str(sweep / "0") and saved["n_completed"] == 3
    assert saved["replay_command"] == f"python -m tinker_exp --config-dir {sweep / '0'} +override=realized trainer.steps=6 logger=none"
    assert saved["failed"] == [{"member": 3, "status": "CANCELLED", "error": "ended by the scheduler (CANCELLED)"}]
    # a preset that selects its override in its defaults: the realized file replaces it (no +)
    assert results(members, ["hparams_search=pbt_lr_cosine"], 4, 2, override_in_defaults=True)["replay_overrides"] == [
        "override=realized", "hparams_search=pbt_lr_cosine", "hydra.mode=RUN"]  # one run, not the preset's sweep


def test_report_png_draws_each_members_objective_with_its_exploits_and_its_realized_values(population):
    """Read back as data: each member's evaluations; an x where a member exploited and a dotted line from its
    donor's score there to the member's next evaluation; the lr its lineage sent at every step, on a log axis
    (member 2's first two steps are member 0's, not its own start value)."""
    from tinker_exp.sweep.pbt_report import draw_report, write_report

    sweep, members = population
    fig = draw_report(members, {"override.lr.value": True}, "population test")
    objective_ax, lr_ax = fig.axes[:2]
    drawn: dict = {}  # gid -> its lines' points; a member's curve breaks at each of its exploits
    for line in objective_ax.get_lines():
        drawn.setdefault(line.get_gid(), []).append(line.get_xydata().tolist())
    drawn = {gid: parts[0] if len(parts) == 1 else parts for gid, parts in drawn.items()}
    assert drawn["member 0"] == [[2, 3.3], [4, 2.9], [6, 2.5]]
    assert drawn["member 2"] == [[[2, 3.45]], [[4, 2.85], [6, 2.65]]]
    assert drawn["member 1"] == [[[2, 3.4], [4, 3.3]], [[6, 2.6]]]
    assert drawn["exploit 2<-0@2"] == [[2, 3.45]] and drawn["exploit 1<-0@4"] == [[4, 3.3]]
    assert drawn["from donor 2<-0@2"] == [[2, 3.3], [4, 2.85]] and drawn["from donor 1<-0@4"] == [[4, 2.9], [6, 2.6]]
    assert "member 3" not in drawn  # cancelled before its first evaluation
    sent = {line.get_gid(): list(line.get_ydata())[:-1] for line in lr_ax.get_lines() if line.get_gid().startswith("member")}
    assert sorted(sent) == ["member 0", "member 1", "member 2"]  # each with its last value drawn to the step's end
    assert all(math.isnan(values[0]) for values in sent.values())  # step 0's lr 0 (member 0's, in every lineage): not on a log axis
    assert sent["member 2"][1:] == [1e-3] + [1.2e-3] * 4 and sent["member 1"][1:] == [1e-3] * 3 + [8e-4] * 2
    assert sent["member 0"][1:] == [1e-3] * 5 and lr_ax.get_yscale() == "log" and lr_ax.get_ylabel() == "sent lr"
    assert [l.get_gid() for l in objective_ax.get_lines() if str(l.get_gid()).startswith("boundary")] == ["boundary 2", "boundary 4"]
    legend = [t.get_text() for t in objective_ax.get_legend().get_texts()]
    assert legend[:3] == ["best: member 0 -> 2.5", "member 1 -> 2.6, 1 exploit", "member 2 -> 2.65, 1 exploit"]
    assert legend[3] == "member 3 (CANCELLED)"
    assert "best of 3 by val/loss: member 0, 2.5 (0 exploits; donors -)" in fig._suptitle.get_text()
    assert fig.axes[-1].get_xlabel().startswith("steps done (= train/step + 1;")  # boundaries count steps done
    path = write_report(members, {"override.lr.value": True}, sweep / "report.png", "population test")
    assert path.read_bytes()[:4] == b"\x89PNG"


# --- the preset --------------------------------------------------------------------------------------------------


def test_the_preset_plans_each_member_and_its_replay_composes(tmp_path):
    """hparams_search=pbt_lr_cosine as a dry run through the real sweeper: every member checked and planned with its
    own start values from the preset's space; a member's realized schedule replays through the overrides the
    summary prints (the preset selects lr_cosine in its defaults: realized.yaml takes its place)."""
    from omegaconf import OmegaConf

    from helpers import job_json, planned, run_cli
    from tinker_exp.sweep.pbt_report import replay_overrides

    sweep = tmp_path / "sweep"
    result = run_cli("-m", "hparams_search=pbt_lr_cosine", "dry_run=true", f"hydra.sweep.dir={sweep}", "logger=none")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "population of 4, a boundary every 5 steps of 20" in result.stdout
    assert "override.lr.value: tag(log, interval(0.0001, 0.003)), +override.weight_decay: interval(0, 0.1)" in result.stdout
    starts = []
    for member in range(4):
        values = dict(o.split("=", 1) for o in job_json(sweep / str(member))["overrides"] if "=" in o)
        lr, wd = float(values["override.lr.value"]), float(values["+override.weight_decay"])
        assert 1e-4 <= lr <= 3e-3 and 0 <= wd <= 0.1 and values["hparams_search"] == "pbt_lr_cosine"
        assert max(planned(sweep / str(member), "lr")) == pytest.approx(lr)  # the cosine's peak
        assert set(planned(sweep / str(member), "weight_decay")) == {wd}
        starts.append(lr)
    assert len(set(starts)) == 4
    saved = OmegaConf.load(sweep / "multirun.yaml")
    assert saved.hydra.sweeper.interval == 5 and saved.trainer.eval_every == 5

    member = sweep / "0"  # a realized schedule as a member writes it (keyframes where a value changes)
    (member / "override").mkdir()
    (member / "override" / "realized.yaml").write_text(
        "# @package override\nlr: {schedule: keyframes, points: {0: 0.001, 9: 0.001, 10: 0.0008, 19: 0.0008}}\nweight_decay: 0.05\n"
    )
    replay = replay_overrides(["hparams_search=pbt_lr_cosine", "logger=none"], override_in_defaults=True)
    result = run_cli("--config-dir", str(member), *replay, "dry_run=true", f"hydra.run.dir={tmp_path / 'replay'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert planned(tmp_path / "replay", "lr") == [0.001] * 10 + [0.0008] * 10
    assert set(planned(tmp_path / "replay", "weight_decay")) == {0.05}


def test_an_rl_population_is_scored_on_its_envs_held_out_prompts_without_validation_data():
    from helpers import compose
    from hydra_plugins.tinker_exp_plugins.pbt_sweeper import boundary_error

    from tinker_exp import config

    rl = ("env=digits", "loss=importance_sampling", "data.val_fraction=null", "trainer.steps=8", "trainer.eval_every=2")
    assert boundary_error(config.load(compose(*rl)), 2) is None
    assert boundary_error(config.load(compose(*rl, "env.eval_prompts=null")), 2) == (
        "hydra.sweeper=pbt: members are scored at evaluations, and the env has no held-out prompts (env.eval_prompts)"
    )
