"""`python -m tinker_exp.serve` driven by the unmodified tinker SDK (0.38, a test extra) through TINKER_BASE_URL and
the server's key (TINKER_EXP_API_KEY): one server for the module (a subprocess on the shared Ray cluster, 2 CPU
workers, the tiny model), its terminal lines collected.

A supervised loop whose AdamParams change every step (lr, betas, eps, weight_decay, grad_clip_norm): the loss falls,
each step's values are what the workers applied (metrics.jsonl), the per-datum log-probs sum to loss:sum; then bad
requests, each an HTTP 400 of one line naming the field, after which the server still serves and its rows are intact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import REPO, environment, read_jsonl, wait_until

tinker = pytest.importorskip("tinker")  # the test extra: pip install -e .[test]

API_KEY = "tml-serve-test-5f0c2e9a7b41d3"
"""The server's key (TINKER_EXP_API_KEY) and the SDK's (TINKER_API_KEY)."""
RANK = 0
"""The client's LoRA rank: 0, full fine-tuning (ours; Tinker's ranks are >= 1): the digits env's reward rises in ten
RL steps at its lr (1e-2) with every weight trained, not with rank-8 adapters on the tiny model's two layers
(measured: flat over 16 steps at lr 1e-2 and 5e-2). The adapters' sampler path is tested in test_serve_sampler.py."""
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


CHUNK_DATUMS = 40
"""The server's serve.max_chunk_datums (the SDK's chunk length): the RL loop's batches (DIGIT_PROMPTS x GROUP = 32)
fit one chunk, the chunk test's batch takes three."""


