"""RL runs on verl's TinkerActorRolloutRefWorker (role "actor"): the RL ``Workers`` of the training loop.

Built from verl's own generated PPO defaults (the `actor_rollout_ref` section VeRL-Tinker merges too), with the
model, engine and optimizer values of an SFT run laid over them (`tinker_exp.runtime.workers.worker_config`), so both
kinds of run build the same model and optimizer. The RL loss is installed once, after init_model (which installs
verl's ppo_loss), never swapped per step. Each step: forward_backward on the sampled batch (verl dispatches it to
the "actor" mesh), then optimizer_step with the plan's values, read back from every param group as in SFT.

The sampler lives in the driver (runtime/sampler.py): after every optimizer step the workers export the full
tensors verl's `update_weights` would push into a rollout (`export_weights`), or with LoRA the adapter, which the
sampler merges into its copy of the base weights.
"""

from __future__ import annotations

import logging
import time
from importlib.resources import files
from typing import Any, Sequence

from tinker_exp.runtime import lora as lora_adapters
from tinker_exp.runtime.workers import TinkerWorkers, _loss, fresh_engine, worker_config, worker_extras
from tinker_exp.train.protocols import StepResult

log = logging.getLogger(__name__)

ROLE = "actor"
"""The worker's role: the actor alone (verl 0.9.1 cannot build its rollouts on CPU; the driver samples)."""
LOSS_METRICS = {
    "actor/pg_loss": "train/pg_loss",
    "actor/pg_clipfrac": "train/clip_fraction",  # ppo, cispo only
    "actor/ppo_kl": "train/ppo_kl",  # token mean of log p_sampler - log p_trainer: KL(sampler || policy), k1
    "actor/abs_log_ratio": "train/mismatch",  # mean |log p_trainer - log p_sampler| over the response tokens
    "actor/ratio_mean": "train/ratio_mean",  # the importance ratio p_trainer / p_sampler over the response tokens
    "actor/ratio_min": "train/ratio_min",
    "actor/ratio_max": "train/ratio_max",
    "actor/kl_ref": "train/kl_ref",  # token mean of rl.kl_estimator against the initial model (with a reference)
    "actor/kl_loss": "train/kl_loss",  # kl_coef x its token sum: train/loss = train/pg_loss + train/kl_loss
}
"""The RL loss's metrics (runtime/rl_losses.py) -> the row's names."""


def _rl_worker_class():
    import torch
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

    class TinkerExpActorWorker(worker_extras("actor"), TinkerActorRolloutRefWorker):
        """verl's RL worker with this project's extras, its loss installed at the build.

        The extras: runtime/workers.py `worker_extras`, the weight export for the driver's sampler among them."""

        def _trained_engine(self) -> Any:
            return self.actor.engine

        def _trained_model_config(self) -> Any:
            return self.actor.model_config

        def _installed_loss(self) -> Any:
            return self.actor.loss_fn  # ours (`init_model_with_loss`), not the one verl keeps on the worker

        def _build_seed(self) -> int:
            return self.config.actor.fsdp_config.seed

        def _verl_forward_backward(self, data):
            # every token's log-prob stays on the worker (not verl's copy to the CPU): the driver needs the metrics
            return self.actor.forward_backward(data=data)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model_with_loss(self, loss_fn):
            """verl's init_model (which installs its ppo_loss), then our loss, in one call.

            verl's worker is an async Ray actor (its update_weights is a coroutine), which does not run two calls in the
            order they were sent."""
            torch.manual_seed(self.config.actor.fsdp_config.seed)  # as the SFT worker's reset: the same start
            TinkerActorRolloutRefWorker.init_model(self)
            lora_adapters.start_trial(self.actor.engine.module, self.config.actor.fsdp_config.seed)
            self.actor.set_loss_fn(loss_fn=loss_fn)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def fresh_state(self, config, loss_fn, seed: int) -> None:
            """Start a pool's run: the engine as a cold build with `seed` leaves it, a new optimizer, the run's loss.

            The engine is the actor's; the optimizer is built from `config` (this run's actor_rollout_ref section) as
            init_model builds it."""
            from verl.utils.config import omega_conf_to_dataclass

            optimizer_config = omega_conf_to_dataclass(config.actor).optim
            self.kept = fresh_engine(self.actor.engine, self.kept, optimizer_config, seed)
            self.actor.optimizer_config = optimizer_config
            self.actor.set_loss_fn(loss_fn=loss_fn)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def installed(self) -> str:
            """What this rank runs: its worker class, role and the loss forward_backward calls."""
            fn = self.actor.loss_fn
            name = getattr(fn, "keywords", {}).get("loss") or getattr(getattr(fn, "func", fn), "__name__", repr(fn))
            return f"{TinkerActorRolloutRefWorker.__name__} (role {self.role}), loss {name}"

    return TinkerExpActorWorker


