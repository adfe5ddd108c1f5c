"""`python -m tinker_exp.serve` driven by the unmodified tinker SDK (0.38, a test extra) through TINKER_BASE_URL and a
tml- key: one server for the module (a subprocess on the shared Ray cluster, 2 CPU workers, the tiny model).

A supervised loop whose AdamParams change every step (lr, betas, eps, weight_decay, grad_clip_norm): the loss falls,
each step's values are what the workers applied (metrics.jsonl), the per-datum log-probs sum to loss:sum; then bad
requests, each an HTTP 400 of one line naming the field, after which the server still serves and its rows are intact.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, environment, read_jsonl

tinker = pytest.importorskip("tinker")  # the test extra: pip install -e .[test]

API_KEY = "tml-serve-test"
TEXTS = ["The cat sat on the mat.", "Add 2 and 3: 5.", "Spell dog: d-o-g.", "Red and blue make purple."]
# One step's AdamParams each: every field changes, grad_clip_norm from none (0) to a clip that acts (0.05) and back.
STEPS = [
    dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
    dict(learning_rate=8e-3, beta1=0.85, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.05),
    dict(learning_rate=6e-3, beta1=0.8, beta2=0.999, eps=1e-10, weight_decay=0.1, grad_clip_norm=1.0),
    dict(learning_rate=4e-3, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_address, tmp_path_factory):
    """The server, started as a user starts it; its first line (printed once it listens) says where."""
    run_dir = tmp_path_factory.mktemp("serve")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tinker_exp.serve", f"serve.port={port}", f"serve.run_dir={run_dir}", "logger=none"],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = process.stdout.readline()  # blocks until it listens (or exits)
    assert "serving" in line, (line, process.poll(), process.stderr.read() if process.poll() is not None else "")
    yield {"url": f"http://127.0.0.1:{port}", "run_dir": Path(run_dir), "process": process}
    process.terminate()
    process.wait(60)


@pytest.fixture(scope="module")
def tokenized():
    from transformers import AutoTokenizer

    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir(ModelConfig()))
    return [tokenizer.encode(text) for text in TEXTS]


def datum(tokens: list[int]):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="module")
def trained(server, tokenized):
    """The SDK's supervised loop: forward_backward (cross_entropy) then optim_step with this step's AdamParams."""
    from tinker import types

    os.environ.update(TINKER_BASE_URL=server["url"], TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0")
    service = tinker.ServiceClient()
    capabilities = tinker.RestClient().get_server_capabilities().result()
    client = service.create_lora_training_client(base_model="tiny-llama", rank=8).result()
    data = [datum(tokens) for tokens in tokenized]
    outputs, responses = [], []
    for params in STEPS:
        outputs.append(client.forward_backward(data, "cross_entropy").result())
        responses.append(client.optim_step(types.AdamParams(**params)).result())
    yield {"capabilities": capabilities, "client": client, "outputs": outputs, "responses": responses, "data": data,
           "rows": read_jsonl(server["run_dir"] / "metrics.jsonl"), "service": service}
    service.close("success").result(timeout=60)  # as a user's loop ends: no heartbeat outlives the module


def test_a_closed_session_is_finished_and_its_heartbeats_refused(server, trained):
    """The route behind the SDK's ServiceClient.close(status) (the `trained` loop closes its own at teardown): the
    session ends, its heartbeats get 410, a second finish is refused in one line."""
    session_id = post(server, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
    assert post(server, "session_heartbeat", {"session_id": session_id}).status_code == 200
    assert post(server, f"sessions/{session_id}/finish", {"reason": {"type": "success"}, "detail": None}).status_code == 200
    assert post(server, "session_heartbeat", {"session_id": session_id}).status_code == 410
    finished_again = post(server, f"sessions/{session_id}/finish", {"reason": {"type": "success"}, "detail": None})
    assert finished_again.status_code == 404 and finished_again.json()["error"] == f"session_id: {session_id!r} is not a session of this server"


def test_capabilities_and_model_info(trained):
    assert [m.model_name for m in trained["capabilities"].supported_models] == ["tiny-llama"]
    info = trained["client"].get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == "tiny-llama"
    assert info.model_id.endswith(":train:0")  # the SDK's own scheme: session_id:train:model_seq_id


def test_supervised_loop_loss_falls_and_logprobs_sum_to_the_loss(trained):
    losses = [output.metrics["loss:sum"] for output in trained["outputs"]]
    assert losses[-1] < losses[0], losses
    for output in trained["outputs"]:
        logprobs = [lp.to_numpy() for lp in (o["logprobs"] for o in output.loss_fn_outputs)]
        assert [len(lp) for lp in logprobs] == [len(d.model_input.to_ints()) for d in trained["data"]]
        assert abs(-sum(float(lp.sum()) for lp in logprobs) - output.metrics["loss:sum"]) < 1e-3 * abs(output.metrics["loss:sum"])


def test_every_adam_param_is_applied_at_its_step(trained):
    """Each step's AdamParams, grad_clip_norm included, as requested and as every rank's groups (and the engine's
    clip) held them; the loss of the step is the forward_backward's loss:sum; the response carries grad_norm."""
    rows = trained["rows"]
    assert [row["train/step"] for row in rows] == list(range(len(STEPS)))
    for row, params, output, response in zip(rows, STEPS, trained["outputs"], trained["responses"]):
        want = {"lr": params["learning_rate"], "beta1": params["beta1"], "beta2": params["beta2"], "eps": params["eps"],
                "weight_decay": params["weight_decay"], "grad_clip_norm": params["grad_clip_norm"]}
        assert {key: row[f"requested/{key}"] for key in want} == want == {key: row[f"applied/{key}"] for key in want}
        assert row["train/loss"] == output.metrics["loss:sum"]
        assert response.metrics["grad_norm"] == row["train/grad_norm"] > 0


