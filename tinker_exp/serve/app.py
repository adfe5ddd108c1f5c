"""The HTTP app: the routes the tinker SDK 0.38 calls for training, on one served model (docs/serve.md).

Every training call returns a future (``request_id``) at once; the work runs on one thread, in the order the calls
arrive, and ``retrieve_future`` hands back its result: protobuf for forward_backward, JSON otherwise. A request that
is wrong (malformed protobuf or JSON, an unknown loss, AdamParams out of range, a model id that is not served, a
second model) is refused before it is queued: HTTP 400 with one line naming the field, the workers untouched.
"""


import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from tinker_exp.errors import ConfigError
from tinker_exp.serve.wire import BadRequest, forward_backward_output, forward_backward_request

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
ADAM_PARAMS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
"""Tinker's AdamParams fields: each goes through our converter (tinker_exp.optim), grad_clip_norm to our worker."""
POLL_S = 30.0
"""How long retrieve_future waits for a result before answering try_again (the SDK polls with a 45 s timeout)."""


@dataclass
class Future:
    """One call's result: protobuf bytes or a JSON dict once done, or a one-line error."""

    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    protobuf: bool = False
    error: str | None = None


@dataclass
class Model:
    """The served model: its id (the SDK's own scheme, session_id:train:model_seq_id), LoRA rank and workers."""

    model_id: str
    base_model: str
    lora_rank: int
    workers: Any = None
    step: int = 0
    loss_since_step: float = 0.0


