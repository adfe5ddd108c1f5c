"""The served model's workers: verl's Tinker worker with Tinker's cross_entropy, per-datum log-probs sent back.

Tinker's cross_entropy is ``sum(-logprob(target_tokens[i]) * weights[i])`` over every datum, with no normalisation;
verl's FSDP averages the gradients over the data-parallel ranks, so each micro batch returns its own sum times
``dp_size`` (as runtime/rl_losses.py does): one ``forward_backward`` leaves the gradient of the batch's sum, and
chunks sent one after the other accumulate into the gradient of their union until ``optim_step``.

verl's model output is the log-prob of each next input token, so a datum is its ``model_input`` plus the last target
token, and ``target_tokens`` must be ``model_input`` shifted by one (what the SDK's helpers build); anything else is
refused (tinker_exp/serve/wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tinker_exp.runtime.workers import TinkerWorkers, _worker_class

LOSS_SUM = "loss:sum"
"""The metric the SDK pops from every forward_backward: the loss, summed."""


@dataclass(frozen=True)
class Datum:
    """One datum as the workers take it: the sequence (model_input + the last target) and each position's weight
    (weights[j]: the weight of predicting tokens[j]; 0 at j = 0)."""

    tokens: list[int]
    weights: list[float]


def cross_entropy_loss(model_output, data, dp_group=None):
    """verl's loss signature: this micro batch's Tinker cross_entropy sum, times dp_size; the sum as a metric."""
    import torch
    from verl.utils.metric import AggregationType, Metric

    log_prob = model_output["log_probs"].values()
    weights = torch.roll(data["weights"].values(), shifts=-1, dims=0)  # weights[j] -> the log-prob at j - 1
    loss = -(log_prob * weights.to(log_prob.dtype)).sum() * data["dp_size"]
    return loss, {"serve/loss_sum": Metric(AggregationType.SUM, loss.detach())}


def _serve_worker_class():
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    base = _worker_class()

    class ServeWorker(base):
        """Our worker, sending back every token's log-prob with the metrics (the SDK hands them to its client)."""

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
        def forward_backward(self, data):
            output = TinkerTrainingWorker.forward_backward(self, data)
            if output is None:
                return None
            log_probs = output["log_probs"]
            return tu.get_tensordict(tensor_dict={"log_probs": log_probs},
                                     non_tensor_dict={"metrics": output.get_non_tensor("metrics")})

    return ServeWorker


class ServeWorkers(TinkerWorkers):
    """The served model's worker group: Tinker's cross_entropy, and forward_backward/optimizer_step as two calls."""

    def __init__(self, backend: Any, *args: Any, **kwargs: Any):
        self.pad_to = backend.num_workers * backend.nodes * backend.micro_batch_size  # verl: whole micro batches per rank
        super().__init__(backend, *args, **kwargs)

    def worker_class(self) -> type:
        return _serve_worker_class()

    def _build_model(self) -> list:
        return [*self.group.execute_all_async("reset"), *self.group.execute_all_async("set_loss_fn", cross_entropy_loss)]

    def forward_backward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        """The batch's summed loss and each datum's target log-probs (len(model_input) of them); the gradient
        accumulates until optimizer_step."""
        return self._pass("forward_backward", data)

    def forward(self, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        """As forward_backward, without gradients: verl's infer_batch (eval mode, no_grad)."""
        return self._pass("infer_batch", data)

    def _pass(self, method: str, data: Sequence[Datum]) -> tuple[float, list[list[float]]]:
        """Padded with zero-weight copies of the first datum to whole micro batches on every rank (verl splits a
        batch evenly and asserts whole micro batches): a zero weight adds exactly nothing to the gradient."""
        padded = list(data) + [Datum(data[0].tokens, [0.0] * len(data[0].tokens))] * (-len(data) % self.pad_to)
        output = getattr(self.group, method)(self._datum_batch(padded)).get()
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
