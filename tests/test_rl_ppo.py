"""Several updates per sampled batch and the KL penalty, for real: verl's TinkerActorRolloutRefWorker (role "actor") on
2 CPU gloo ranks through the shared Ray cluster.

One sampled batch trained on by 4 updates with each loss, on one worker group (a pool's fresh state between losses):
on-policy (update 0) the four losses' gradients are the same, after it the ratio leaves 1, ppo clips and the four
updates part. One CLI run (ppo, 4 updates a batch, kl_coef 0.1, 6 steps: a last batch of 2 updates) is read by the
other tests; a copy of it is resumed mid-batch.
"""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import compose, metrics_rows, run_warm, trained_run

K = 4
PPO_COMMAND = ["env=digits", "loss=ppo", f"rl.updates_per_batch={K}", "rl.kl_coef=0.1", "trainer.steps=6",
               "env.eval_prompts=null", "logger=none", "checkpoint.every_steps=2", "checkpoint.keep_last=0"]  # fmt: skip
LOSSES = ("importance_sampling", "ppo", "cispo", "dro")


@pytest.fixture(scope="module")
def ppo_run(warm_pool, tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("ppo_run"), warm_pool, *PPO_COMMAND)


def test_on_one_sampled_batch_the_losses_agree_on_policy_and_part_once_the_ratio_leaves_1(ray_address):
    """The issue's complaint (with one update per batch ppo, cispo and dro train as importance_sampling does) and its
    fix: one batch sampled from the initial weights, then for each loss the group's fresh state (the initial weights,
    a new optimizer, that loss installed as a pooled run installs it) and K updates on that batch. Update 0 is
    on-policy: the ratio is 1 up to the sampler/trainer mismatch and every loss has the same gradient. From update 1
    the ratio leaves 1, ppo clips, and the four losses' updates and weights differ."""
    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.rl.env import load_env
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.rl_workers import RLWorkers, rl_loss_fn
    from tinker_exp.runtime.sampler import HFSampler
    from tinker_exp.train.rl import Prompt, RLBatches, Weights

    def typed(loss: str):
        return config.load(compose("env=digits", f"loss={loss}", f"rl.updates_per_batch={K}", f"trainer.steps={K}"))

    cfg = typed("importance_sampling")
    plan = validate(cfg)
    path = model_dir(cfg.model)
    workers = RLWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(path), plan.optimizer_values, "cpu",
                        loss_fn=rl_loss_fn(cfg.loss, cfg.rl), rl=cfg.rl)  # fmt: skip
    try:
        sampler, env = HFSampler(path, cfg.trainer.seed), load_env(cfg.env)
        prompts = [Prompt(row, sampler.prompt_ids(row.prompt)) for row in env.train]
        batches = RLBatches(prompts, Weights(sampler), env.reward, cfg.rl, cfg.env.max_new_tokens, cfg.trainer.seed)
        workers.ready()
        workers.keep_initial_state()
        batches.attach(workers)
        rollouts = batches.batch(0).examples
        assert len({r.advantage for r in rollouts}) > 1  # a batch with a signal
        updates, weights = {}, {}
        for name in LOSSES:
            run = typed(name)
            workers.for_run(run)
            workers.start_fresh(run.optimizer, run.trainer, plan.optimizer_values, workers.output)
            updates[name] = [workers.train_step(rollouts, plan[step]) for step in range(K)]
            weights[name] = workers.export_weights()
    finally:
        workers.shutdown()
    metrics = {name: [u.metrics for u in steps] for name, steps in updates.items()}
    for name in LOSSES:
        first, later = metrics[name][0], metrics[name][1:]
        assert abs(first["train/ratio_min"] - 1) < 1e-5 and abs(first["train/ratio_max"] - 1) < 1e-5, first
        assert all(m["train/ratio_max"] - m["train/ratio_min"] > 0.1 for m in later), later
    norms = [updates[name][0].grad_norm for name in LOSSES]
    assert norms == pytest.approx([norms[0]] * 4, rel=1e-4)  # on-policy: one gradient
    assert metrics["ppo"][0]["train/clip_fraction"] == 0.0
    assert all(m["train/clip_fraction"] > 0 for m in metrics["ppo"][1:]), metrics["ppo"]
    assert any(m["train/clip_fraction"] > 0 for m in metrics["cispo"][1:]), metrics["cispo"]  # a ratio past 4
    # cispo's gradient is importance_sampling's while no ratio leaves [0, 4] (its default bounds): the same
    # updates until the first that clips
    clips = next(u for u in range(1, K) if metrics["cispo"][u]["train/clip_fraction"] > 0)
    assert [u.grad_norm for u in updates["cispo"][:clips]] == pytest.approx([u.grad_norm for u in updates["importance_sampling"][:clips]], rel=1e-6)
    assert updates["cispo"][clips].grad_norm != pytest.approx(updates["importance_sampling"][clips].grad_norm, rel=1e-4)
    for a, b in [("importance_sampling", "ppo"), ("importance_sampling", "dro"), ("ppo", "cispo"), ("ppo", "dro"), ("cispo", "dro")]:
        assert updates[a][1].grad_norm != pytest.approx(updates[b][1].grad_norm, rel=1e-3), (a, b)
    apart = {(a, b): max((weights[a][k] - weights[b][k]).abs().max().item() for k in weights[a])
             for i, a in enumerate(LOSSES) for b in LOSSES[i + 1 :]}  # fmt: skip
    assert all(value > 1e-5 for value in apart.values()), apart


