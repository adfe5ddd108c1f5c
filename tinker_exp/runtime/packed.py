"""A packed step of several LoRA slots (runtime/slots.py) on one rank: their rows through the base model together.

The driver sends one batch whose rows are, rank after rank, slot after slot, exactly the rows each slot's batch gives
that rank alone (verl chunks a batch into dp contiguous chunks), with a `slot` column. On each rank
`forward_backward`:

1. splits its rows back per slot and micro-batches each slot's rows with verl's own `prepare_micro_batches`, as
   that slot's step alone would (its settings, its dp collectives); the packed micro-batch j is every slot's j-th
   micro-batch, one after the other, so each slot's gradient accumulates over the same micro-batches in the same
   order as alone;
2. gathers every slot's full adapter tensors from their shards in one collective (`gather_adapters`) and runs the
   engine's own `forward_step` on each packed micro-batch with every peft `lora.Linear` mixed (`mixed_adapters`): the
   frozen base layer once for all tokens, each slot's tokens through its own adapter. The loss is the sum over
   slots of the installed loss (verl's sft_loss, or the Tinker server's cross_entropy: runtime/serve_workers.py) on
   that slot's tokens with that slot's own global token count, so each slot's gradient is its own run's (and, for
   the server, each slot's rows' log-probs are split back out of the packed output);
3. reduces every slot's adapter gradients over dp as FSDP2 does (AVG, one collective for all slots) and leaves each
   rank's shard as that slot's pending gradients (`SlotState.grads`), which its optimizer step takes on load.

Exactness: each slot's loss sees its tokens, its token count and, at its last token, the label its micro-batch alone
gives there (`roll_within`); what differs from alone is only the size of the matrix products (all slots' tokens at
once). Where rows cannot be mixed, `refusal` says why and the group time-shares (docs/slots.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

ADAPTER = "default"
"""The peft adapter name verl's engine builds (the only one)."""
SLOT = "slot"
"""The packed batch's column: which slot's trial a row is (its index in the group)."""


def refusal(engine: Any, loss_fn: Any, padding_free: bool, per_token: Sequence[Any] = ()) -> str | None:
    """Why this rank's slots cannot be packed, or None when they can.

    They cannot when a row's output would depend on which rows share its micro-batch, or its loss is not a per-token
    sum. `padding_free`: the worker's layout (verl's use_remove_padding); `per_token`: the worker's own losses that are
    per-token sums of a micro-batch alone, besides verl's sft_loss (the Tinker server's cross_entropy)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear
    from verl.workers.utils.losses import sft_loss

    loss = getattr(loss_fn, "func", loss_fn)  # verl's losses are set as partials
    if loss is not sft_loss and loss not in per_token:
        return (f"the loss is {getattr(loss, '__qualname__', loss)}, not SFT's or Tinker's cross_entropy (a packed loss "
                "sums a per-token loss per slot)")
    if not padding_free:
        return "the padded layout (backend.padding_free=false; packing is built and tested padding-free, the CPU's default)"
    if engine.ulysses_sequence_parallel_size > 1:
        return f"sequence parallel {engine.ulysses_sequence_parallel_size} (a micro-batch's tokens are split over ranks)"
    if getattr(engine, "pad_to_length", False):
        return "pad_to_length (a static pad after the packed tokens)"
    for name, module in engine.module.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            return f"{name} is a LoRA {type(module).__name__} (only Linear layers mix adapters)"
        if module.lora_variant:
            return f"{name} is a LoRA variant ({type(module.lora_variant[ADAPTER]).__name__}: DoRA)"
        if not isinstance(module.lora_dropout[ADAPTER], torch.nn.Identity):
            return f"{name} has LoRA dropout (its RNG draws depend on the rows beside)"
    return None


@dataclass
class Segment:
    """One slot's part of a packed micro-batch."""

    slot: int
    """The slot's position in the packed step (its adapters' index)."""
    rows: tuple[int, int]
    """Its rows [start, end) of the packed micro-batch."""
    tokens: tuple[int, int]
    """Its tokens [start, end) of the micro-batch's flattened (padding-free) tokens."""
    micro_batch: Any
    """Its own micro-batch (the TensorDict its step alone would run): its loss mask and loss settings."""