class Terminal:
    """A server process's stdout and stderr lines, read as they come (never a full pipe that blocks the server)."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.out, self.err = process, [], []
        self.listening, self.closed = threading.Event(), [threading.Event(), threading.Event()]
        for stream, lines, closed in ((process.stdout, self.out, self.closed[0]), (process.stderr, self.err, self.closed[1])):
            threading.Thread(target=self._read, args=(stream, lines, closed), daemon=True).start()

    def _read(self, stream, lines: list, closed: threading.Event) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            if "serving" in line:
                self.listening.set()
        closed.set()
        self.listening.set()  # it exited: the caller looks at why

    def ended(self, timeout: float) -> int:
        """The exit status, once it has exited and every line of it is read."""
        code = self.process.wait(timeout)
        assert all(closed.wait(timeout) for closed in self.closed)
        return code

    def requests(self, text: str) -> list[str]:
        """Its per-request lines that hold `text`."""
        return [line for line in self.out if line.startswith("tinker_exp.serve: ") and text in line]


MAX_BODY_BYTES, MAX_NUM_SAMPLES = 1 << 20, 8
"""The server's serve.max_body_bytes and serve.max_num_samples (the RL loop's 8 samples a prompt are the most)."""


def start_server(ray_address: str | None, run_dir: Path, port: int) -> Terminal:
    """The server, started as a user starts it (its key from TINKER_EXP_API_KEY); its first line (printed once it
    listens) says where. `ray_address` None: its own Ray cluster, as a user's first server has."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tinker_exp.serve", f"serve.port={port}", f"serve.run_dir={run_dir}", "logger=wandb",  # offline
         f"serve.max_chunk_datums={CHUNK_DATUMS}", f"serve.max_body_bytes={MAX_BODY_BYTES}",
         f"serve.max_num_samples={MAX_NUM_SAMPLES}"],
        cwd=REPO, env=environment({"RAY_ADDRESS": ray_address, "TINKER_EXP_API_KEY": API_KEY, "TINKER_API_KEY": None}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    terminal = Terminal(process)
    assert terminal.listening.wait(600), "the server never listened"
    assert terminal.out and "serving" in terminal.out[0] and "requests must carry its key" in terminal.out[0], (
        terminal.out, terminal.err[-20:])
    return terminal


def model_rows(server, model_id: str) -> list[dict]:
    """A served model's own metrics.jsonl (models/<model id, colons as _>/)."""
    return read_jsonl(model_dir(server, model_id) / "metrics.jsonl")


def model_dir(server, model_id: str) -> Path:
    return server["run_dir"] / "models" / model_id.replace(":", "_")


@pytest.fixture(scope="module")
def server(ray_address, tmp_path_factory):
    """One server for the module (the last test kills it and starts another on the same run dir and port)."""
    run_dir, port = Path(tmp_path_factory.mktemp("serve")), free_port()
    terminal = start_server(ray_address, run_dir, port)
    served = {"url": f"http://127.0.0.1:{port}", "run_dir": run_dir, "port": port, "ray_address": ray_address,
              "process": terminal.process, "terminal": terminal}
    yield served
    served["process"].terminate()
    served["process"].wait(60)


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
    client = service.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
    initial = client.save_state("initial").result().path  # the weights and optimizer before any step
    data = [datum(tokens) for tokens in tokenized]
    outputs, responses = [], []
    for params in STEPS:
        outputs.append(client.forward_backward(data, "cross_entropy").result())
        responses.append(client.optim_step(types.AdamParams(**params)).result())
    model_id = client.get_info().model_id
    yield {"capabilities": capabilities, "client": client, "outputs": outputs, "responses": responses, "data": data,
           "rows": model_rows(server, model_id), "service": service, "initial": initial, "model_id": model_id}
    if not server.get("restarted"):  # (the restart test closes it before the kill)
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


def test_capabilities_and_model_info(trained, tokenized):
    """get_info as the SDK reads it; its tokenizer_id is the model's local dir, so the SDK's own get_tokenizer() (the
    cookbook's first call) loads it from disk (the issue: 53 s retrying the hub for 'tiny-llama', then OSError)."""
    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir as local_model

    assert [m.model_name for m in trained["capabilities"].supported_models] == ["tiny-llama"]
    info = trained["client"].get_info()
    assert not info.is_lora and info.lora_rank is None and info.model_data.model_name == "tiny-llama"
    assert info.model_id.endswith(":train:0")  # the SDK's own scheme: session_id:train:model_seq_id
    assert info.model_data.tokenizer_id == str(local_model(ModelConfig()).resolve())
    tokenizer = trained["client"].get_tokenizer()
    assert [tokenizer.encode(text) for text in TEXTS] == tokenized


def test_the_key_is_required_and_written_nowhere(server, trained):
    """With a key (TINKER_EXP_API_KEY), a request without it, with another tml- key or with a near miss is a 401 of
    one line, and one refused line on the terminal; the key is in no file of the run dir (metrics, W&B's files and
    config, checkpoints, logs) and in no line the server printed."""
    import httpx

    out_before = len(server["terminal"].out)
    for headers, why in [({}, "X-API-Key: missing"), ({"X-API-Key": "tml-local"}, "X-API-Key: not this server's key"),
                         ({"X-API-Key": API_KEY[:-1]}, "X-API-Key: not this server's key")]:
        response = httpx.post(f"{server['url']}/api/v1/get_info", json={"model_id": trained["model_id"]}, headers=headers)
        assert response.status_code == 401 and response.json()["error"].startswith(why), response.text
    refused = lambda: sum("get_info" in line and ": refused (401, " in line for line in server["terminal"].out[out_before:])  # noqa: E731
    wait_until(lambda: refused() >= 3, 60, "the server printed fewer than 3 refused lines")  # its reader thread may lag the reply
    lines = server["terminal"].out[out_before:]
    assert refused() == 3, lines
    assert post(server, "get_info", {"model_id": trained["model_id"]}).status_code == 200
    secret = API_KEY.encode()
    holding = [path for path in server["run_dir"].rglob("*") if path.is_file() and secret in path.read_bytes()]
    assert holding == [], holding
    assert not any(API_KEY in line for line in server["terminal"].out + server["terminal"].err)


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


def reserved_seq_ids(client, n: int) -> list[int]:
    """`n` seq_ids of the SDK client's own sequence for raw posts: reserved, and their turns passed, as the client
    does for its own requests (training_client.py `_reserve_request_ids`, `_take_turn`): its later calls follow them.
    Call with none of its requests pending."""
    ids = client._reserve_request_ids(n)

    async def pass_turns():
        for request_id in ids:
            async with client._take_turn(request_id):
                pass

    client.holder.run_coroutine_threadsafe(pass_turns()).result()
    return [request_id + 1 for request_id in ids]  # the SDK's seq_id: its request id + 1


def forward_backward_body(client, data: list, seq_id: int) -> bytes:
    """A forward_backward request of the client's model as the SDK's own converter writes it (cross_entropy)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                                           model_id=client.get_info().model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def retrieved(server, request_id: str):
    """A future's result as the SDK fetches it (retrieve_future until it is no longer try_again)."""
    while True:
        response = post(server, "retrieve_future", {"request_id": request_id})
        assert response.status_code == 200, response.text
        if "json" not in response.headers["content-type"] or response.json().get("type") != "try_again":
            return response


def test_wandb_holds_each_steps_row_as_metrics_jsonl_does(server, trained):
    """logger=wandb (offline here): the served run's W&B run has each optim_step's loss, grad norm, requested and
    applied values (grad_clip_norm included) at its train/step, as metrics.jsonl; its config is a run's, plus serve.*."""
    from helpers import wait_until, wandb_history, wandb_records

    rows = trained["rows"]
    keys = [key for key in rows[0] if key != "time"]
    assert {"requested/grad_clip_norm", "applied/grad_clip_norm", "train/grad_norm"} <= set(keys)
    first = lambda: sorted((server["run_dir"] / "wandb").glob("offline-run-*/run-*.wandb"))[:1]  # noqa: E731  the first server's
    logged = lambda: [r for r in wandb_history(wandb_records(first()[0])) if "train/loss" in r] if first() else []  # noqa: E731
    wait_until(lambda: len(logged()) >= len(rows), 120, "W&B never wrote the trained steps")
    for written, row in zip(logged(), rows):
        assert {key: written[key] for key in keys} == pytest.approx({key: row[key] for key in keys}, rel=1e-12)
    run = next(r.run for r in wandb_records(first()[0]) if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["serve.port"] == server["port"] and config["model.name"] == "tiny-llama" and config["logger.wandb"] is True


VOCAB = 384
"""The tiny model's vocab_size (ModelConfig): token ids 0 .. 383."""


def test_bad_requests_are_one_line_http_errors_and_the_server_goes_on(server, trained, tokenized):
    """Each refused before the workers: a one-line 400 naming the field, and one line on the server's terminal,
    never a traceback. NaN, infinity and null AdamParams (the issue: a NaN lr trained at the config's lr), token ids
    outside the vocabulary (the issue: an IndexError from a worker, a 40-line traceback), through the SDK and raw."""
    from tinker import types

    model_id = trained["client"].get_info().model_id
    adam = dict(STEPS[0])
    out_before = len(server["terminal"].out)
    cases = [
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "learning_rate": None}}, None,
         "adam_params.learning_rate: null is not a number"),
        ("optim_step", json.dumps({"model_id": model_id, "adam_params": {**adam, "grad_clip_norm": float("inf")}}).encode(),
         None, "adam_params.grad_clip_norm: inf is not a finite number"),
        ("optim_step", json.dumps({"model_id": model_id, "adam_params": {**adam, "beta2": float("nan")}}).encode(),
         None, "adam_params.beta2: nan is not a finite number"),
        ("forward_backward", b"\xff\xff not protobuf", "application/x-protobuf", "forward_backward: the body is not a ForwardBackwardRequest protobuf"),
        ("optim_step", b"{not json", "application/json", "/api/v1/optim_step: the body is not JSON"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "beta1": 1.0}}, None, "adam_params.beta1: 1.0 is not in [0, 1)"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "learning_rate": -1.0}}, None, "adam_params.learning_rate: must be >= 0, got -1.0"),
        ("optim_step", {"model_id": model_id, "adam_params": {**adam, "grad_clip_norm": -1.0}}, None, "adam_params.grad_clip_norm: must be >= 0, got -1.0"),
        ("optim_step", {"model_id": "nope:train:0", "adam_params": adam}, None, "model_id: 'nope:train:0' is not served here"),
        ("create_model", {"session_id": "s", "model_seq_id": 1, "base_model": "tiny-llama", "lora_config": {"rank": 8}}, None,
         f"create_model: this server already serves model {model_id}; a fully fine-tuned model (LoRA rank 0) trains alone"),
        ("create_model", {"base_model": "Qwen/Qwen3-8B"}, None, "base_model: 'Qwen/Qwen3-8B' is not served (this server serves 'tiny-llama')"),
    ]
    for route, body, content_type, message in cases:
        response = post(server, route, body, content_type or "application/json")
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error.startswith(message) and "\n" not in error, (route, error)
    client = trained["client"]
    with pytest.raises(tinker.BadRequestError, match=r"adam_params\.learning_rate: null is not a number"):  # the SDK's NaN
        client.optim_step(types.AdamParams(learning_rate=float("nan"))).result()
    outside = list(tokenized[1])
    outside[3] = 10**6
    sdk_cases = [
        ([datum(tokenized[0]), datum(outside)],
         f"data[1].model_input: token id {10**6} is not in the vocabulary (ids 0 .. {VOCAB - 1}: the model's vocab_size is {VOCAB})"),
        ([datum(tokenized[0][:-1] + [VOCAB])],  # only the last target: never in model_input
         f"data[0].loss_fn_inputs.target_tokens: token id {VOCAB} is not in the vocabulary (ids 0 .. {VOCAB - 1}"),
    ]
    for data, message in sdk_cases:
        with pytest.raises(tinker.BadRequestError) as refused:
            client.forward_backward(data, "cross_entropy").result()
        assert message in str(refused.value), str(refused.value)
    unknown_loss = client.forward_backward(trained["data"], "nope")
    with pytest.raises(Exception, match="loss_fn: 'nope' is not served"):
        unknown_loss.result()
    expected = len(cases) + 1 + len(sdk_cases) + 1
    refused_now = lambda: [line for line in server["terminal"].out[out_before:] if ": refused (400, " in line]  # noqa: E731
    wait_until(lambda: len(refused_now()) >= expected, 60, "the server printed fewer refused lines than requests refused")
    lines = server["terminal"].out[out_before:]
    refused_lines = refused_now()
    # one line each (the SDK's NaN, sent as null, and the nope loss included), none for the SDK's retries
    assert len(refused_lines) == expected, lines
    for message in [m for *_, m in cases] + [m for _, m in sdk_cases]:
        assert any(message in line for line in refused_lines), (message, lines)
    assert sum(line.startswith(f"tinker_exp.serve: optim_step model {model_id} seq ") and "adam_params.learning_rate: null"
               in line for line in refused_lines) == 1, lines  # the SDK's: in its sequence
    assert not any("Traceback" in line for line in server["terminal"].out + server["terminal"].err)
    rows_before = (model_dir(server, model_id) / "metrics.jsonl").read_text()
    output = trained["client"].forward_backward(trained["data"], "cross_entropy").result()
    trained["client"].optim_step(types.AdamParams(**STEPS[-1])).result()
    rows = read_jsonl(model_dir(server, model_id) / "metrics.jsonl")
    assert (model_dir(server, model_id) / "metrics.jsonl").read_text().startswith(rows_before)
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


