"""The RL batch source's and the loop's bookkeeping, with a fake sampler and FakeWorkers (pure, no Ray): the prompt
cursor and the sampler's random state in every checkpoint, the zero-advantage rule, one weight export per optimizer
step, objective_mode=max for early stop and keep_best. The real run of each is tests/test_rl_ray.py."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from fakes import FakeWorkers
from tinker_exp.config import CheckpointConfig, TrainerConfig
from tinker_exp.config.rl import RLConfig
from tinker_exp.optim import build_plan
from tinker_exp.config import OptimizerConfig
from tinker_exp.rl.prompts import PromptRow
from tinker_exp.rl.rewards import Reward
from tinker_exp.train.checkpoints import Checkpointer
from tinker_exp.train.early_stop import EarlyStop
from tinker_exp.train.judges import GO_ON
from tinker_exp.train.loop import BATCH_SOURCE, train
from tinker_exp.train.objective import objective_value
from tinker_exp.train.rl import OffPolicyBatches, Prompt, RLBatches, RLEvaluation, Weights
from tinker_exp.train.start import StartPoint

ALPHABET = "ab12"


@dataclass(frozen=True)
class FakeSample:
    response_ids: list[int]
    log_probs: list[float]
    text: str


class FakeSampler:
    """Responses drawn from its own random state (a string, as the HF sampler's); counts the weights it loads."""

    def __init__(self, seed: int = 0):
        self.state = self.state_for(seed)
        self.loaded = 0

    def prompt_ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def load(self, tensors) -> None:
        self.loaded += 1

    def sample(self, prompt_ids, n, max_new_tokens, temperature):
        rng = random.Random(self.state)
        out = []
        for _ in range(n):
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, max_new_tokens)))
            out.append(FakeSample([ord(c) for c in text], [-1.0] * len(text), text))
        self.state = str(rng.random())
        return out

    def rng_state(self) -> str:
        return self.state

    def set_rng_state(self, state: str) -> None:
        self.state = state

    def state_for(self, seed: int) -> str:
        return f"seed {seed}"


def digit_share(row, response):
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


def constant(row, response):
    return 0.5


def prompts(n: int = 5) -> list[Prompt]:
    rows = [PromptRow(f"p.jsonl:{i}", f"q{i}", json.dumps({"prompt": f"q{i}"})) for i in range(n)]
    return [Prompt(row, [i]) for i, row in enumerate(rows)]


class Trainer:
    """The workers as the sampler sees them: a weights version that each optimizer step (`step`) changes."""

    def __init__(self):
        self.weights_version = 0

    def export_weights(self):
        return {"version": self.weights_version}

    def step(self):
        self.weights_version += 1


def source(reward=digit_share, seed: int = 0, rl: RLConfig | None = None) -> RLBatches:
    batches = RLBatches(prompts(), Weights(FakeSampler(seed)), Reward("t:r", reward), rl or RLConfig(group_size=4, prompts_per_step=2),
                        max_new_tokens=6, seed=seed)  # fmt: skip
    batches.attach(Trainer())
    return batches


def rollouts(batch) -> list[tuple]:
    return [(r.prompt_ids, r.response_ids, r.advantage, r.reward) for r in batch.examples]


def test_a_restored_source_samples_what_the_uninterrupted_one_sampled():
    """The prompt cursor and the sampler's random state are the source's state: a source restored from the state
    at step 3 gives steps 3.. exactly (prompts, responses, advantages), across an epoch of the prompts."""
    uninterrupted = source()
    batches = [uninterrupted.batch(step) for step in range(3)]
    state = json.loads(json.dumps(uninterrupted.state()))  # as loop.json holds it
    later = [rollouts(uninterrupted.batch(step)) for step in range(3, 7)]
    assert state["prompt_cursor"] == 6 and isinstance(state["sampler_rng"], str)

    resumed = source()
    resumed.restore(state)
    assert [rollouts(resumed.batch(step)) for step in range(3, 7)] == later
    fresh = source()
    assert [rollouts(fresh.batch(step)) for step in range(3)] == [rollouts(b) for b in batches]  # seeded: repeatable
    assert rollouts(source(seed=1).batch(0)) != rollouts(batches[0])


