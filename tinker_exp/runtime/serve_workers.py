"""The served model's workers: verl's Tinker worker with Tinker's losses, per-datum log-probs sent back.

Tinker's cross_entropy is ``sum(-logprob(target_tokens[i]) * weights[i])`` over every datum, with no normalisation;
verl's FSDP averages the gradients over the data-parallel ranks, so each micro batch returns its own sum times
``dp_size`` (as runtime/rl_losses.py does): one ``forward_backward`` leaves the gradient of the batch's sum, and
chunks sent one after the other accumulate into the gradient of their union until ``optim_step``.

verl's model output is the log-prob of each next input token, so a datum is its ``model_input`` plus the last target
token, and ``target_tokens`` must be ``model_input`` shifted by one (what the SDK's helpers build); anything else is
refused (tinker_exp/serve/wire.py).

The RL losses (importance_sampling, ppo, cispo, dro, gspo, stable_reinforce) are runtime/rl_losses.py's, installed when a call asks for
another loss than the one installed: each datum is laid out as an RL rollout whose "prompt" is its first token and
whose "response" is every target position, masked by `weights` (positions of weight 0 add nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tinker_exp.runtime.slots import Slot, SlotGroup, packed_rows
from tinker_exp.runtime.workers import TinkerWorkers, _worker_class

LOSS_SUM = "loss:sum"
"""The metric the SDK pops from every forward_backward: the loss, summed."""


@dataclass(frozen=True)
class Datum:
    """One datum as the workers take it: the sequence (model_input + the last target) and each position's weight.

    weights[j]: the weight of predicting tokens[j]; 0 at j = 0."""

    tokens: list[int]
    weights: list[float]
    logprobs: list[float] | None = None
    """The RL losses: the sampler's log-prob of tokens[j] at j (0 at j = 0)."""
    advantages: list[float] | None = None
    """The RL losses: the advantage of tokens[j] at j (0 at j = 0)."""

    def padding(self) -> "Datum":
        """A copy that adds nothing: every weight 0."""
        zeros = [0.0] * len(self.tokens)
        return Datum(self.tokens, zeros, zeros if self.logprobs is not None else None,
                     zeros if self.advantages is not None else None)


def cross_entropy_loss(model_output, data, dp_group=None):
    """verl's loss signature: this micro batch's Tinker cross_entropy sum, times dp_size; the sum as a metric."""
    import torch
    from verl.utils.metric import AggregationType, Metric

    log_prob = model_output["log_probs"].values()
    weights = torch.roll(data["weights"].values(), shifts=-1, dims=0)  # weights[j] -> the log-prob at j - 1
    loss = -(log_prob * weights.to(log_prob.dtype)).sum() * data["dp_size"]
    return loss, {"serve/loss_sum": Metric(AggregationType.SUM, loss.detach())}


CROSS_ENTROPY = "cross_entropy"


def loss_function(name: str, params: dict[str, float]):
    """verl's loss function for Tinker's loss `name` (cross_entropy, or an RL loss with its parameters)."""
    if name == CROSS_ENTROPY:
        return cross_entropy_loss
    from tinker_exp.runtime.rl_losses import build_loss_fn

    return build_loss_fn(name, params)


def _serve_worker_class():
    from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    base = _worker_class()

    class ServeWorker(base):
        """Our worker, sending back every token's log-prob with the metrics (the SDK hands them to its client)."""

        per_token_losses = (cross_entropy_loss,)  # its slots' cross_entropy calls pack (ServedSlots)

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
        def forward_backward(self, data):
            output = TinkerTrainingWorker.forward_backward(self, data)
            if output is None:
                return None
            log_probs = output["log_probs"]
            return tu.get_tensordict(tensor_dict={"log_probs": log_probs},
                                     non_tensor_dict={"metrics": output.get_non_tensor("metrics")})

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_state(self, local_path: str, optimizer: bool) -> None:
            """verl's load of a checkpoint: with the optimizer's state (and the RNG's), or the weights alone.

            The weights alone go with a fresh optimizer (Tinker's load_state: Adam's moments and step count start
            again)."""
            manager = self.engine.checkpoint_manager
            contents = manager.checkpoint_load_contents
            manager.checkpoint_load_contents = ["model", "optimizer", "extra"] if optimizer else ["model"]
            try:
                self.engine.load_checkpoint(local_path, del_local_after_load=False)
            finally:
                manager.checkpoint_load_contents = contents
            if not optimizer:
                self.engine.optimizer.state.clear()  # torch's optimizers build a parameter's state at its first step

    return ServeWorker