def test_a_batch_is_trained_on_by_k_updates_with_the_ratio_against_the_sampler_and_the_kl_penalty(ppo_run):
    """Steps 0-3 train on the batch sampled at 0, steps 4-5 on the one sampled at 4 (trainer.steps=6: the last batch
    gets 2 updates); each update's row has the batch's reward, the ratio (1 at update 0, away from 1 after), the KL
    to the initial model (0 at step 0 to float32 rounding: the policy is the initial model there) and a loss that is
    the policy's plus the penalty's."""
    rows = metrics_rows(ppo_run)
    assert [row["train/step"] for row in rows] == list(range(6))
    assert [row["train/update"] for row in rows] == [0, 1, 2, 3, 0, 1]
    assert len({row["train/reward"] for row in rows[:4]}) == 1 and len({row["train/reward"] for row in rows[4:]}) == 1
    assert [row["perf/sampling_s"] > 0 for row in rows] == [True, False, False, False, True, False]
    assert all(abs(row["train/ratio_mean"] - 1) < 1e-5 and row["train/clip_fraction"] == 0 for row in (rows[0], rows[4]))
    assert all(row["train/ratio_max"] > 1.2 and row["train/clip_fraction"] > 0 for row in rows[1:4] + rows[5:])
    assert abs(rows[0]["train/kl_ref"]) < 1e-9 and all(row["train/kl_ref"] > 1e-3 for row in rows[1:])
    assert all(row["train/loss"] == pytest.approx(row["train/pg_loss"] + row["train/kl_loss"], rel=1e-4, abs=1e-4) for row in rows)
    assert "KL to the initial model 0.1 x k3" in (ppo_run / "tinker_exp.log").read_text()
    held = {step: "batch" in json.loads((ppo_run / "checkpoints" / f"step_{step:08d}" / "loop.json").read_text())["batch_source"]
            for step in (2, 4, 6)}  # fmt: skip
    assert held == {2: True, 4: False, 6: True}


def test_a_run_resumed_mid_batch_trains_on_the_kept_batch_bitwise(ppo_run, warm_pool, tmp_path):
    """The run as it stood at its checkpoint after step 2 (mid-batch: updates 2 and 3 of the first batch to go),
    resumed with the same command: it trains on the batch from loop.json (its rollouts, sampler and reference
    log-probs), then samples the next one as the uninterrupted run did: every figure the same, bit for bit."""
    resumed = tmp_path / "run"
    shutil.copytree(ppo_run, resumed)
    for step in (4, 6):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(lines[:2]))
    result = run_warm(warm_pool, *PPO_COMMAND, f"hydra.run.dir={resumed}")
    assert "at step 2" in result.stdout, result.stdout[-3000:]
    same = ("train/update", "train/reward", "train/loss", "train/pg_loss", "train/grad_norm", "train/mismatch", "train/ratio_mean",
            "train/ratio_min", "train/ratio_max", "train/clip_fraction", "train/kl_ref", "train/kl_loss")  # fmt: skip
    assert [[row[key] for key in same] for row in metrics_rows(resumed)] == [[row[key] for key in same] for row in metrics_rows(ppo_run)]