def lora_layers(module: Any, trained: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """Every peft lora.Linear of `module` with the indexes of its A and B weights in `trained` (the slots' order)."""
    from peft.tuners.lora import Linear as LoraLinear

    index = {id(p): i for i, p in enumerate(trained)}
    return [
        (layer, index[id(layer.lora_A[ADAPTER].weight)], index[id(layer.lora_B[ADAPTER].weight)])
        for layer in module.modules()
        if isinstance(layer, LoraLinear)
    ]


def shard_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of dim 0 that rank `rank` of `size` holds (FSDP2 shards as torch.chunk does)."""
    chunk = -(-rows // size)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


def gather_adapters(shards: Sequence[Sequence[Any]], group: Any, grad: bool = True) -> list[list[torch.Tensor]]:
    """Every slot's full adapter tensors from its DTensor shards, in one all-gather for all of them.

    Leaves that require grad, with `grad`; `shards[k]`: slot k's, in the module's order. Each shard is padded to its
    largest rank's rows."""
    size = dist.get_world_size(group)
    flat = []
    for tensors in shards:
        for tensor in tensors:
            local = tensor.to_local()
            padded = torch.zeros((-(-tensor.shape[0] // size), *tensor.shape[1:]), dtype=local.dtype, device=local.device)
            padded[: local.shape[0]] = local
            flat.append(padded.reshape(-1))
    mine = torch.cat(flat)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    full, offset = [], 0
    for tensors in shards:
        slot = []
        for tensor in tensors:
            chunk = -(-tensor.shape[0] // size)
            numel = chunk * tensor.shape[1:].numel()
            parts = []
            for r in range(size):
                start, end = shard_rows(tensor.shape[0], size, r)
                parts.append(every[r][offset : offset + numel].view(chunk, *tensor.shape[1:])[: end - start])
            offset += numel
            slot.append(torch.cat(parts).requires_grad_(grad))
        full.append(slot)
    return full


def reduce_gradients(full: Sequence[Sequence[torch.Tensor]], like: Sequence[Any], group: Any) -> list[list[Any]]:
    """Every slot's adapter gradients averaged over dp, in one all-reduce for all slots.

    FSDP2's reduction: verl's loss carries the dp factor. Returns this rank's shards as DTensors laid out as the
    parameters `like`."""
    from torch.distributed.tensor import DTensor

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for slot in full for t in slot]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    shards, offset = [], 0
    for slot in full:
        mine = []
        for tensor, param in zip(slot, like, strict=True):
            reduced = flat[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
            start, end = shard_rows(tensor.shape[0], size, rank)
            local = reduced[start:end].clone()
            mine.append(DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()))
        shards.append(mine)
    return shards


@contextmanager
def mixed_adapters(layers: Sequence[tuple[Any, int, int]], adapters: Sequence[Sequence[torch.Tensor]], where: dict) -> Iterator[None]:
    """Within, every lora.Linear of `layers` runs each segment of rows through its own slot's adapters.

    Each computes its base layer once for all tokens, then each segment of `where["segments"]` (set per micro-batch)
    through its own slot's adapters: lora_B(lora_A(x)) * scaling, as peft's forward adds it, the pieces joined with
    torch.cat. `where["padding_free"]`: tokens along dim 1 (1, T, H), else rows along dim 0."""

    def forward_of(layer: Any, a: int, b: int):
        scaling = layer.scaling[ADAPTER]

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = layer.base_layer(x, *args, **kwargs)
            dtype = result.dtype
            dim = 1 if where["padding_free"] else 0
            pieces, end = [], 0
            for segment in where["segments"]:
                start, end = segment.tokens if where["padding_free"] else segment.rows
                weights = adapters[segment.slot]
                part = layer._cast_input_dtype(x.narrow(dim, start, end - start), weights[a].dtype)
                pieces.append(result.narrow(dim, start, end - start) + F.linear(F.linear(part, weights[a]), weights[b]) * scaling)
            assert end == x.shape[dim], f"the slots' segments cover {end} of {x.shape[dim]}"
            return torch.cat(pieces, dim).to(dtype)

        return forward

    for layer, a, b in layers:
        layer.forward = forward_of(layer, a, b)  # the instance's, over peft's class method
    try:
        yield
    finally:
        for layer, _, _ in layers:
            del layer.forward


def roll_within(rolled: torch.Tensor, input_ids: torch.Tensor, segments: Sequence[Segment]) -> None:
    """Set verl's labels as each slot's micro-batch alone has them.

    verl's labels are its input ids rolled by one over the micro-batch's flattened tokens: a slot's last token is
    labelled with its own micro-batch's first token (where alone the roll wraps), not the next slot's."""
    flat = input_ids.values() if input_ids.is_nested else input_ids.reshape(-1)
    for segment in segments:
        start, end = segment.tokens
        rolled[end - 1] = flat[start]


def forward_backward(worker: Any, engine: Any, loss_fn: Any, shards_of: dict[int, Sequence[Any]], trained: Sequence[Any], data: Any,
                     forward_only: bool = False, log_probs: bool = False) -> dict[int, tuple[list[Any] | None, float, Any]]:  # fmt: skip
    """The packed forward and backward of this rank's rows `data`, slot after slot.

    Its `SLOT` column says whose each row is. Returns slot index -> its gradients (its shards, laid out as the
    parameters `trained`), its `loss` metric (verl's: the sum of its micro-batches' losses, averaged over dp) and, with
    `log_probs`, its rows' token log-probs in its rows' order (a nested tensor, what verl's forward_backward returns a
    client: the Tinker server's), else None. `shards_of`: each slot's adapter shards; `worker`: verl's
    TinkerTrainingWorker (the batch keys its forward_backward sets). `forward_only`: verl's infer_batch instead (an
    evaluation: eval mode, its micro-batch settings, no gradient; None for each slot's gradients)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id
    from verl.utils.seqlen_balancing import restore_dynamic_batch
    from verl.workers.engine.utils import prepare_micro_batches

    group = engine.get_data_parallel_group()
    dp_size = engine.get_data_parallel_size()
    config = worker.engine_config
    defaults = dict(
        use_remove_padding=worker.model_config.get("use_remove_padding", False),
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len_per_gpu=config.infer_max_token_len_per_gpu if forward_only else config.max_token_len_per_gpu,
        micro_batch_size_per_gpu=config.infer_micro_batch_size_per_gpu if forward_only else config.micro_batch_size_per_gpu,
        use_fused_kernels=config.use_fused_kernels,
    )
    for key, value in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: value})
    tu.assign_non_tensor(data, sp_size=engine.ulysses_sequence_parallel_size, dp_size=dp_size)
    tu.maybe_fix_3d_position_ids(data)

    slots = data.pop(SLOT).tolist()
    order = list(dict.fromkeys(slots))  # the same on every rank: each rank's rows are slot after slot
    per_slot = []
    for index in order:
        rows = [i for i, s in enumerate(slots) if s == index]
        assert rows == list(range(rows[0], rows[-1] + 1)), f"slot {index}'s rows are not one run: {slots}"
        per_slot.append(tu.index_select_tensor_dict(data, rows))
    tokens = torch.stack([d["loss_mask"].sum() for d in per_slot]).to(get_device_id())
    dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=group)  # each slot's global token count, as alone
    micro_batches, arranged = [], []  # each slot's micro-batches, and verl's arrangement of its rows (dynamic: reordered)
    for slot_data, count in zip(per_slot, tokens.tolist(), strict=True):
        tu.assign_non_tensor(slot_data, batch_num_tokens=count)
        batches, indices = prepare_micro_batches(data=slot_data, dp_group=group, same_micro_num_in_dp=True)
        micro_batches.append(batches)
        arranged.append(indices)

    adapters = gather_adapters([shards_of[index] for index in order], group, grad=not forward_only)
    layers = lora_layers(engine.module, trained)
    # what the mixed LoRA layers and the packed loss read of the micro-batch under way (its segments: set per micro-batch)
    where: dict[str, Any] = {"padding_free": tu.get_non_tensor_data(data, "use_remove_padding", True)}
    losses: list[list[float]] = [[] for _ in order]
    outputs: list[list[torch.Tensor]] = [[] for _ in order]  # with log_probs: each slot's rows' log-probs, micro-batch after micro-batch

    def packed_loss(model_output: dict, data: Any, dp_group: Any = None):
        """The sum over slots of verl's loss on each slot's tokens (its own token count and micro-batch)."""
        log_probs = model_output["log_probs"]
        values, offsets = log_probs.values(), log_probs.offsets()
        total = None
        for segment in where["segments"]:
            (row_start, row_end), (start, end) = segment.rows, segment.tokens
            own = torch.nested.nested_tensor_from_jagged(values[start:end], offsets[row_start : row_end + 1] - offsets[row_start])
            loss, _ = loss_fn(model_output={"log_probs": own}, data=segment.micro_batch, dp_group=dp_group)
            losses[segment.slot].append(loss.detach().item())
            total = loss if total is None else total + loss
        return total, {}

    prepare = engine.prepare_model_inputs

    def prepare_inputs(micro_batch: Any):
        inputs, args = prepare(micro_batch=micro_batch)
        roll_within(args["input_ids_rmpad_rolled"], micro_batch["input_ids"], where["segments"])
        return inputs, args

    engine.prepare_model_inputs = prepare_inputs  # the instance's, over the class's, for this call
    mode = engine.eval_mode() if forward_only else engine.train_mode(zero_grad_on_exit=False)
    try:
        with mode, torch.set_grad_enabled(not forward_only), mixed_adapters(layers, adapters, where):
            for j in range(max(len(m) for m in micro_batches)):
                parts = [(k, m[j]) for k, m in enumerate(micro_batches) if j < len(m)]
                segments, row, token = [], 0, 0
                for k, part in parts:
                    count = int(part["loss_mask"].offsets()[-1]) if part["loss_mask"].is_nested else part["loss_mask"].numel()
                    segments.append(Segment(k, (row, row + len(part)), (token, token + count), part))
                    row, token = row + len(part), token + count
                packed = tu.concat_tensordict([part for _, part in parts])
                tu.assign_non_tensor(packed, batch_num_tokens=None)  # each slot's own is its micro-batch's (packed_loss)
                where["segments"] = segments
                loss, output = engine.forward_step(packed, loss_function=packed_loss, forward_only=forward_only)
                if not forward_only:
                    loss.backward()
                if log_probs:
                    rows = output["model_output"]["log_probs"].unbind()
                    for segment in segments:
                        outputs[segment.slot] += rows[segment.rows[0] : segment.rows[1]]
    finally:
        del engine.prepare_model_inputs
    sums = torch.stack([torch.sum(torch.tensor(each, device=get_device_id())) for each in losses])
    dist.all_reduce(sums, op=dist.ReduceOp.AVG, group=group)  # verl's _postprocess_output, per slot
    grads = [None] * len(order) if forward_only else reduce_gradients(adapters, trained, group)
    rows_of = [None] * len(order)
    if log_probs:  # as verl's postprocess_batch_func returns them: in the rows' order, dynamic micro-batches undone
        rows_of = [torch.nested.as_nested_tensor(rows, layout=torch.jagged) for rows in outputs]
        rows_of = [each if indices is None else restore_dynamic_batch(each, indices) for each, indices in zip(rows_of, arranged, strict=True)]
    return dict(zip(order, zip(grads, sums.tolist(), rows_of)))