def post(server, route: str, body: bytes | dict, content_type: str = "application/json"):
    import httpx

    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(f"{server['url']}/api/v1/{route}", content=data, timeout=60,
                      headers={"X-API-Key": API_KEY, "Content-Type": content_type})


def test_bad_requests_are_one_line_http_errors_and_the_server_goes_on(server, trained, tokenized):
    model_id = trained["client"].get_info().model_id
    adam = dict(STEPS[0])
    cases = [
        ("forward_backward", b"\xff\xff not protobuf", "application/x-protobuf", "forward_backward: the body is not a ForwardBackwardRequest protobuf"),
        ("optim_step", b"{not json", "application/json", "/api/v1/optim_step: the body is not JSON"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "beta1": 1.0}}, None, "adam_params.beta1: 1.0 is not in [0, 1)"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "learning_rate": -1.0}}, None, "adam_params.learning_rate: must be >= 0, got -1.0"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "grad_clip_norm": -1.0}}, None, "adam_params.grad_clip_norm: must be >= 0, got -1.0"),
        ("optim_step", {"model_id": "nope:train:0", "adam_params": adam}, None, "model_id: 'nope:train:0' is not served here"),
        ("create_model", {"session_id": "s", "model_seq_id": 1, "base_model": "tiny-llama", "lora_config": {"rank": 8}}, None,
         f"create_model: this server already serves model {model_id}; one client at a time may hold a model"),
        ("create_model", {"base_model": "Qwen/Qwen3-8B"}, None, "base_model: 'Qwen/Qwen3-8B' is not served (this server serves 'tiny-llama')"),
    ]
    for route, body, content_type, message in cases:
        response = post(server, route, body, content_type or "application/json")
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error.startswith(message) and "\n" not in error, (route, error)
    from tinker import types

    unknown_loss = trained["client"].forward_backward(trained["data"], "nope")
    with pytest.raises(Exception, match="loss_fn: 'nope' is not served"):
        unknown_loss.result()
    rows_before = (server["run_dir"] / "metrics.jsonl").read_text()
    output = trained["client"].forward_backward(trained["data"], "cross_entropy").result()
    trained["client"].optim_step(types.AdamParams(**STEPS[-1])).result()
    rows = read_jsonl(server["run_dir"] / "metrics.jsonl")
    assert (server["run_dir"] / "metrics.jsonl").read_text().startswith(rows_before)
    assert len(rows) == len(STEPS) + 1 and rows[-1]["train/loss"] == output.metrics["loss:sum"]
    assert server["process"].poll() is None


def test_forward_backward_calls_accumulate_until_optim_step(trained):
    """The batch as one call and as two halves: the same gradient (its norm, up to float rounding) at the next
    optim_step; lr 0 keeps the weights as they are between the two."""
    from tinker import types

    client, data = trained["client"], trained["data"]
    still = types.AdamParams(learning_rate=0.0, grad_clip_norm=0.0)
    client.forward_backward(data, "cross_entropy").result()
    whole = client.optim_step(still).result().metrics["grad_norm"]
    halves = [client.forward_backward(part, "cross_entropy") for part in (data[:2], data[2:])]
    [half.result() for half in halves]
    parts = client.optim_step(still).result().metrics["grad_norm"]
    assert whole > 0 and abs(parts - whole) <= 1e-5 * whole, (whole, parts)


def test_forward_gives_forward_backwards_logprobs_and_no_gradient(trained):
    """The SDK's forward (forward_only): the same log-probs and loss:sum as forward_backward on the same weights, and
    no gradient: forward then forward_backward steps (at lr 0) with the grad norm of forward_backward alone."""
    from tinker import types

    client, data = trained["client"], trained["data"]
    still = types.AdamParams(learning_rate=0.0, grad_clip_norm=0.0)
    alone = client.forward_backward(data, "cross_entropy").result()
    norm_alone = client.optim_step(still).result().metrics["grad_norm"]
    forward = client.forward(data, "cross_entropy").result()
    client.forward_backward(data, "cross_entropy").result()
    norm_after_forward = client.optim_step(still).result().metrics["grad_norm"]
    assert abs(norm_after_forward - norm_alone) <= 1e-5 * norm_alone, (norm_alone, norm_after_forward)
    assert abs(forward.metrics["loss:sum"] - alone.metrics["loss:sum"]) <= 1e-5 * abs(alone.metrics["loss:sum"])
    for got, want in zip(forward.loss_fn_outputs, alone.loss_fn_outputs):
        assert abs(got["logprobs"].to_numpy() - want["logprobs"].to_numpy()).max() < 1e-5