class Server:
    """The state behind the routes: sessions, the one model, futures, and the thread that runs the work in order.

    `build_workers(lora_rank)` starts the worker group (ready on return); `optim_params(adam_params)` converts and
    checks AdamParams as an override is (ConfigError naming the key); `log_row(row)` writes one step's row."""

    def __init__(self, model_name: str, build_workers: Callable[[int], Any], optim_params: Callable[[dict], dict],
                 log_row: Callable[[dict], None], check_applied: Callable[[int, dict, list], dict]):
        self.model_name = model_name
        self.build_workers, self.optim_params, self.log_row, self.check_applied = (
            build_workers, optim_params, log_row, check_applied)
        self.sessions: set[str] = set()
        self.model: Model | None = None
        self.futures: dict[str, Future] = {}
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._run_jobs, name="serve-jobs", daemon=True).start()

    def _run_jobs(self) -> None:
        while True:
            future, work = self.jobs.get()
            try:
                future.result = work()
            except BadRequest as e:
                future.error = str(e)
            except Exception as e:  # a worker's failure: the client is told, the server goes on
                log.exception("serve: a request failed")
                lines = [line for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
                future.error = lines[-1]  # a worker's error: its last line is the exception itself
            future.done.set()

    def submit(self, work: Callable[[], Any], protobuf: bool = False) -> str:
        request_id = str(uuid.uuid4())
        future = Future(protobuf=protobuf)
        self.futures[request_id] = future
        self.jobs.put((future, work))
        return request_id

    def served_model(self, model_id: Any) -> Model:
        if self.model is None or model_id != self.model.model_id:
            raise BadRequest(f"model_id: {model_id!r} is not served here"
                             + (f" (the served model is {self.model.model_id})" if self.model else " (no model yet)"))
        return self.model

    def create_model(self, body: dict) -> str:
        base_model = body.get("base_model")
        if base_model != self.model_name:
            raise BadRequest(f"base_model: {base_model!r} is not served (this server serves {self.model_name!r})")
        lora = body.get("lora_config") or {}
        rank = lora.get("rank", 0) if isinstance(lora, dict) else None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise BadRequest(f"lora_config.rank: {rank!r} is not a rank (an integer >= 0)")
        for flag in ("train_mlp", "train_attn", "train_unembed"):
            if lora.get(flag, True) is not True:
                raise BadRequest(f"lora_config.{flag}: {lora[flag]!r}: only true is served (adapters on every linear layer)")
        with self.lock:
            if self.model is not None:
                raise BadRequest(f"create_model: this server already serves model {self.model.model_id}; one client "
                                 "at a time may hold a model")
            model_id = f"{body.get('session_id')}:train:{body.get('model_seq_id', 0)}"
            self.model = model = Model(model_id, base_model, rank)

        def build() -> dict:
            try:
                model.workers = self.build_workers(rank)
            except BaseException:
                self.model = None
                raise
            return {"model_id": model_id, "type": "create_model"}

        return self.submit(build)

    def forward_backward(self, body: bytes) -> tuple[str, str]:
        request, data = forward_backward_request(body)
        model = self.served_model(request.model_id)

        def run() -> bytes:
            if request.forward_only:  # the SDK's forward(): no gradient, not part of the step's loss
                return forward_backward_output(*model.workers.forward(data))
            loss, logprobs = model.workers.forward_backward(data)
            model.loss_since_step += loss
            return forward_backward_output(loss, logprobs)

        return self.submit(run, protobuf=True), model.model_id

    def optim_step(self, body: dict) -> tuple[str, str]:
        model = self.served_model(body.get("model_id"))
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            raise BadRequest("adam_params: missing (only Adam's parameters are served)")
        unknown = sorted(set(adam) - set(ADAM_PARAMS))
        if unknown:
            raise BadRequest(f"adam_params.{unknown[0]}: not an AdamParams field ({', '.join(ADAM_PARAMS)})")
        try:
            params = self.optim_params({key: adam[key] for key in ADAM_PARAMS if adam.get(key) is not None})
        except ConfigError as e:
            raise BadRequest(str(e).replace("override.", "adam_params.", 1)) from None

        def run() -> dict:
            grad_norm, applied = model.workers.optimizer_step(params)
            first = self.check_applied(model.step, params, applied)
            from tinker_exp.optim import flat_values

            self.log_row({"train/step": model.step, "time": time.time(), "train/loss": model.loss_since_step,
                          "train/grad_norm": grad_norm, **flat_values("requested", params), **flat_values("applied", first)})
            model.step += 1
            model.loss_since_step = 0.0
            return {"metrics": {"grad_norm": grad_norm}, "type": "optim_step"}

        return self.submit(run), model.model_id

    def retrieve(self, request_id: Any) -> Future:
        future = self.futures.get(request_id) if isinstance(request_id, str) else None
        if future is None:
            raise BadRequest(f"request_id: {request_id!r} is not a request of this server")
        future.done.wait(POLL_S)
        return future


def build_app(server: Server):
    """The FastAPI app over `server`: each route parses, checks, and answers (a future, or the value itself)."""
    import json

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    def refused(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": message, "detail": message}, status_code=status)

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        key = request.headers.get("x-api-key", "")
        if request.url.path.startswith("/api/v1/") and not key.startswith("tml-"):
            return refused("X-API-Key: a key starting with tml- is required", 401)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return refused(str(error))

    async def json_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise BadRequest(f"{request.url.path}: the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest(f"{request.url.path}: the body is not a JSON object")
        return body

    def future(request_id: str, model_id: str | None = None) -> dict:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await json_body(request)
        session_id = str(uuid.uuid4())
        server.sessions.add(session_id)
        return {"session_id": session_id, "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await json_body(request)
        if body.get("session_id") not in server.sessions:
            return refused(f"session_id: {body.get('session_id')!r} is not a session of this server", 410)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        """The SDK's `ServiceClient.close(status)`: the session ends; its heartbeats get 410 from now on."""
        if session_id not in server.sessions:
            return refused(f"session_id: {session_id!r} is not a session of this server", 404)
        server.sessions.discard(session_id)
        return None

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        return {"status": "accepted"}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    @app.post("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": server.model_name, "trainable": True, "sampleable": False}]}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        return future(server.create_model(await json_body(request)))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        model = server.served_model((await json_body(request)).get("model_id"))
        return {"type": "get_info", "model_id": model.model_id, "is_lora": model.lora_rank > 0,
                "lora_rank": model.lora_rank or None,
                "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model, "arch": "causal_lm"}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-encoding"):
            raise BadRequest(f"Content-Encoding: {request.headers['content-encoding']!r} is not served (send plain protobuf)")
        return future(*server.forward_backward(await request.body()))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        return future(*server.optim_step(await json_body(request)))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        import asyncio

        request_id = (await json_body(request)).get("request_id")
        done = await asyncio.to_thread(server.retrieve, request_id)
        if not done.done.is_set():
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if done.error is not None:
            return {"error": done.error, "category": "user"}
        if done.protobuf:
            return Response(done.result, media_type=PROTOBUF)
        return done.result

    return app