class ServeWorkers(TinkerWorkers):
    """The served model's worker group: Tinker's cross_entropy, and forward_backward/optimizer_step as two calls."""

    def __init__(self, backend: Any, *args: Any, **kwargs: Any):
        self.pad_to = backend.num_workers * backend.nodes * backend.micro_batch_size  # verl: whole micro batches per rank
        super().__init__(backend, *args, **kwargs)

    def worker_class(self) -> type:
        return _serve_worker_class()

    def _build_model(self) -> list:
        self.installed = (CROSS_ENTROPY, ())
        return [*self.group.execute_all_async("reset"), *self.group.execute_all_async("set_loss_fn", cross_entropy_loss)]

    def use_loss(self, name: str, params: dict[str, float]) -> None:
        """Install Tinker's loss `name` on every rank, unless it is the one installed."""
        import ray

        wanted = (name, tuple(sorted(params.items())))
        if wanted != self.installed:
            ray.get(self.group.execute_all_async("set_loss_fn", loss_function(name, params)))
            self.installed = wanted

    def forward_backward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        """The batch's summed loss (the installed loss) and each datum's target log-probs (len(model_input) of them).

        The gradient accumulates until optimizer_step."""
        return self._pass("forward_backward", data)

    def forward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        """As forward_backward, without gradients: verl's infer_batch (eval mode, no_grad)."""
        return self._pass("infer_batch", data)

    def save_state(self, folder: Path, step: int) -> None:
        self.save_checkpoint(folder, step)

    def load_state(self, folder: Path, optimizer: bool) -> None:
        """A saved state into every rank: the weights, and the optimizer's state only when `optimizer`."""
        self.group.load_state(local_path=str(folder), optimizer=optimizer)

    def export_weights(self) -> dict[str, Any]:
        """Full fine-tuning: the model's full tensors by name (rank 0's copy)."""
        return self.group.export_weights()[0]

    def cycle(self, call: str, loss: str) -> tuple[Any, str | None]:
        """A model alone on its group (full fine-tuning): its calls never train with another's."""
        return None, None

    def padded(self, data: Sequence[Datum]) -> list[Datum]:
        """`data` padded with zero-weight copies of the first datum to whole micro batches on every rank.

        verl splits a batch evenly and asserts whole micro batches; a zero weight adds exactly nothing to the
        gradient."""
        return list(data) + [data[0].padding()] * (-len(data) % self.pad_to)

    def _pass(self, method: str, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        padded = self.padded(data)
        batch = self._datum_batch(padded) if self.installed[0] == CROSS_ENTROPY else self._rl_batch(padded)
        output = getattr(self.group, method)(batch).get()
        loss = output.get_non_tensor("metrics")["loss"]
        loss = float(sum(loss) / len(loss)) if isinstance(loss, list) else float(loss)
        rows = output["log_probs"]
        return loss, [rows[i].tolist()[: len(datum.tokens) - 1] for i, datum in enumerate(data)]

    def optimizer_step(self, params: dict[str, Any]) -> tuple[float, list[list[dict[str, Any]]]]:
        """verl's optimizer_step with `params` (grad_clip_norm included); the grad norm and every rank's groups."""
        per_rank = self.group.optimizer_step(optim_step_params=params or None)
        grad_norm = next((float(r["grad_norm"]) for r in per_rank if "grad_norm" in r), float("nan"))
        return grad_norm, [r["param_groups"] for r in per_rank]

    def _datum_batch(self, data: Sequence[Datum]):
        import torch
        from verl.utils import tensordict_utils as tu

        def nested(rows, dtype):
            return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

        tokens = [d.tokens for d in data]
        return tu.get_tensordict(
            tensor_dict={
                "input_ids": nested(tokens, torch.long),
                "position_ids": nested([list(range(len(t))) for t in tokens], torch.long),
                "loss_mask": nested([[int(w != 0) for w in d.weights] for d in data], torch.long),
                "weights": nested([d.weights for d in data], torch.float32),
            },
            non_tensor_dict={"temperature": 1.0, "global_token_num": [len(t) for t in tokens]},
        )

    def _rl_batch(self, data: Sequence[Datum]):
        """The RL TensorDict runtime/rl_losses.py reads (as runtime/rl_workers.py builds it).

        Each datum's first token is its prompt, every later position its response, masked by its weights."""
        import torch
        from verl.utils import tensordict_utils as tu

        def nested(rows):
            return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)

        longest = max(len(d.tokens) for d in data) - 1
        mask, old_log_probs, advantages = (torch.zeros(len(data), longest) for _ in range(3))
        for i, datum in enumerate(data):
            n = len(datum.tokens) - 1
            mask[i, :n] = torch.tensor([float(w != 0) for w in datum.weights[1:]])
            old_log_probs[i, :n] = torch.tensor(datum.logprobs[1:], dtype=torch.float32)
            advantages[i, :n] = torch.tensor(datum.advantages[1:], dtype=torch.float32)
        tokens = [d.tokens for d in data]
        return tu.get_tensordict(
            tensor_dict={
                "input_ids": nested(tokens),
                "position_ids": nested([list(range(len(t))) for t in tokens]),
                "prompts": nested([t[:1] for t in tokens]),
                "responses": nested([t[1:] for t in tokens]),
                "attention_mask": torch.ones(len(tokens), longest + 1, dtype=torch.long),
                "response_mask": mask,
                "loss_mask": mask,
                "old_log_probs": old_log_probs,
                "advantages": advantages,
            },
            non_tensor_dict={"global_batch_size": len(data), "temperature": 1.0, "calculate_entropy": False,
                             "max_response_len": longest, "global_token_num": [len(t) for t in tokens]},
        )


