"""The SDK's wire format <-> what the workers take, with the SDK's own protobuf module (tinker/proto, SDK 0.38).

Every bad input is a ``BadRequest``: one line naming the field as the SDK sends it, the value and what is wrong.
"""

from __future__ import annotations

from typing import Any, Sequence

from tinker_exp.runtime.serve_workers import LOSS_SUM, Datum

SUPPORTED_LOSSES = ("cross_entropy",)
"""The loss functions forward_backward takes today."""


class BadRequest(ValueError):
    """A request the server refuses: HTTP 400 with this one line; nothing is changed."""


def proto_module():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _array(tensor: Any, field: str):
    import numpy as np

    pb = proto_module()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if tensor.dtype not in dtypes:
        raise BadRequest(f"{field}: dtype {tensor.dtype} is not float32, int64 or int32")
    if tensor.WhichOneof("encoding") != "dense":
        raise BadRequest(f"{field}: only dense tensors are served")
    return np.frombuffer(tensor.dense, dtype=dtypes[tensor.dtype])


def forward_backward_request(body: bytes) -> tuple[Any, list[Datum]]:
    """A ForwardBackwardRequest's bytes -> (the message, its data as the workers take them)."""
    import numpy as np

    pb = proto_module()
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise BadRequest(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from None
    if request.loss_fn not in SUPPORTED_LOSSES:
        raise BadRequest(f"loss_fn: {request.loss_fn!r} is not served (served: {', '.join(SUPPORTED_LOSSES)})")
    if not request.data:
        raise BadRequest("data: no datum")
    data = []
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        tokens = []
        for j, chunk in enumerate(datum.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadRequest(f"{where}.model_input.chunks[{j}]: only encoded text is served")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        missing = [name for name in ("target_tokens", "weights") if name not in datum.loss_fn_inputs]
        if missing:
            raise BadRequest(f"{where}.loss_fn_inputs: {missing[0]} is missing (cross_entropy takes target_tokens, weights)")
        targets = _array(datum.loss_fn_inputs["target_tokens"], f"{where}.loss_fn_inputs.target_tokens").tolist()
        weights = _array(datum.loss_fn_inputs["weights"], f"{where}.loss_fn_inputs.weights").astype(np.float32)
        if not tokens or len(targets) != len(tokens) or len(weights) != len(tokens):
            raise BadRequest(f"{where}: model_input has {len(tokens)} tokens, target_tokens {len(targets)}, weights "
                             f"{len(weights)}: need the same length, at least 1")
        if targets[:-1] != tokens[1:]:
            raise BadRequest(f"{where}.loss_fn_inputs.target_tokens: must be model_input shifted by one (each position "
                             "predicts the next input token)")
        if not np.isfinite(weights).all():
            raise BadRequest(f"{where}.loss_fn_inputs.weights: not finite")
        data.append(Datum(tokens + [targets[-1]], [0.0, *weights.tolist()]))
    return request, data


def forward_backward_output(loss: float, logprobs: Sequence[Sequence[float]]) -> bytes:
    """The ForwardBackwardOutput protobuf: loss:sum, and each datum's target log-probs as one float32 record."""
    import numpy as np

    pb = proto_module()
    output = pb.ForwardBackwardOutput()
    output.metrics[LOSS_SUM] = loss
    output.loss_fn_output_type = "ArrayRecord"
    record = output.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [np.asarray(row, dtype=np.float32) for row in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64).tobytes()
    return output.SerializeToString()