def test_a_batch_of_several_chunks_equals_the_same_batch_sent_as_one_request(server, trained, tokenized):
    """The SDK's chunk length is the server's serve.max_chunk_datums (fwdbwd_max_chunk_len), and a request of more
    datums is refused naming it. A batch of more datums than one chunk (the client's chunk length set to a quarter
    of it here, so that the whole batch fits one request): the SDK splits it into three and sends them at once, the
    first last (parallel_fwdbwd_chunks); the server runs them in their seq_id order. The same data as one request (a
    raw post built by the SDK's own converter, in the client's sequence): the same loss:sum, each datum's log-probs
    in order (1e-5) and the same grad norm at an lr-0 step (relative 1e-5: the sums add up in another order)."""
    from tinker import types
    from tinker.proto.response_conv import deserialize_forward_backward_output

    client = trained["client"]
    still = types.AdamParams(learning_rate=0.0, grad_clip_norm=0.0)
    pieces = [(tokens, i % (len(tokens) - 5), 2 + i % 4) for i, tokens in enumerate(tokenized * 23)][:CHUNK_DATUMS + 1]
    data = [datum(tokens[start:start + n]) for tokens, start, n in pieces]  # tiny datums: a cheap pass
    config = client.holder._client_config
    assert config.fwdbwd_max_chunk_len == CHUNK_DATUMS
    (too_many, seq_id) = reserved_seq_ids(client, 2)
    refused = post(server, "forward_backward", forward_backward_body(client, data, too_many), "application/x-protobuf")
    assert refused.status_code == 400 and refused.json()["error"] == (
        f"data: {CHUNK_DATUMS + 1} datums exceed serve.max_chunk_datums={CHUNK_DATUMS} (the most in one request; "
        "the SDK splits a batch into chunks of that many)"), refused.text
    data = data[:CHUNK_DATUMS * 5 // 8]
    sent = post(server, "forward_backward", forward_backward_body(client, data, seq_id), "application/x-protobuf")
    assert sent.status_code == 200, sent.text
    whole = deserialize_forward_backward_output(retrieved(server, sent.json()["request_id"]).content)
    whole_norm = client.optim_step(still).result().metrics["grad_norm"]
    client.holder._client_config = config.model_copy(update={"fwdbwd_max_chunk_len": CHUNK_DATUMS // 4})
    try:
        assert [len(chunk.data) for chunk in client._chunked_requests_generator(data)] == [10, 10, 5]
        chunked = client.forward_backward(data, "cross_entropy").result()
    finally:
        client.holder._client_config = config
    chunked_norm = client.optim_step(still).result().metrics["grad_norm"]
    assert abs(chunked.metrics["loss:sum"] - whole.metrics["loss:sum"]) <= 1e-5 * abs(whole.metrics["loss:sum"])
    assert len(logprobs_of(chunked)) == len(data) == len(logprobs_of(whole))
    for got, want in zip(logprobs_of(chunked), logprobs_of(whole)):
        assert got.shape == want.shape and abs(got - want).max() < 1e-5
    assert whole_norm > 0 and abs(chunked_norm - whole_norm) <= 1e-5 * whole_norm, (whole_norm, chunked_norm)


RL_LOSS_CONFIGS = {  # each loss with parameters off Tinker's defaults, so that they are seen to arrive
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02},
    "stable_reinforce": {"ratio_cap": 1.3, "sequence_ratio_bound": 1.1},
}


def test_each_rl_loss_through_the_sdk_is_the_rl_losses_formula_on_its_logprobs(trained):
    """Every RL loss through the SDK's forward, with Tinker's inputs (target_tokens, logprobs, advantages, weights)
    and its loss_fn_config: loss:sum is runtime/rl_losses.py's token terms, summed over the positions of weight 1,
    computed here on the log-probs the server returned (1e-5 of the terms' magnitude); those log-probs are
    cross_entropy's on the same weights (1e-5). The sampler's log-probs are the trainer's shifted by up to 0.4, so
    that ratios fall outside the clip ranges. An unknown loss_fn_config key is a one-line 400."""
    import numpy as np
    import torch
    from tinker import types

    from tinker_exp.runtime.rl_losses import TOKEN_TERMS

    client, plain = trained["client"], trained["data"]
    trainer = logprobs_of(client.forward(plain, "cross_entropy").result())
    rng = np.random.default_rng(0)
    data, inputs = [], []
    for d, logprobs, advantage in zip(plain, trainer, (1.0, -0.5, 0.8, -1.2)):
        n = len(logprobs)
        weights = np.array([0.0, 0.0] + [1.0] * (n - 2), dtype=np.float32)  # the first two: the "prompt"
        sampler = ((logprobs + rng.uniform(-0.4, 0.4, n)) * weights).astype(np.float32)
        advantages = (np.full(n, advantage) * weights).astype(np.float32)
        data.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": sampler.tolist(),
            "advantages": advantages.tolist(), "weights": weights.tolist()}))
        inputs.append((sampler, advantages, weights))
    # gspo's sequence ratio is over sequence_ratio_mask's positions (the cookbook sends it, not weights)
    gspo_data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **{k: v for k, v in d.loss_fn_inputs.items() if k != "weights"}, "sequence_ratio_mask": w.tolist()})
        for d, (_, _, w) in zip(data, inputs)]  # fmt: skip
    losses = {}
    for name, config in RL_LOSS_CONFIGS.items():
        output = client.forward(gspo_data if name == "gspo" else data, name, config).result()
        want, magnitude = 0.0, 0.0
        for got, want_logprobs, (sampler, advantages, weights) in zip(logprobs_of(output), trainer, inputs):
            assert abs(got - want_logprobs).max() < 1e-5, name
            terms, _ = TOKEN_TERMS[name](*(torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in (got, sampler, advantages, weights)), **config)
            terms = terms * torch.from_numpy(weights)
            want, magnitude = want + float(terms.sum()), magnitude + float(terms.abs().sum())
        losses[name] = output.metrics["loss:sum"]
        assert abs(losses[name] - want) <= 1e-5 * magnitude, (name, losses[name], want)
    assert len(set(losses.values())) == len(losses), losses  # each its own loss, its parameters taken
    with pytest.raises(tinker.BadRequestError) as refused:
        client.forward(data, "ppo", {"clip_ratio": 0.2}).result()
    assert refused.value.body["error"] == "loss_fn_config.clip_ratio: not a parameter of ppo"


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