FORWARD_BACKWARD, FORWARD, OPTIM_STEP = "forward_backward", "forward", "optim_step"
"""The server's calls that train in cycles (`ServedSlots`), as its terminal lines name them."""


class ServedSlots(SlotGroup):
    """The server's LoRA group: its clients' models on slots (runtime/slots.py), and the **cycles** of their calls.

    A cycle: their calls that wait at once (the server's work thread takes them together: tinker_exp/serve/app.py).
    Cross_entropy forward_backward calls (and forwards) of several models go through the base model in one packed
    forward and backward (runtime/packed.py), each model's loss sum and log-probs as its call alone gives them (within
    the packed bound, docs/slots.md) and its gradients added to its own pending ones; optim_steps of several models run
    in one round trip, each at its own values (bitwise its step alone). Each request's line on the server's terminal
    says when it trained in a cycle."""

    def forward_backward_together(self, calls: Sequence[tuple["ServedSlot", Sequence[Datum]]],
                                  forward_only: bool = False) -> list[tuple[float, list[list[float]]]]:
        """Each (slot, data)'s cross_entropy forward_backward in one packed pass.

        `forward_only`: forward, no gradient. Each one's summed loss and its datums' target log-probs, as
        `ServeWorkers.forward_backward` returns them alone."""
        from verl.utils import tensordict_utils as tu

        workers = self.workers
        with self.lock:
            for slot, _ in calls:
                self._check(slot)
            workers.use_loss(CROSS_ENTROPY, {})
            padded = [(slot, workers.padded(data)) for slot, data in calls]
            batch = self._packed_batch(padded, workers._datum_batch)
            tu.assign_non_tensor(batch, slots_forward_only=forward_only, slots_log_probs=True)
            self.loaded = None  # each rank parks its loaded slot first
            output = workers.group.slots_forward_backward(batch).get()
        losses, rows = output.get_non_tensor("slot_losses"), output["log_probs"]
        log_probs: list[list[list[float]]] = [[[] for _ in data] for _, data in calls]
        for row, (k, i) in zip(rows.unbind(), packed_rows([len(data) for _, data in padded], workers.group.world_size), strict=True):
            if i < len(calls[k][1]):  # a padding row's are dropped
                log_probs[k][i] = row.tolist()[: len(calls[k][1][i].tokens) - 1]
        return [(float(losses[slot.index]), each) for (slot, _), each in zip(calls, log_probs, strict=True)]

    def optimizer_steps(self, calls: Sequence[tuple["ServedSlot", dict[str, Any]]]) -> list[tuple[float, list[list[dict[str, Any]]]]]:
        """Each (slot, params)'s optim_step, in one round trip: `ServeWorkers.optimizer_step`'s result for each."""
        with self.lock:
            for slot, _ in calls:
                self._check(slot)
            return self._optimizer_steps(calls)