def test_each_epoch_takes_every_prompt_once_in_a_shuffled_order():
    batches = source(rl=RLConfig(group_size=2, prompts_per_step=5))
    epochs = [[r.prompt_ids[0] for r in batches.batch(step).examples[::2]] for step in range(3)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1


def test_a_step_whose_groups_all_have_zero_advantage_still_runs_both_calls_with_the_plans_values(tmp_path):
    """The documented rule (docs/rl.md): forward_backward on the batch (all advantages 0) and optimizer_step with
    the plan's values of that step; the plan's index is the step's; the row says train/zero_advantage_step=1."""
    from helpers import compose
    from tinker_exp import config

    cfg = config.load(compose("trainer.steps=4", "+override=lr_cosine", "override.lr.warmup_steps=1"))
    plan = build_plan(cfg.override, cfg.optimizer, 4)
    workers = FakeWorkers(plan.optimizer_values)
    workers.ready()
    rows = []

    class Rows:
        def log(self, row):
            rows.append(row)

        def attach_table(self, *args):
            pass

    batches = source(reward=constant)
    train(TrainerConfig(steps=4, eval_every=0), plan, workers, batches, Rows())
    assert workers.calls == [plan[step] for step in range(4)]
    assert [row["train/zero_advantage_step"] for row in rows] == [1, 1, 1, 1]
    assert [row["train/degenerate_groups"] for row in rows] == [2, 2, 2, 2]
    assert all(row["applied/lr"] == row["requested/lr"] for row in rows)
    assert {r.advantage for r in batches.batch(4).examples} == {0.0}


def test_the_sampler_loads_the_weights_once_each_time_they_change_and_evaluation_leaves_the_training_rng_alone():
    batches = source()
    sampler, trainer = batches.weights.sampler, batches.weights.workers
    evaluation = RLEvaluation(prompts(2), batches.weights, batches.reward, batches.rl, 6, every=2, total_steps=4, seed=9)
    for step in range(2):
        batches.batch(step)
        trainer.step()
    state = sampler.rng_state()
    first = evaluation.run(None, 2)
    assert sampler.loaded == 3 and sampler.rng_state() == state  # steps 0, 1, then the weights after step 2
    batches.batch(2)  # the same weights as the evaluation after 2 steps: no second export
    assert sampler.loaded == 3
    trainer.step()  # e.g. a member loading another's checkpoint
    batches.batch(3)
    assert sampler.loaded == 4
    assert evaluation.run(None, 2)["eval/reward"] == first["eval/reward"]  # every evaluation starts from its seed
    assert [row[0] for row in evaluation.table] == [2] * 8  # (step, prompt, response, reward), 4 per evaluation


def test_objective_mode_max_keeps_the_highest_and_early_stop_counts_rewards_that_do_not_rise(tmp_path):
    assert objective_value([{"eval/reward": 0.2}, {"eval/reward": 0.9}, {"eval/reward": 0.5}], "eval/reward", "max") == 0.9
    judge = EarlyStop("eval/reward", patience=2, min_delta=0.0, sign=-1)
    judge.begin(StartPoint())
    decisions = [judge.evaluated(step, {"eval/reward": value}) for step, value in [(1, 0.2), (2, 0.6), (3, 0.5), (4, 0.6)]]
    assert decisions[:3] == [GO_ON] * 3 and decisions[3].stops and (judge.best, judge.best_step) == (0.6, 2)

    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_last=1, keep_best=True), 3,
                                FakeWorkers({"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}), {}, "eval/reward", -1)  # fmt: skip
    for step, value in [(1, 0.3), (2, 0.8), (3, 0.4)]:
        checkpointer.save(step, {}, {"eval/reward": value})
    assert checkpointer.best["step"] == 2 and sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_an_exploit_takes_the_donors_prompt_cursor_and_sampler_state_with_its_checkpoint(tmp_path):
    """A judge's continue_from(plan, checkpoint) (a population member's exploit) loads the checkpoint into the
    workers and the batch source: the member's steps after it sample what the donor's run sampled there (the
    donor's sampler RNG and prompt cursor), not what its own state would have (docs/rl.md). The real population:
    tests/test_rl_search.py."""
    from tinker_exp.config import OptimizerConfig
    from tinker_exp.train.judges import Judge, continue_from

    plan = build_plan({}, OptimizerConfig(), 4)
    trainer = TrainerConfig(steps=4, eval_every=2)

    class Rows(list):
        def log(self, row):
            self.append(row)

        def attach_table(self, *args):
            pass

    class Evaluation:
        def due(self, steps_done):
            return steps_done % 2 == 0

        def run(self, workers, steps_done):
            return {}

    def member(name: str, sampler_state: str, judges=()) -> list[dict]:
        workers, rows, batches = FakeWorkers(plan.optimizer_values), Rows(), source()
        batches.weights.sampler.set_rng_state(sampler_state)  # members' samplers part as their policies do
        workers.ready()
        checkpointer = Checkpointer(tmp_path / name, CheckpointConfig(every_steps=2, keep_last=0), 4, workers, {}, None)
        train(trainer, plan, workers, batches, rows, checkpointer, evaluation=Evaluation(), judges=judges)
        return rows

    class Exploit(Judge):
        def wants_checkpoint(self, steps_done):
            return steps_done == 2

        def saved(self, steps_done, row, checkpoint):
            return continue_from(plan, tmp_path / "donor" / "step_00000002")

    donor = member("donor", "donor's")
    own = member("own", "own")
    exploiting = member("member", "own", [Exploit()])
    sampled = ("train/reward", "train/reward_std", "train/response_length", "train/loss")
    assert [[row[k] for k in sampled] for row in exploiting] == [[row[k] for k in sampled] for row in own[:2] + donor[2:]]
    assert [row["train/reward"] for row in own[2:]] != [row["train/reward"] for row in donor[2:]]  # the rule shows
    state = json.loads((tmp_path / "donor" / "step_00000002" / "loop.json").read_text())[BATCH_SOURCE]
    assert state["prompt_cursor"] == 2 * 2


def test_each_sampled_batch_is_trained_on_by_updates_per_batch_steps():
    """rl.updates_per_batch=3: steps 0, 3, 6 sample (exporting the weights the last steps left; the prompt cursor
    moves), steps 1, 2, 4, 5 return the same rollouts (the sampler's log-probs and advantages as sampled) with the
    batch's reward; the row says which update it is and the times its step spent sampling (0 on a reuse)."""
    batches = source(rl=RLConfig(group_size=4, prompts_per_step=2, updates_per_batch=3))
    sampler, trainer = batches.weights.sampler, batches.weights.workers
    served = []
    for step in range(7):
        served.append(batches.batch(step))
        trainer.step()  # every optimizer step changes the weights
    assert [b.measured["train/update"] for b in served] == [0, 1, 2, 0, 1, 2, 0]
    assert sampler.loaded == 3 and batches.cursor == 3 * 2
    assert served[1].examples is served[0].examples and served[2].examples is served[0].examples
    assert rollouts(served[4]) == rollouts(served[3]) != rollouts(served[0]) != rollouts(served[6])
    assert [b.measured["train/reward"] for b in served[:3]] == [served[0].measured["train/reward"]] * 3
    assert [b.measured["perf/sampling_s"] > 0 for b in served] == [True, False, False, True, False, False, True]
    assert "perf/reference_s" not in served[0].measured  # no KL reference asked for


def test_a_checkpoint_mid_batch_holds_the_batch_and_a_resume_there_trains_on_the_same_bits():
    """The state after a step that is not a batch's last holds the batch (through JSON, as loop.json does: floats
    round-trip exactly); a source restored there serves the same rollouts to the batch's end, then samples what the
    uninterrupted source sampled. A batch's end holds no batch: the next step samples."""
    rl = RLConfig(group_size=4, prompts_per_step=2, updates_per_batch=3)
    uninterrupted = source(rl=rl)
    for step in range(2):
        uninterrupted.batch(step)
    mid = json.loads(json.dumps(uninterrupted.state()))
    later = [uninterrupted.batch(step) for step in range(2, 5)]
    end = json.loads(json.dumps(uninterrupted.state()))  # after step 4: mid-batch again (steps 3, 4, 5)
    assert mid["batch"]["first_step"] == 0 and end["batch"]["first_step"] == 3
    uninterrupted.batch(5)
    assert "batch" not in uninterrupted.state()

    resumed = source(rl=rl)
    resumed.restore(mid)
    again = [resumed.batch(step) for step in range(2, 5)]
    assert [r.examples for r in again] == [r.examples for r in later]  # Rollout equality: every int and float
    assert [r.measured["train/update"] for r in again] == [2, 0, 1]
    assert [r.measured["train/reward"] for r in again] == [r.measured["train/reward"] for r in later]
    assert isinstance(again[0].examples[0].log_probs[0], float)


def test_the_loop_checkpoints_the_batch_mid_batch_and_a_last_batch_may_be_partial(tmp_path):
    """trainer.steps=5 with 2 updates a batch: batches at steps 0, 2, 4 (the last trained once, by the plan's last
    step); every checkpoint after an odd number of steps holds its batch (the next step would train on it), the
    others none. The real resume mid-batch: tests/test_rl_ray.py."""
    from tinker_exp.train.checkpoints import saved_loop_state

    plan = build_plan({}, OptimizerConfig(), 5)
    rl = RLConfig(group_size=4, prompts_per_step=2, updates_per_batch=2)

    class Rows(list):
        def log(self, row):
            self.append(row)

        def attach_table(self, *args):
            pass

    def run(folder):
        workers, rows, batches = FakeWorkers(plan.optimizer_values), Rows(), source(rl=rl)
        workers.ready()
        checkpointer = Checkpointer(tmp_path / folder, CheckpointConfig(every_steps=1, keep_last=0), 5, workers, {}, None)
        train(TrainerConfig(steps=5, eval_every=0), plan, workers, batches, rows, checkpointer)
        return rows, batches

    rows, batches = run("full")
    assert [row["train/update"] for row in rows] == [0, 1, 0, 1, 0] and batches.cursor == 3 * 2
    held = {step: "batch" in saved_loop_state(tmp_path / "full" / f"step_{step:08d}")[BATCH_SOURCE] for step in range(1, 6)}
    assert held == {1: True, 2: False, 3: True, 4: False, 5: True}


def test_the_plan_table_says_which_batch_and_update_each_optimizer_step_is():
    from helpers import compose
    from tinker_exp import config
    from tinker_exp.optim.preview import format_table

    cfg = config.load(compose("trainer.steps=10", "+override=lr_cosine"))
    plan = build_plan(cfg.override, cfg.optimizer, 10)
    lines = format_table(plan, [5], updates_per_batch=4).splitlines()
    assert lines[0].split() == ["step", "batch:update", "lr"]
    assert {line.split()[0]: line.split()[1] for line in lines[2:] if line.split()[0].isdigit()}["5"] == "1:1"
    assert lines[-1] == "RL: a batch is sampled every 4 optimizer steps; step s trains batch s // 4, update s % 4 (column batch:update)"
    assert "batch" not in format_table(plan, [5])  # one update a batch: the table as before


class VersionedSampler(FakeSampler):
    """A FakeSampler that records which exported weights it held at each sampling call."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.holding, self.sampled_from = None, []

    def load(self, tensors) -> None:
        super().load(tensors)
        self.holding = tensors["version"]

    def sample(self, prompt_ids, n, max_new_tokens, temperature):
        self.sampled_from.append(self.holding)
        return super().sample(prompt_ids, n, max_new_tokens, temperature)


def off_policy_source(k: int, total_steps: int = 8) -> OffPolicyBatches:
    rl = RLConfig(group_size=4, prompts_per_step=2, max_steps_off_policy=k)
    batches = OffPolicyBatches(prompts(), Weights(VersionedSampler()), Reward("t:r", digit_share), rl, max_new_tokens=6,
                               seed=0, total_steps=total_steps)  # fmt: skip
    batches.attach(Trainer())
    return batches


@pytest.mark.parametrize("k", [1, 2])
def test_an_off_policy_batch_is_sampled_from_the_weights_k_steps_old_in_the_synchronous_order(k):
    """rl.max_steps_off_policy=k: step s's batch is sampled from the weights at the start of step max(s - k, 0)
    (train/staleness), prompts and random draws taken in step order: with a sampler that ignores its weights the
    batches are the synchronous run's, bitwise. No batch past the run's last step is sampled."""
    batches, sync = off_policy_source(k), source()
    trainer, sampler = batches.weights.workers, batches.weights.sampler
    served, expected = [], []
    for step in range(8):
        served.append(batches.batch(step))
        expected.append(sync.batch(step))
        trainer.step()
        sync.weights.workers.step()
    assert [b.measured["train/staleness"] for b in served] == [min(step, k) for step in range(8)]
    assert sampler.sampled_from == [max(step - k, 0) for step in range(8) for _ in range(2)]  # 2 prompts a batch
    assert [rollouts(b) for b in served] == [rollouts(b) for b in expected]
    assert [b.measured["train/reward"] for b in served] == [b.measured["train/reward"] for b in expected]
    assert batches.cursor == sync.cursor == 8 * 2 and not batches._exported  # every export used, then dropped
    assert batches._thread is not None
    batches._thread.join(timeout=60)  # it ends after the run's last batch
    assert not batches._thread.is_alive()


@pytest.mark.parametrize("k", [1, 2])
def test_an_off_policy_checkpoint_holds_the_batches_in_flight_and_a_resume_continues_bitwise(k):
    """The state after step s holds batches s + 1 .. s + k (sampled from weights the checkpoint does not hold), the
    cursor and the random state after them; through JSON (as loop.json), a source restored there serves what the
    uninterrupted one served from step s + 1 on, sampling batch s + k + 1 from the checkpoint's weights."""
    uninterrupted = off_policy_source(k)
    served = []
    for step in range(8):
        served.append(uninterrupted.batch(step))
        uninterrupted.weights.workers.step()
        if step == 2:
            state = json.loads(json.dumps(uninterrupted.state()))
    assert [entry["step"] for entry in state["in_flight"]] == list(range(3, 3 + k))
    assert [entry["batch"]["first_step"] for entry in state["in_flight"]] == [max(s - k, 0) for s in range(3, 3 + k)]

    resumed = off_policy_source(k)
    resumed.restore(state)
    resumed.weights.workers.weights_version = 3  # the checkpoint's weights: those at the start of step 3
    again = []
    for step in range(3, 8):
        again.append(resumed.batch(step))
        resumed.weights.workers.step()
    assert [b.examples for b in again] == [b.examples for b in served[3:]]  # Rollout equality: every int and float
    assert [b.measured["train/staleness"] for b in again] == [k] * 5
    assert resumed.weights.sampler.sampled_from == [s - k for s in range(3 + k, 8) for _ in range(2)]


def test_a_restore_mid_run_stops_the_sampling_thread_and_drops_what_it_sampled():
    """An exploit loads another checkpoint mid-run: the thread stops, and the batches come from the loaded state."""
    donor = off_policy_source(1)
    for step in range(3):
        donor.batch(step)
        donor.weights.workers.step()
    state = json.loads(json.dumps(donor.state()))
    member = off_policy_source(1)
    for step in range(2):
        member.batch(step)
        member.weights.workers.step()
    thread = member._thread
    member.restore(state)
    assert not thread.is_alive() and member._thread is None
    assert rollouts(member.batch(3)) == rollouts(donor.batch(3))


def test_a_reward_that_fails_in_the_sampling_thread_fails_the_loops_next_batch():
    def broken(row, response):
        raise ValueError("no reward for you")

    rl = RLConfig(group_size=4, prompts_per_step=2, max_steps_off_policy=1)
    batches = OffPolicyBatches(prompts(), Weights(VersionedSampler()), Reward("t:r", broken), rl, max_new_tokens=6,
                               seed=0, total_steps=4)  # fmt: skip
    batches.attach(Trainer())
    with pytest.raises(Exception, match="no reward for you"):
        batches.batch(0)


def test_close_stops_a_sampling_thread_left_waiting_by_a_run_that_stopped_early():
    batches = off_policy_source(1)
    for step in range(2):
        batches.batch(step)
        batches.weights.workers.step()
    thread = batches._thread
    batches._in_flight_through(2)  # it sampled batch 2 and waits for the weights of step 2, which never come
    assert thread.is_alive()
    batches.close()
    assert not thread.is_alive() and not batches._exported and not batches._ready