def same(a, b) -> bool:
    """Bitwise: every float equal (no tolerance)."""
    import numpy as np

    return np.array_equal(np.asarray(a), np.asarray(b))


def logprobs_of(output) -> list:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


def test_save_state_writes_a_checkpoint_under_the_sdks_path(server, trained):
    """save_state's path is the SDK's scheme (tinker://<model_id>/weights/<name>); the run dir holds it complete."""
    from tinker_exp.train.checkpoints import problem

    model_id = trained["client"].get_info().model_id
    assert trained["initial"] == f"tinker://{model_id}/weights/initial"
    folder = server["run_dir"] / "checkpoints" / model_id.replace(":", "_") / "weights" / "initial"  # scp/rsync-safe
    assert ":" not in str(folder.relative_to(server["run_dir"])) and problem(folder) is None and json.loads((folder / "loop.json").read_text())["step"] == 0
    again = post(server, "save_weights", {"model_id": model_id, "path": "initial", "type": "save_weights"})
    assert again.status_code == 400 and again.json()["error"] == (
        f"path: 'initial': model {model_id} has a checkpoint of that name (overwrite=true replaces it)")


def test_load_state_without_optimizer_replays_the_first_steps_bitwise(trained):
    """load_state (weights only: a fresh optimizer) of the state saved before the first step, then the loop's first
    two steps again: the same loss, log-probs and grad norms, bitwise, as the first time. The second step's
    forward_backward sees the weights the first optim_step made: had Adam's moments of the later steps survived
    the load, they would differ."""
    import warnings

    from tinker import types

    client, data = trained["client"], trained["data"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the SDK deprecates it for create_training_client_from_state
        client.load_state(trained["initial"]).result()
    for i in range(2):
        output = client.forward_backward(data, "cross_entropy").result()
        response = client.optim_step(types.AdamParams(**STEPS[i])).result()
        assert output.metrics["loss:sum"] == trained["outputs"][i].metrics["loss:sum"], i
        assert all(same(a, b) for a, b in zip(logprobs_of(output), logprobs_of(trained["outputs"][i]))), i
        assert response.metrics["grad_norm"] == trained["responses"][i].metrics["grad_norm"], i


DIGIT_PROMPTS = 4
RL_STEPS = 10
RL_LR = 1e-2
GROUP = 8


def digits_datum(prompt: list[int], sequence, advantage: float):
    """An RL datum as the cookbook builds one: the prompt's positions weigh 0 (log-prob and advantage 0)."""
    from tinker import types

    tokens, n = prompt + list(sequence.tokens), len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": [0.0] * n + list(sequence.logprobs),
        "advantages": [0.0] * n + [advantage] * len(sequence.tokens), "weights": [0.0] * n + [1.0] * len(sequence.tokens)})