def rl_loss_fn(loss: Any, rl: Any):
    """The run's loss function (config LossConfig, RLConfig): Tinker's loss with its parameters and the KL penalty."""
    from tinker_exp.runtime.rl_losses import build_loss_fn

    return build_loss_fn(loss.name.value, loss.params, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator)


def actor_rollout_ref_config(sft_config: Any, backend: Any, batch_size: int, group_size: int):
    """verl's generated `actor_rollout_ref` defaults, with the SFT run's model, engine and optimizer laid over them.

    An RL run builds the model and optimizer an SFT run with the same config would."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    generated = OmegaConf.load(files("verl.trainer.config").joinpath("_generated_ppo_trainer.yaml"))
    section = generated.actor_rollout_ref
    model, engine, optim = sft_config.model_config, sft_config.engine_config, sft_config.optimizer_config
    section.model.path = model.path
    section.model.override_config = dict(model.override_config)
    section.model.enable_gradient_checkpointing = model.enable_gradient_checkpointing
    section.model.use_remove_padding = False
    for name in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules"):  # LoRA, as the SFT run's model
        section.model[name] = OmegaConf.create({"v": getattr(model, name)}).v
    actor = section.actor
    actor.strategy = backend.strategy
    for field in fields(optim):  # every value an SFT run's optimizer is built with
        if field.name in actor.optim and not field.name.startswith("_"):
            actor.optim[field.name] = OmegaConf.create({"v": getattr(optim, field.name)}).v
    for name in ("mixed_precision", "seed", "use_torch_compile", "model_dtype", "use_no_sync_for_gradient_accumulation"):
        actor.fsdp_config[name] = getattr(engine, name)
    actor.use_torch_compile = engine.use_torch_compile
    actor.ppo_mini_batch_size = batch_size // group_size  # verl counts prompts here (times rollout.n)
    actor.ppo_micro_batch_size_per_gpu = backend.micro_batch_size
    actor.use_dynamic_bsz = False
    actor.use_kl_loss = False
    actor.entropy_coeff = 0.0
    section.rollout.name = "hf"  # required by the schema; role "actor" builds no rollout
    section.rollout.n = group_size
    section.rollout.log_prob_micro_batch_size_per_gpu = backend.micro_batch_size
    section.rollout.log_prob_use_dynamic_bsz = False
    return section


class RLWorkers(TinkerWorkers):
    """A Ray worker group of TinkerActorRolloutRefWorkers (role "actor") with one FSDP2 engine over all ranks.

    `loss_fn`: the picklable loss installed once on every rank; `rl`: the run's RLConfig."""

    def __init__(self, *args: Any, loss_fn: Any, rl: Any, **kwargs: Any):
        self.loss_fn, self.rl = loss_fn, rl
        self.weights_version = 0
        """Changes whenever the weights do (an optimizer step, a loaded checkpoint): the sampler reloads then."""
        super().__init__(*args, **kwargs)

    def worker_class(self) -> type:
        return _rl_worker_class()

    def _worker_config(self, backend, optimizer, trainer, model_path, optimizer_values):
        sft = worker_config(backend, optimizer, trainer, model_path, optimizer_values, self.choice, self.lora)
        return actor_rollout_ref_config(sft, backend, self.rl.prompts_per_step * self.rl.group_size, self.rl.group_size)

    def _init_args(self, worker_config: Any) -> dict[str, Any]:
        return {"config": worker_config, "role": ROLE}

    def optimizer_config_of(self, worker_config: Any) -> Any:
        from verl.utils.config import omega_conf_to_dataclass

        return omega_conf_to_dataclass(worker_config.actor).optim  # as init_model and `fresh_state` build it

    def for_run(self, cfg: Any) -> None:
        """Take another run's loss and sampling temperature, for a pool's group lent to it.

        That run's loss (its parameters, its KL penalty) and sampling temperature, installed by the fresh start that
        follows (`_fresh_state`), not the first run's."""
        self.loss_fn, self.rl = rl_loss_fn(cfg.loss, cfg.rl), cfg.rl

    def _build_model(self) -> list:
        return self.group.execute_all_async("init_model_with_loss", self.loss_fn)

    def ready(self) -> None:
        super().ready()
        self.say_installed()

    def say_installed(self) -> None:
        log.info(f"workers: {self.group.installed()[0]}")  # the loss this run's fresh state installed, as a rank says

    def load_checkpoint(self, folder) -> None:
        super().load_checkpoint(folder)
        self.weights_version += 1

    def _fresh_state(self, worker_config: Any, seed: int) -> list:
        self.weights_version += 1
        return self.group.execute_all_async("fresh_state", worker_config, self.loss_fn, seed)

    def export_weights(self) -> "dict[str, Any] | lora_adapters.Adapter":
        """The full model's tensors by name, gathered from every rank (rank 0's copy); with LoRA, the adapter.

        The sampler merges an adapter into its base weights (runtime/sampler.py)."""
        if self.lora_rank == 0:
            return self.group.export_weights()[0]
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="tinker_exp-adapter-") as folder:
            self.export_adapter(Path(folder) / "adapter")
            return lora_adapters.Adapter.read(Path(folder) / "adapter")

    def train_step(self, examples: Sequence[Any], optim_step_params: dict[str, Any] | None) -> StepResult:
        """forward_backward on the sampled batch, then optimizer_step(override).

        `examples`: train.rl.Rollout. The loss's own metrics and the two calls' times join the result."""
        start = time.perf_counter()
        output = self.group.forward_backward(self._batch(examples)).get()
        backward_done = time.perf_counter()
        per_rank = self.group.optimizer_step(optim_step_params=optim_step_params or None)
        self.weights_version += 1
        grad_norm = next((float(r["grad_norm"]) for r in per_rank if "grad_norm" in r), float("nan"))
        metrics = {
            **loss_metrics(output),
            "perf/forward_backward_s": backward_done - start,
            "perf/optimizer_step_s": time.perf_counter() - backward_done,
        }
        return StepResult(_loss(output), grad_norm, [r["param_groups"] for r in per_rank], metrics)

    def evaluate(self, examples: list) -> float:
        raise NotImplementedError("an RL run evaluates by sampling (train.rl.RLEvaluation), not by NLL")

    def _batch(self, rollouts: Sequence[Any]):
        """The RL TensorDict verl's actor takes (the shape VeRL-Tinker builds from Tinker datums).

        The full sequences nested, and (B, R) response masks, sampler log-probs and advantages, R the longest
        response."""
        import torch
        from verl.utils import tensordict_utils as tu

        def nested(rows: list[list[int]], dtype=torch.long):
            return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

        full = [list(r.prompt_ids) + list(r.response_ids) for r in rollouts]
        longest = max(len(r.response_ids) for r in rollouts)
        mask = torch.zeros(len(rollouts), longest)
        old_log_probs = torch.zeros(len(rollouts), longest)
        advantages = torch.zeros(len(rollouts), longest)
        reference = all(r.ref_log_probs is not None for r in rollouts)
        ref_log_probs = torch.zeros(len(rollouts), longest)
        for i, rollout in enumerate(rollouts):
            n = len(rollout.response_ids)
            mask[i, :n] = 1.0
            old_log_probs[i, :n] = torch.tensor(rollout.log_probs, dtype=torch.float32)
            advantages[i, :n] = rollout.advantage
            if reference:
                ref_log_probs[i, :n] = torch.tensor(rollout.ref_log_probs, dtype=torch.float32)
        return tu.get_tensordict(
            tensor_dict={
                **({"ref_log_prob": ref_log_probs} if reference else {}),  # verl's name; the loss's KL term reads it
                "input_ids": nested(full),
                "position_ids": nested([list(range(len(f))) for f in full]),
                "prompts": nested([list(r.prompt_ids) for r in rollouts]),
                "responses": nested([list(r.response_ids) for r in rollouts]),
                "attention_mask": torch.ones(len(full), max(len(f) for f in full), dtype=torch.long),
                "response_mask": mask,
                "loss_mask": mask,  # verl sums it for the batch's token count
                "old_log_probs": old_log_probs,
                "advantages": advantages,
            },
            non_tensor_dict={
                "global_batch_size": len(rollouts),
                "temperature": float(self.rl.temperature),  # verl divides the logits by it, as the sampler did
                "calculate_entropy": False,
                "max_response_len": longest,
                "global_token_num": [len(f) for f in full],
            },
        )



def loss_metrics(output: Any) -> dict[str, float]:
    """The loss's own metrics (runtime/rl_losses.py), reduced over micro batches and ranks, under the row's names."""
    from tinker_exp.runtime.rl_losses import batch_metrics

    metrics = batch_metrics(output["metrics"] if isinstance(output, dict) else output.get_non_tensor("metrics"))
    return {name: metrics[key] for key, name in LOSS_METRICS.items() if key in metrics}