class ServedSlot(Slot):
    """A served client's model on a slot of the server's `ServedSlots` group.

    The server's calls, each on this slot's adapters, optimizer, pending gradients and RNG, so a client's results are
    those it gets alone; its calls that wait with other models' train with them in one cycle (`cycle`)."""

    given_back: Callable[[], None] | None = None
    """Called once the slot is freed (its client's session ended): the server says so, and keeps its group warm once
    it holds no model."""

    def cycle(self, call: str, loss: str) -> tuple[Any, str | None]:
        """The group whose cycles this model's `call` joins, and None; or None and why it runs alone (time-shared).

        `loss`: Tinker's loss of the call. Why it runs alone is a line the server says once."""
        if self.group.refused:
            return None, f"the slots' calls are time-shared, not packed: {self.group.refused}"
        if call != OPTIM_STEP and loss != CROSS_ENTROPY:
            return None, f"{call} with loss {loss} runs alone on its slot (time-shared): only cross_entropy calls pack"
        return self.group, None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        super().shutdown(timeout_s)
        if self.given_back is not None:
            self.given_back()

    def use_loss(self, name: str, params: dict[str, float]) -> None:
        self.group._on(self, lambda: self.group.workers.use_loss(name, params))

    def forward_backward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        return self.group._on(self, lambda: self.group.workers.forward_backward(data))

    def forward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        return self.group._on(self, lambda: self.group.workers.forward(data))

    def optimizer_step(self, params: dict[str, Any]) -> tuple[float, list[list[dict[str, Any]]]]:
        return self.group._on(self, lambda: self.group.workers.optimizer_step(params))

    def save_state(self, folder: Path, step: int) -> None:
        self.save_checkpoint(folder, step)

    def load_state(self, folder: Path, optimizer: bool) -> None:
        self.group._on(self, lambda: self.group.workers.load_state(folder, optimizer))


def start_served_ray(ray_address: str | None, device: str) -> None:
    """Ray for the server, from its main thread before it listens: a new local cluster or the one named.

    A new local cluster when `ray_address` is None. The worker groups join it (none owns it); stop_served_ray ends it
    when the server stops."""
    from tinker_exp.runtime.ray_cluster import start_ray
    from tinker_exp.runtime.workers import platform_env, use_platform

    use_platform(device)
    start_ray(ray_address, platform_env(device))


def stop_served_ray() -> None:
    """The daemons and agents the server's Ray started stop with it (a cluster it joined: disconnected)."""
    import ray

    ray.shutdown()


def vocabulary_size(model_path: Path) -> int:
    """The model's embedding rows: token ids at or beyond it are refused before they reach a worker."""
    return _model_setting(model_path, "vocab_size")


def model_positions(model_path: Path) -> int:
    """The model's positions (max_position_embeddings): a longer sequence is refused before it reaches a worker."""
    return _model_setting(model_path, "max_position_embeddings")


def _model_setting(model_path: Path, name: str) -> int:
    """An integer of the model's config.json (transformers' AutoConfig where the file does not say)."""
    import json

    config = Path(model_path) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get(name)
        if isinstance(value, int):
            return value
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), name))