def test_sampling_client_and_importance_sampling_raise_the_digits_reward(server, trained):
    """An RL loop on the digits env through the SDK alone: each step saves the weights for the sampler, samples
    GROUP responses to each of DIGIT_PROMPTS prompts (the SDK's SamplingClient), rewards them (the env's
    digit_share), and trains with importance_sampling (target_tokens, logprobs, advantages, weights) and the lr the
    env uses. From the initial weights (load_state): the mean reward rises; the trainer's log-probs of the sampled
    tokens are the sampler's (float rounding); a seeded sample of the trained weights is the same from a named
save and from an unnamed snapshot."""
    import warnings

    import numpy as np
    from tinker import types

    from transformers import AutoTokenizer

    from tinker_exp.config.rl import EnvConfig
    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.rl.envs import digit_share
    from tinker_exp.rl.prompts import env_rows
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.sampler import chat_prompt_ids  # as an RL run renders its prompts

    client, service = trained["client"], trained["service"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state(trained["initial"]).result()
    rows = env_rows(EnvConfig(name="digits", prompts="builtin:digits_train.jsonl", reward="tinker_exp.rl.envs:digit_share"))[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir(ModelConfig()))
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    means, mismatch = [], []
    for step in range(RL_STEPS):
        path = client.save_weights_for_sampler(f"digits-{step}").result().path
        assert path.endswith(f"/sampler_weights/digits-{step}")
        sampler = service.create_sampling_client(model_path=path).result()
        batch = [rows[(step * DIGIT_PROMPTS + i) % len(rows)] for i in range(DIGIT_PROMPTS)]
        prompts = [chat_prompt_ids(tokenizer, row.prompt) for row in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in prompts]
        data, rewards = [], []
        for prompt, row, future in zip(prompts, batch, futures):
            sequences = future.result().sequences
            group = [digit_share(row.record(), tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in sequences]
            mean, std = float(np.mean(group)), float(np.std(group))
            data += [digits_datum(prompt, s, (r - mean) / (std + 1e-6)) for s, r in zip(sequences, group)]
            rewards += group
        output = client.forward_backward(data, "importance_sampling").result()
        for datum, trainer in zip(data, logprobs_of(output)):
            n = int((np.asarray(datum.loss_fn_inputs["weights"].data) == 0).sum())
            mismatch.append(float(np.abs(trainer[n:] - np.asarray(datum.loss_fn_inputs["logprobs"].data)[n:]).max()))
        client.optim_step(types.AdamParams(learning_rate=RL_LR)).result()
        means.append(float(np.mean(rewards)))
    first, last = np.mean(means[:3]), np.mean(means[-3:])
    assert last > first + 0.1, means
    assert max(mismatch) < 1e-4, max(mismatch)
    # the trained weights twice: saved by name, and as an unnamed snapshot (save_weights_and_get_sampling_client);
    # a seeded request samples the same tokens and log-probs from both
    named = service.create_sampling_client(model_path=client.save_weights_for_sampler("digits-final").result().path).result()
    snapshot = client.save_weights_and_get_sampling_client().result()
    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    a, b = (s.sample(types.ModelInput.from_ints(prompts[0]), 2, seeded).result().sequences for s in (named, snapshot))
    assert [list(x.tokens) for x in a] == [list(x.tokens) for x in b] and all(same(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_sampling_params_stop_top_k_top_p_and_prompt_logprobs_through_the_sdk(trained):
    """The SDK's SamplingParams and include_prompt_logprobs on the trained weights: top_k 1 draws the most likely
    token (two samples alike, each log-prob 0); a tiny top_p does too, and stop (a token id) ends it at that token's
    first place (stop_reason stop); the prompt's log-probs are the trainer's for the same tokens (1e-4, as the RL
    loop's mismatch), the first None."""
    from tinker import types

    client = trained["client"]
    sampler = client.save_weights_and_get_sampling_client().result()
    tokens = trained["data"][0].model_input.to_ints()
    prompt = types.ModelInput.from_ints(tokens)
    greedy = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, top_k=1, stop=[]), include_prompt_logprobs=True).result()
    first, second = (list(s.tokens) for s in greedy.sequences)
    assert first == second and len(first) == 6 and all(s.stop_reason == "length" for s in greedy.sequences)
    assert all(lp == 0.0 for s in greedy.sequences for lp in s.logprobs)
    trainer = logprobs_of(client.forward([datum(tokens)], "cross_entropy").result())[0]
    assert greedy.prompt_logprobs[0] is None and len(greedy.prompt_logprobs) == len(tokens)
    assert max(abs(a - b) for a, b in zip(greedy.prompt_logprobs[1:], trainer)) < 1e-4
    stop = first[2]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, top_p=1e-6, stop=[stop])).result().sequences[0]
    assert list(stopped.tokens) == first[: first.index(stop) + 1] and stopped.stop_reason == "stop"


def test_bad_checkpoint_and_sampling_requests_are_one_line_errors(server, trained):
    """Each an HTTP 400 of one line naming the field; a second client (its own ServiceClient) is refused a model."""
    model_id = trained["client"].get_info().model_id
    second = tinker.ServiceClient()
    try:
        with pytest.raises(tinker.BadRequestError) as refused:  # and when it frees itself
            second.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
        assert (f"create_model: this server already serves model {model_id}; a fully fine-tuned model (LoRA rank 0) trains alone. "
                "It is freed when its client closes its ServiceClient, or 120 s after that client's last heartbeat (in "
                ) in str(refused.value), str(refused.value)
    finally:
        second.close("success").result(timeout=60)
    cases = [
        ("load_weights", {"model_id": model_id, "path": f"tinker://{model_id}/weights/nope", "optimizer": True},
         f"path: 'tinker://{model_id}/weights/nope': no such checkpoint on this server"),
        ("load_weights", {"model_id": model_id, "path": "/tmp/elsewhere", "optimizer": False},
         "path: '/tmp/elsewhere' is not a checkpoint path (tinker://<model_id>/weights/<name>)"),
        ("load_weights", {"session_id": "s", "model_seq_id": 1, "path": trained["initial"], "optimizer": True},
         f"load_weights: this server already serves model {model_id}; a fully fine-tuned model (LoRA rank 0) trains alone"),
        ("save_weights", {"model_id": model_id, "path": "../up"}, "path: '../up' is not a checkpoint name"),
        ("create_sampling_session", {"session_id": "s", "sampling_session_seq_id": 0, "model_path": trained["initial"]},
         f"model_path: {trained['initial']!r} is not a checkpoint path (tinker://<model_id>/sampler_weights/<name>)"),
        ("asample", {"sampling_session_id": "nope", "seq_id": 0, "num_samples": 1, "prompt": {"chunks": []},
                     "sampling_params": {"max_tokens": 4}}, "sampling_session_id: 'nope' is not a sampling session of this server"),
    ]
    for route, body, message in cases:
        response = post(server, route, body)
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error.startswith(message) and "\n" not in error, (route, error)
    session = post(server, "create_sampling_session", {"session_id": "s", "sampling_session_seq_id": 0, "base_model": "tiny-llama"})
    sampling_session_id = session.json()["sampling_session_id"]
    for params, message in [({"max_tokens": 0}, "sampling_params.max_tokens: 0 is not a count"),
                            ({"max_tokens": 4, "temperature": 0.0}, "sampling_params.temperature: 0.0 is not served"),
                            ({"max_tokens": 4, "top_p": 1.5}, "sampling_params.top_p: 1.5 is not in (0, 1]"),
                            ({"max_tokens": 4, "stop": [2, "a"]}, "sampling_params.stop: [2, 'a'] is not stop strings or stop token ids")]:
        response = post(server, "asample", {"sampling_session_id": sampling_session_id, "seq_id": 0, "num_samples": 1,
                                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                            "sampling_params": params})
        assert response.status_code == 400 and response.json()["error"].startswith(message), response.text
    outside = post(server, "asample", {"sampling_session_id": sampling_session_id, "seq_id": 0, "num_samples": 1,
                                       "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, VOCAB]}]},
                                       "sampling_params": {"max_tokens": 4}})
    assert outside.status_code == 400 and outside.json()["error"] == (
        f"prompt.chunks[0].tokens: token id {VOCAB} is not in the vocabulary (ids 0 .. {VOCAB - 1}: the model's vocab_size is {VOCAB})")


