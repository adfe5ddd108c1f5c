"""The SDK's wire format <-> what the workers take, with the SDK's own protobuf module (tinker/proto, SDK 0.38).

Every bad input is a ``BadRequest``: one line naming the field as the SDK sends it, the value and what is wrong.
"""

from __future__ import annotations

from typing import Any, Sequence

from tinker_exp.runtime.serve_workers import CROSS_ENTROPY, LOSS_SUM, Datum

LOSS_INPUTS = {
    CROSS_ENTROPY: ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
}
"""The loss functions forward_backward takes, each with the loss_fn_inputs it needs (Tinker's names). The RL losses
take `weights` too, optionally: a position of weight 0 adds nothing (a prompt's positions); none sent: every one 1.
gspo's `sequence_ratio_mask` (the positions its sequence ratio is taken over) is its weights: with both sent, their
zeros must agree. stable_reinforce's provenance spans (the sampled sequences' ids) are not read: our
stable_reinforce needs only the datum's `logprobs` (docs/rl-losses.md)."""


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


def forward_backward_request(body: bytes) -> Any:
    """A ForwardBackwardRequest's bytes -> the message (its model_id and seq_id say where it belongs)."""
    pb = proto_module()
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise BadRequest(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from None
    return request


def check_vocabulary(tokens: Sequence[int], vocab_size: int | None, field: str) -> None:
    """Every token id in [0, vocab_size): one outside would fail in a worker's embedding (an IndexError)."""
    if vocab_size is None or not len(tokens):
        return
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= vocab_size:
        raise BadRequest(f"{field}: token id {low if low < 0 else high} is not in the vocabulary (ids 0 .. "
                         f"{vocab_size - 1}: the model's vocab_size is {vocab_size})")


def forward_backward_data(request: Any, vocab_size: int | None = None) -> list[Datum]:
    """A ForwardBackwardRequest's data as the workers take them, every input checked.

    Token ids are checked against `vocab_size`."""
    import numpy as np

    if request.loss_fn not in LOSS_INPUTS:
        raise BadRequest(f"loss_fn: {request.loss_fn!r} is not served (served: {', '.join(LOSS_INPUTS)})")
    needs = LOSS_INPUTS[request.loss_fn]
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
        missing = [name for name in needs if name not in datum.loss_fn_inputs]
        if missing:
            raise BadRequest(f"{where}.loss_fn_inputs: {missing[0]} is missing ({request.loss_fn} takes {', '.join(needs)})")
        inputs = {name: _array(datum.loss_fn_inputs[name], f"{where}.loss_fn_inputs.{name}")
                  for name in (*needs, "weights") if name in datum.loss_fn_inputs}
        if "sequence_ratio_mask" in inputs:
            ratio_mask = inputs.pop("sequence_ratio_mask")
            if "weights" in inputs and not np.array_equal(inputs["weights"] != 0, ratio_mask != 0):
                raise BadRequest(f"{where}.loss_fn_inputs.sequence_ratio_mask: its zeros differ from weights' (gspo "
                                 "takes the ratio over the positions the loss counts)")
            inputs["weights"] = ratio_mask
        inputs.setdefault("weights", np.ones(len(tokens), dtype=np.float32))
        targets = inputs.pop("target_tokens").tolist()
        check_vocabulary(tokens, vocab_size, f"{where}.model_input")
        check_vocabulary(targets, vocab_size, f"{where}.loss_fn_inputs.target_tokens")
        lengths = ", ".join(f"{name} {len(values)}" for name, values in inputs.items())
        if not tokens or len(targets) != len(tokens) or any(len(values) != len(tokens) for values in inputs.values()):
            raise BadRequest(f"{where}: model_input has {len(tokens)} tokens, target_tokens {len(targets)}, {lengths}: "
                             "need the same length, at least 1")
        if targets[:-1] != tokens[1:]:
            raise BadRequest(f"{where}.loss_fn_inputs.target_tokens: must be model_input shifted by one (each position "
                             "predicts the next input token)")
        for name, values in inputs.items():
            if not np.isfinite(values).all():
                raise BadRequest(f"{where}.loss_fn_inputs.{name}: not finite")
        shifted = {name: [0.0, *values.astype(np.float32).tolist()] for name, values in inputs.items()}
        data.append(Datum(tokens + [targets[-1]], shifted["weights"], shifted.get("logprobs"), shifted.get("advantages")))
    return data


def loss_params(request: Any) -> dict[str, float]:
    """The RL loss's parameters from loss_fn_config, checked and with Tinker's defaults filled in (as loss.* are).

    cross_entropy takes none."""
    from tinker_exp.config.rl import LossConfig, LossName
    from tinker_exp.errors import ConfigError

    # the SDK writes every value to loss_fn_config_v2 (numbers to the legacy map too); v2 wins, as Tinker reads it
    given = ({key: getattr(value, value.WhichOneof("value") or "number") for key, value in request.loss_fn_config_v2.items()}
             or dict(request.loss_fn_config))
    if request.loss_fn == CROSS_ENTROPY:
        if given:
            raise BadRequest(f"loss_fn_config.{sorted(given)[0]}: cross_entropy takes no parameters")
        return {}
    known = {name for name in LossConfig.__dataclass_fields__ if name != "name"}
    for key in sorted(set(given) - known):
        raise BadRequest(f"loss_fn_config.{key}: not a parameter of {request.loss_fn}")
    for key, value in sorted(given.items()):
        if not isinstance(value, float):
            raise BadRequest(f"loss_fn_config.{key}: {value!r} is not a number")
    try:
        return LossConfig(LossName(request.loss_fn), **given).params
    except ConfigError as e:
        raise BadRequest(str(e).replace("loss.", "loss_fn_config.")) from None


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


def sample_response(samples: Sequence[Any], prompt_logprobs: Sequence[float] | None = None) -> bytes:
    """The SampleResponse protobuf of `samples`, with the prompt's log-probs when asked for.

    Each sequence's tokens (int32), their log-probs (float32) and stop_reason (stop when it ended at a stop, else
    length); the prompt's log-probs (float32, NaN first) when asked for."""
    import numpy as np

    pb = proto_module()
    response = pb.SampleResponse()
    for sample in samples:
        sequence = response.sequences.add()
        sequence.stop_reason = pb.STOP_REASON_STOP if sample.stopped else pb.STOP_REASON_LENGTH
        sequence.tokens = np.asarray(list(sample.response_ids), dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(sample.log_probs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return response.SerializeToString()


def sampling_limits(params: dict) -> dict[str, Any]:
    """SamplingParams' stop, top_k and top_p as HFSampler.sample takes them (runtime/sampler.py), each checked."""
    top_k, top_p, stop = params.get("top_k", -1), params.get("top_p", 1.0), params.get("stop")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise BadRequest(f"sampling_params.top_k: {top_k!r} is not a limit (an integer >= 1, or -1: none)")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise BadRequest(f"sampling_params.top_p: {top_p!r} is not in (0, 1]")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and (
            all(isinstance(s, str) and s for s in stop)
            or all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stop))):
        raise BadRequest(f"sampling_params.stop: {stop!r} is not stop strings or stop token ids")
    return {"stop": stop, "top_k": max(top_k, 0), "top_p": float(top_p)}


def prompt_tokens(prompt: Any, field: str = "prompt", vocab_size: int | None = None) -> list[int]:
    """A ModelInput in JSON -> its tokens, each checked to be in the vocabulary.

    The JSON: {"chunks": [{"type": "encoded_text", "tokens": [...]}]}."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise BadRequest(f"{field}.chunks: missing or empty (a ModelInput of encoded text)")
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest(f"{field}.chunks[{j}]: only encoded text is served")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise BadRequest(f"{field}.chunks[{j}].tokens: not a list of token ids")
        check_vocabulary(ids, vocab_size, f"{field}.chunks[{j}].tokens")
        tokens += ids
    if not tokens:
        raise BadRequest(f"{field}: no token")
    return tokens