def test_a_retried_request_gets_the_same_future_and_runs_once(server, trained):
    """The SDK retries a POST with its X-Idempotency-Key: the same key gets the same future, and the step runs once
    (one row); the same request (its seq_id) re-sent with a new key, as the SDK re-sends one whose reply it lost,
    gets the same future too; another seq_id is another step."""
    import httpx

    model_id = trained["client"].get_info().model_id
    rows_before = len(model_rows(server, model_id))

    def send(key: str, seq_id: int) -> str:
        body = {"model_id": model_id, "seq_id": seq_id, "type": "optim_step", "adam_params": {**STEPS[0], "learning_rate": 0.0}}
        response = httpx.post(f"{server['url']}/api/v1/optim_step", json=body, timeout=60,
                              headers={"X-API-Key": API_KEY, "X-Idempotency-Key": key})
        assert response.status_code == 200, response.text
        return response.json()["request_id"]

    retried, another = reserved_seq_ids(trained["client"], 2)
    first = send("retry-me", retried)
    assert send("retry-me", retried) == first
    assert send("a-new-key", retried) == first  # the SDK's re-send of a request whose reply it lost: a new key
    second = send("another", another)
    assert second != first
    for request_id in (first, second):
        retrieved(server, request_id)
    assert len(model_rows(server, model_id)) == rows_before + 2


def test_a_models_requests_run_in_seq_id_order_when_they_arrive_out_of_order(server, trained):
    """Raw posts in the SDK client's sequence: an optim_step (lr 0) sent before the forward_backward whose seq_id
    precedes it waits for it: its row's loss is that forward_backward's loss:sum and its grad norm that batch's (had
    it run first, both would be 0: the last step zeroed the gradients). The same request sent again gets its
    future; another request with a seq_id sent before is a one-line 400."""
    from tinker.proto.response_conv import deserialize_forward_backward_output

    client, data = trained["client"], trained["data"]
    model_id = client.get_info().model_id
    seq_fb, seq_step = reserved_seq_ids(client, 2)
    step = post(server, "optim_step", {"model_id": model_id, "seq_id": seq_step, "type": "optim_step",
                                       "adam_params": {**STEPS[0], "learning_rate": 0.0}})
    body = forward_backward_body(client, data, seq_fb)
    fb = post(server, "forward_backward", body, "application/x-protobuf")
    assert step.status_code == 200 == fb.status_code, (step.text, fb.text)
    loss = deserialize_forward_backward_output(retrieved(server, fb.json()["request_id"]).content).metrics["loss:sum"]
    grad_norm = retrieved(server, step.json()["request_id"]).json()["metrics"]["grad_norm"]
    row = model_rows(server, model_id)[-1]
    assert row["train/loss"] == loss > 0 and row["train/grad_norm"] == grad_norm > 0
    again = post(server, "forward_backward", body, "application/x-protobuf")  # the same request: the same answer
    assert again.status_code == 200 and again.json()["request_id"] == fb.json()["request_id"], again.text
    other = post(server, "forward_backward", forward_backward_body(client, data[:1], seq_fb), "application/x-protobuf")
    assert other.status_code == 400 and other.json()["error"] == (
        f"seq_id: {seq_fb} of model {model_id} was sent before with another request (its turn is past; the next is "
        f"{seq_step + 1})")


def test_ids_and_names_that_would_lead_outside_the_run_dir_are_refused(server, trained):
    """The issue's attack, raw as it came: a create_model whose model_seq_id climbs out of the run dir (then
    save_weights wrote there); and tinker:// paths that climb, on load and on a sampling session. Each a one-line
    400 naming the field; nothing is written outside the run dir."""
    outside = server["run_dir"].parent
    before = sorted(path.name for path in outside.iterdir())
    session_id = post(server, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0",
                                                 "type": "create_session"}).json()["session_id"]
    climb = "0/../../../escaped"
    model = post(server, "create_model", {"session_id": session_id, "model_seq_id": climb, "base_model": "tiny-llama",
                                          "lora_config": {"rank": 8}})
    assert model.status_code == 400 and model.json()["error"] == (
        f"model_seq_id: {climb!r} is not a model_seq_id (an integer >= 0: the SDK's count of its training clients)")
    saved = post(server, "save_weights", {"model_id": f"{session_id}:train:{climb}", "path": "x", "seq_id": 1})
    assert saved.status_code == 400 and saved.json()["error"].startswith("model_id: "), saved.text
    for route, body, field in [
            ("load_weights", {"session_id": session_id, "model_seq_id": 1, "optimizer": False,
                              "path": "tinker://..%2F..%2Fx/weights/a"}, "path"),
            ("load_weights", {"session_id": session_id, "model_seq_id": 1, "optimizer": False,
                              "path": f"tinker://{trained['model_id']}/weights/../../../../escaped"}, "path"),
            ("load_weights", {"session_id": session_id, "model_seq_id": 1, "optimizer": False,
                              "path": "tinker://../weights/.."}, "path"),
            ("create_sampling_session", {"session_id": session_id, "sampling_session_seq_id": 0,
                                         "model_path": "tinker://../sampler_weights/escaped"}, "model_path")]:
        response = post(server, route, body)
        assert response.status_code == 400 and response.json()["error"].startswith(
            f"{field}: {body.get('path', body.get('model_path'))!r} is not a checkpoint path"), response.text
    post(server, f"sessions/{session_id}/finish", {"reason": {"type": "success"}, "detail": None})
    assert sorted(path.name for path in outside.iterdir()) == before


def test_each_limit_is_a_one_line_400_naming_it(server, trained):
    """serve.max_body_bytes (told by Content-Length, and counted for a body sent in chunks without one),
    serve.max_num_samples, and a datum longer than the model's positions in forward_backward (serve.max_chunk_datums:
    the chunk test). The server goes on."""
    import httpx

    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir as local_model
    from tinker_exp.runtime.serve_workers import model_positions

    client = trained["client"]
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"
    response = post(server, "optim_step", big)
    assert response.status_code == 400 and response.json()["error"] == (
        f"the request's body ({len(big)} bytes) exceeds serve.max_body_bytes={MAX_BODY_BYTES}"), response.text

    def chunks():
        for start in range(0, len(big), 1 << 16):
            yield big[start:start + (1 << 16)]

    streamed = httpx.post(f"{server['url']}/api/v1/optim_step", content=chunks(), timeout=60,
                          headers={"X-API-Key": API_KEY, "Content-Type": "application/json"})
    assert streamed.status_code == 400 and streamed.json()["error"] == (
        f"the request's body exceeds serve.max_body_bytes={MAX_BODY_BYTES}"), streamed.text
    session = post(server, "create_sampling_session", {"session_id": "s", "sampling_session_seq_id": 0,
                                                       "base_model": "tiny-llama"}).json()["sampling_session_id"]
    many = post(server, "asample", {"sampling_session_id": session, "num_samples": MAX_NUM_SAMPLES + 1,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                    "sampling_params": {"max_tokens": 2}})
    assert many.status_code == 400 and many.json()["error"] == (
        f"num_samples: {MAX_NUM_SAMPLES + 1} exceeds serve.max_num_samples={MAX_NUM_SAMPLES}"), many.text
    positions = model_positions(local_model(ModelConfig()))
    long = datum([(5 + i) % 300 for i in range(positions + 1)])  # positions inputs + the last target
    (seq_id,) = reserved_seq_ids(client, 1)
    refused = post(server, "forward_backward", forward_backward_body(client, [trained["data"][0], long], seq_id),
                   "application/x-protobuf")
    assert refused.status_code == 400 and refused.json()["error"] == (
        f"data[1]: {positions} tokens and the last target exceed the model's {positions} positions "
        "(max_position_embeddings)"), refused.text
    assert client.forward(trained["data"], "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_sample_queued_behind_saves_that_drop_its_snapshot_samples_its_weights(server, trained):
    """The issue's race: an unnamed snapshot (save_weights_and_get_sampling_client), then as many unnamed saves as
    the server keeps plus one, queued at once, and a sample of the first snapshot sent after them: the saves drop the
    snapshot before the sample runs, yet the sample (accepted while its weights were kept) draws from them, bitwise
    the same seeded sample taken before. A sample sent after the drop is the documented one-line 400."""
    from tinker import types

    from tinker_exp.serve.app import SNAPSHOTS_KEPT

    client = trained["client"]
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=4, seed=11)
    want = sampler.sample(prompt, 2, params).result()
    # the work thread kept busy by a forward pass of 40 long datums while the saves and the sample arrive
    blocker, *seq_ids = reserved_seq_ids(client, 1 + SNAPSHOTS_KEPT)
    from tinker.proto import tinker_public_pb2

    forward = tinker_public_pb2.ForwardBackwardRequest.FromString(forward_backward_body(
        client, [datum([(7 + i + j) % 300 for i in range(200)]) for j in range(CHUNK_DATUMS)], blocker))
    forward.forward_only = True  # no gradient left behind for the tests after this one
    busy = post(server, "forward_backward", forward.SerializeToString(), "application/x-protobuf")
    saves = [post(server, "save_weights_for_sampler", {"model_id": trained["model_id"], "seq_id": seq_id,
                                                       "sampling_session_seq_id": 1000 + seq_id}) for seq_id in seq_ids]
    got = sampler.sample(prompt, 2, params).result()  # queued after the saves: its snapshot is dropped before it runs
    assert busy.status_code == 200 and all(save.status_code == 200 for save in saves), [save.text for save in saves]
    for save in saves:
        retrieved(server, save.json()["request_id"])
    lines = server["terminal"].out
    last_save = max(i for i, line in enumerate(lines) if f"seq {seq_ids[-1]}: ok" in line)
    assert any(": ok (" in line and line.startswith("tinker_exp.serve: sample session ") for line in lines[last_save:]), (
        "the sample ran before the saves: no race", lines[-8:])
    assert [list(s.tokens) for s in got.sequences] == [list(s.tokens) for s in want.sequences]
    assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]
    with pytest.raises(tinker.BadRequestError) as dropped:
        sampler.sample(prompt, 1, params).result()
    assert f"its weights were dropped (the server keeps the last {SNAPSHOTS_KEPT} unnamed snapshots" in str(dropped.value)
    assert not (server["run_dir"] / "serve_errors.log").exists() or "NoneType" not in (
        server["run_dir"] / "serve_errors.log").read_text()


def test_a_killed_server_restarted_continues_bitwise_and_every_models_rows_are_its_own(server, trained):
    """save_state, then the next step on the running server, and one more. The client's session ends
    (ServiceClient.close): its model (A) is released, and another client (its own ServiceClient:
    create_training_client_from_state_with_optimizer) takes the saved state on the same server as model B and takes
    the same step. Then the server is killed (SIGKILL) and started again on the same run dir, and a third client (C)
    does the same. Both times loss, log-probs, grad norm and the log-probs after the step are bitwise the
    uninterrupted server's. Every model's rows are in its own metrics.jsonl: A's history intact after B's and C's
    restores of an earlier step (the issue: one shared file, a restore deleted another model's later rows), B's and
    C's from the checkpoint's step. The restarted server has its own Ray cluster (as a user's has). Then D, a new
    model on C's workers kept warm (no checkpoint loaded in between), takes the first client's first two steps
    bitwise. Last, SIGTERM while D is held: one line, exit 143, D's workers freed, no process the server started
    left (its Ray daemons and agents)."""
    from tinker import types

    client, data = trained["client"], trained["data"]
    model_a = client.get_info().model_id
    saved = client.save_state("before-kill").result().path
    checkpoint = server["run_dir"] / "checkpoints" / model_a.replace(":", "_") / "weights" / "before-kill"
    step = json.loads((checkpoint / "loop.json").read_text())["step"]

    def next_step(training_client):  # grad_clip_norm 0.05 clips: the clip after a restart too
        output = training_client.forward_backward(data, "cross_entropy").result()
        response = training_client.optim_step(types.AdamParams(**STEPS[1])).result()
        return output, response, training_client.forward(data, "cross_entropy").result()

    def from_saved_state(close: bool = True):  # a new client (its own session) continues from the saved state
        service = tinker.ServiceClient()
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        try:
            assert resumed.get_info().lora_rank is None  # the checkpoint's: full fine-tuning
            return (*next_step(resumed), resumed.get_info().model_id, service)
        finally:
            if close:
                service.close("success").result(timeout=60)

    uninterrupted = next_step(client)
    client.forward_backward(data, "cross_entropy").result()  # A goes on past the checkpoint: rows B and C must not touch
    client.optim_step(types.AdamParams(**STEPS[2])).result()
    rows_a = (model_dir(server, model_a) / "metrics.jsonl").read_text()
    assert [row["train/step"] for row in model_rows(server, model_a)][-3:] == [step - 1, step, step + 1]
    trained["service"].close("success").result(timeout=60)
    server["restarted"] = True
    *released, model_b, _ = from_saved_state()
    # B's model trained on A's workers, kept warm and put in a fresh state (docs/pool.md): bitwise, checked below
    assert "tinker_exp.serve: the new model trains on the kept workers (fresh state)" in server["terminal"].err, server["terminal"].err[-20:]
    server["process"].send_signal(signal.SIGKILL)
    server["process"].wait(60)
    # started again as a user's first server is: on its own Ray cluster (stopped by SIGTERM below)
    server["terminal"] = start_server(None, server["run_dir"], server["port"])
    server["process"] = server["terminal"].process
    *restarted, model_c, service_c = from_saved_state(close=False)
    want_output, want_response, want_after = uninterrupted
    for output, response, after in (released, restarted):
        assert output.metrics["loss:sum"] == want_output.metrics["loss:sum"]
        assert all(same(a, b) for a, b in zip(logprobs_of(output), logprobs_of(want_output)))
        assert response.metrics["grad_norm"] == want_response.metrics["grad_norm"]
        assert all(same(a, b) for a, b in zip(logprobs_of(after), logprobs_of(want_after)))
    assert len({model_a, model_b, model_c}) == 3
    assert (model_dir(server, model_a) / "metrics.jsonl").read_text() == rows_a  # A's history, every row
    for model in (model_b, model_c):
        rows = model_rows(server, model)
        assert [row["train/step"] for row in rows] == [step]
        assert rows[0]["train/grad_norm"] == want_response.metrics["grad_norm"] and rows[0]["applied/grad_clip_norm"] == 0.05
    assert sorted(path.name for path in (server["run_dir"] / "models").iterdir()) == sorted(
        model.replace(":", "_") for model in (model_a, model_b, model_c))
    assert not (server["run_dir"] / "metrics.jsonl").exists()
    # A fourth client, on C's workers kept warm (no checkpoint loaded in between): a new model from the kept workers
    # takes the first client's first two steps (from its fresh build) bitwise
    service_c.close("success").result(timeout=60)
    service_d = tinker.ServiceClient()
    client_d = service_d.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
    model_d = client_d.get_info().model_id
    assert server["terminal"].err.count("tinker_exp.serve: the new model trains on the kept workers (fresh state)") == 1
    for params, want_output, want_response in zip(STEPS[:2], trained["outputs"], trained["responses"]):
        output = client_d.forward_backward(data, "cross_entropy").result()
        assert output.metrics["loss:sum"] == want_output.metrics["loss:sum"]
        assert all(same(a, b) for a, b in zip(logprobs_of(output), logprobs_of(want_output)))
        assert client_d.optim_step(types.AdamParams(**params)).result().metrics["grad_norm"] == want_response.metrics["grad_norm"]
    # SIGTERM while D holds its workers: one line, exit 143, and none of the processes it started (Ray's daemons and
    # agents, its workers) outlive it
    import psutil

    terminal = server["terminal"]
    started = psutil.Process(server["process"].pid).children(recursive=True)
    assert any("raylet" in " ".join(child.cmdline()) for child in started), [c.cmdline()[:2] for c in started]
    server["process"].send_signal(signal.SIGTERM)
    assert terminal.ended(120) == 143, terminal.err[-20:]
    service_d._session_holder.close()  # its heartbeats stop (the server is gone: close() would wait on it)
    assert terminal.err[-1] == f"tinker_exp.serve: stopped (SIGTERM); model {model_d}'s workers freed", terminal.err[-20:]
    assert not any("Traceback" in line or "KeyboardInterrupt" in line or "not the main thread" in line
                   for line in terminal.err + terminal.out)
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive if p.is_running()]
    requests = terminal.requests(f"model {model_c}")
    assert any(f"optim_step model {model_c} seq " in line and ": ok (" in line for line in requests), terminal.out


def test_a_server_open_to_others_or_on_a_runs_dir_is_refused_in_one_line(tmp_path):
    """Before anything starts, each one line naming the key: a host that is not loopback without a key; a host that
    cannot be bound; a port in use; a key the SDK cannot send (never shown, nor a mistyped key's value); serve.run_dir
    holding a training run (its metrics.jsonl and checkpoints). Through the command (exit 2, nothing written) for two;
    the checks __main__ runs first, in this process, for the rest."""
    from helpers import run_module

    from tinker_exp.errors import ConfigError
    from tinker_exp.serve.__main__ import check_access, check_run_dir, listen, serve_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"train/step": 0}\n')
    before = sorted(path.name for path in run.iterdir())
    fresh = tmp_path / "fresh"
    secret = "tml-typed-in-the-wrong-place-0123"
    for args, message in [(["serve.host=0.0.0.0"], "serve.host: '0.0.0.0' is not a loopback address: anyone who reaches the port"),
                          ([f"serve.run_dir={run}", f"serve.apikey={secret}"], "serve.apikey: not a serve key (serve.host, ")]:
        done = run_module("tinker_exp.serve", *args, f"serve.run_dir={fresh}", "logger=none", env={"TINKER_EXP_API_KEY": None})
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert done.stderr.startswith(f"tinker_exp: config error: {message}") and done.stderr.count("\n") == 1, (args, done.stderr)
        assert secret not in done.stderr
    assert not fresh.exists()

    def refusal(*args: str, environ: dict | None = None) -> str:
        with pytest.raises(ConfigError) as refused:
            serve = serve_config(list(args), environ or {})[0]
            check_access(serve)
            check_run_dir(Path(serve.run_dir))
            listen(serve).close()
        return str(refused.value)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            ([f"serve.run_dir={run}"], f"serve.run_dir: '{run}' is a training run's dir (it holds job.json): the served"),
            (["serve.host=203.0.113.7", f"serve.api_key={API_KEY}"], "serve.host: '203.0.113.7' cannot be listened on ("),
            (["serve.host=no-such-host.invalid", f"serve.api_key={API_KEY}"], "serve.host: 'no-such-host.invalid' "),
            ([f"serve.port={port}"], f"serve.port: {port} cannot be listened on (Address already in use; serve.port=0"),
            (["serve.api_key=tml-short"], "serve.api_key: (not shown) is not a key: the SDK sends only keys starting with tml-"),
            ([f"api_key={secret}"], "api_key: not a serve key (serve.host, "),
            ([f"+serve.api_key={secret[:-3]} x"], "serve.api_key: (not shown) is not a key"),
        ]
        for args, message in cases:
            error = refusal(*args)
            assert error.startswith(message) and "\n" not in error, (args, error)
            assert "tml-short" not in error and secret[:-3] not in error and API_KEY not in error
    assert refusal("serve.host=0.0.0.0", environ={"TINKER_EXP_API_KEY": "tml-x"}).startswith(
        "TINKER_EXP_API_KEY: (not shown) is not a key")
    assert serve_config(["serve.host=0.0.0.0"], {"TINKER_EXP_API_KEY": API_KEY})[0].api_key == API_KEY
    assert sorted(path.name for path in run.iterdir()) == before
