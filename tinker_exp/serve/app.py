"""The HTTP app: the routes the tinker SDK 0.38 calls for training, checkpoints and sampling (docs/serve.md).

Every training call returns a future (``request_id``) at once; the work runs on one thread, a model's calls in their
``seq_id`` order (one that arrives early waits for its predecessors), and ``retrieve_future`` hands back its result:
protobuf for forward_backward, JSON otherwise. A request that is wrong (malformed protobuf or JSON, an unknown loss,
non-finite or out-of-range AdamParams, a token id outside the vocabulary, a model id that is not served, a second
model that does not fit beside the held ones) is refused before it is queued: HTTP 400 with one line naming the
field, the workers untouched. Each request is one line on the server's terminal (its method, model, seq_id, time and
outcome), never a traceback. Several clients' LoRA models of one rank train at once, each on a slot of one worker
group (runtime/slots.py: a model's calls give what they give alone); the work thread takes the calls of several
models that wait at once as one cycle (`Cycled`: their cross_entropy forward_backward calls trained in one packed
forward and backward, each model's results within 1e-5 of alone; their optim_steps in one round trip, bitwise); a
fully fine-tuned model trains alone. A
model is its client's session's: when the session ends (``ServiceClient.close``, or no heartbeat for
SESSION_TIMEOUT_S) its slot or workers are freed for the next client. Each model's rows go to its own metrics.jsonl
(<run dir>/models/<model>/).
"""


import hashlib
import hmac
import json
import math
import re
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tinker_exp.errors import ConfigError
from tinker_exp.runtime.serve_workers import FORWARD, FORWARD_BACKWARD, OPTIM_STEP
from tinker_exp.runtime.slots import gather_s
from tinker_exp.serve.wire import (
    BadRequest,
    forward_backward_data,
    forward_backward_output,
    forward_backward_request,
    loss_params,
    prompt_tokens,
    sample_response,
    sampling_limits,
)
from tinker_exp.train.checkpoints import LOOP_STATE, WORKERS, commit_save, problem


PROTOBUF = "application/x-protobuf"
ADAM_PARAMS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
"""Tinker's AdamParams fields: each goes through our converter (tinker_exp.optim), grad_clip_norm to our worker."""
POLL_S = 30.0
"""How long retrieve_future waits for a result before answering try_again (the SDK polls with a 45 s timeout)."""
STATE, SAMPLER = "weights", "sampler_weights"
"""The SDK's checkpoint kinds, as its paths spell them: tinker://<model_id>/weights/<name> (save_state: weights and
optimizer state), tinker://<model_id>/sampler_weights/<name> (save_weights_for_sampler). On disk:
<run dir>/checkpoints/<model_id, colons as _>/<kind>/<name>/ (on_disk)."""
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A checkpoint name as it may go into a path: one folder name, no '/', not '.' or '..'."""
MODEL_ID = re.compile(r"[0-9a-f-]+:train:[0-9]+")
"""A model id as the server makes it (the SDK's scheme: session_id, a uuid4 of ours, :train:model_seq_id, an integer);
on disk its colons are '_' (on_disk()). Anything else in a tinker:// path is refused before it reaches a path."""
ERRORS_LOG = "serve_errors.log"
"""In the run dir: the traceback of each request that failed for a reason of the server's own (its terminal line
names this file)."""
UNCACHED = {"/api/v1/retrieve_future", "/api/v1/session_heartbeat", "/api/v1/telemetry"}
"""Routes answered afresh on every call, whatever their idempotency key (a result that was pending may be ready)."""
FWDBWD_CHUNK_BYTES = 5_000_000
"""The SDK's own bound on a forward_backward chunk's estimated bytes (fwdbwd_max_chunk_bytes_count), told to it as is
unless half of serve.max_body_bytes is less."""
SNAPSHOTS_KEPT = 4
"""Unnamed sampler weights (save_weights_and_get_sampling_client) kept in memory; older ones are dropped."""
SEQ_GAP_TIMEOUT_S = 120.0
"""How long a model's request that arrived early waits for a missing predecessor (its seq_id) before it fails."""
SESSION_TIMEOUT_S = 120.0
"""A session without a heartbeat for this long has ended (the SDK beats every 10 s and warns its user after 120 s)."""
RESULTS_KEPT_S = 900.0
"""How long a finished request's result (its future) and a request's reply by idempotency key are kept after it was
done: the SDK fetches a result at once and retries a lost reply within seconds; kept forever, they would fill memory."""
SEQ_IDS_KEPT = 1024
"""Per model, how many of its latest seq_ids remember their request (a repeat of one gets its result): older ones are
only known to be past."""
SAMPLING_SESSIONS_KEPT = 1024
"""Sampling sessions kept (the oldest dropped first); a client session's own end drops its sampling sessions."""


@dataclass
class Future:
    """One call's result: protobuf bytes or a JSON dict once done, or a one-line error."""

    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    protobuf: bool = False
    error: str | None = None
    label: str = ""
    """The request's line on the terminal: its method, model and seq_id."""
    start: float = field(default_factory=time.monotonic)
    ended: float = 0.0
    """When it was done (time.monotonic): it is pruned RESULTS_KEPT_S later."""
    kept: bool = False
    """Whether its failure's traceback went to the run dir's serve_errors.log."""
    note: str = ""
    """How it ran, when its line should say (a call trained in one cycle with other models')."""


@dataclass
class Model:
    """The served model: its id (the SDK's own scheme, session_id:train:model_seq_id), LoRA rank and workers."""

    model_id: str
    base_model: str
    lora_rank: int
    session_id: str
    """The session of the client that holds it: the model lasts as long as the session."""
    workers: Any = None
    step: int = 0
    loss_since_step: float = 0.0
    next_seq: int = 1
    """The seq_id whose turn it is (the SDK numbers a training client's requests from 1)."""
    waiting: dict[int, tuple[Future, Callable[[], Any]] | None] = field(default_factory=dict)
    """seq_id -> a request that came before its turn (None: one that was refused, whose turn just passes)."""
    sent: dict[int, tuple[str, str, bool]] = field(default_factory=dict)
    """seq_id -> what its request was (a digest of its method and body) and what it got: (digest, request_id, False)
    or (digest, the refusal's line, True); a request sent again (the SDK re-sends one whose reply it lost, with a new
    idempotency key) gets that again. The latest SEQ_IDS_KEPT."""
    created: str = ""
    """The request_id of the create_model (or load_weights) that made it: the same call again gets it."""
    rows: Any = None
    """Its own metrics.jsonl (open_rows), opened at its first row: no other model's rows are ever touched."""


@dataclass
class Cycled:
    """A model's call that trains in one cycle with other models' calls of its kind waiting at once.

    The work thread's `_cycle` takes them, where its workers allow (`workers.cycle`): forward_backward, forward or
    optim_step."""

    call: str
    """FORWARD_BACKWARD, FORWARD or OPTIM_STEP."""
    loss: str
    """Tinker's loss of a forward_backward or forward ('' for an optim_step)."""
    args: Any
    """What the workers take: the datums, or the optim_step's params."""
    alone: Callable[[], Any]
    """The call on its own (time-shared): its request's result."""
    done: Callable[[Any], Any]
    """Its request's result from its part of a cycle's (what the workers' call alone returns)."""

    def __call__(self) -> Any:
        return self.alone()


@dataclass(eq=False)  # each job is itself: a cycle takes exactly the ones it found off the queue
class Job:
    """Work queued for the work thread."""

    future: Future
    work: Callable[[], Any]
    model: Model | None = None
    """The model whose request it is: a cycle takes a model's call only when none of its earlier work waits."""


def on_disk(model_id: str) -> str:
    """A model id as a folder name: its colons are '_' (a path with a colon is host:path to scp and rsync)."""
    return model_id.replace(":", "_")


class Server:
    """The state behind the routes: sessions, the held models, futures, and the thread that runs the work in order.

    `build_workers(lora_rank, model_id)` gives a model its workers (ready on return: a LoRA model's slot, or a
    group); `optim_params(adam_params)` converts and checks AdamParams as an override is (ConfigError naming the key)."""

    def __init__(self, model_name: str, build_workers: Callable[[int], Any], optim_params: Callable[[dict], dict],
                 open_rows: Callable[[Path, int], Any], check_applied: Callable[[int, dict, list], dict],
                 run_dir: Path, make_sampler: Callable[[], Any], max_chunk_datums: int = 1024,
                 seq_gap_timeout_s: float = SEQ_GAP_TIMEOUT_S, session_timeout_s: float = SESSION_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, vocab_size: int | None = None,
                 tokenizer_id: str | None = None, say: Callable[[str], None] | None = None,
                 positions: int | None = None, max_num_samples: int = 128, max_body_bytes: int = 32 << 20,
                 results_kept_s: float = RESULTS_KEPT_S, slots: int = 1):
        """The Tinker server's state, from the driver's callables and the serve.* settings.

        `open_rows(folder, first_step)`: a model's metrics sink in its folder (a JsonlSink: its rows of first_step and
        later are replaced); `run_dir`: where models/<model>/ and checkpoints/<model>/ go; `make_sampler()`: the
        driver's sampler (runtime/serve_sampler.py); `max_chunk_datums`: the most datums the SDK is asked to send in one
        forward_backward (serve.max_chunk_datums); `clock`: the time sessions' heartbeats are kept in; `vocab_size`:
        token ids at or beyond it are refused; `tokenizer_id`: get_info's (what the SDK's get_tokenizer loads: the
        model's local dir); `say(line)`: a line on the terminal, one per request; `positions`: the model's positions (a
        longer datum in forward_backward is refused); `max_num_samples`, `max_body_bytes`: serve.max_num_samples,
        serve.max_body_bytes (__main__.ServeConfig); `slots`: how many LoRA models of one rank are held at once
        (serve.slots)."""
        self.model_name = model_name
        self.build_workers, self.optim_params, self.open_rows, self.check_applied = (
            build_workers, optim_params, open_rows, check_applied)
        self.run_dir, self.checkpoints, self.make_sampler = run_dir, run_dir / "checkpoints", make_sampler
        self.max_chunk_datums, self.vocab_size, self.tokenizer_id = max_chunk_datums, vocab_size, tokenizer_id or model_name
        self.say = say or (lambda line: print(line, flush=True))
        self.seq_gap_timeout_s, self.session_timeout_s, self.clock = seq_gap_timeout_s, session_timeout_s, clock
        self.positions, self.max_num_samples, self.max_body_bytes = positions, max_num_samples, max_body_bytes
        self.sampler: Any = None
        self.sampling_sessions: dict[str, dict[str, Any]] = {}
        """sampling_session_id -> its base model, model_path (None: the base model's weights), where its weights
        are (a sampler checkpoint's folder, or tensors in memory: an unnamed save) and its client's session (owner).
        In creation order: the oldest beyond SAMPLING_SESSIONS_KEPT are dropped."""
        self.snapshots: list[str] = []
        self.replies: dict[tuple[str, str, str], tuple] = {}
        """(route, X-Idempotency-Key, the body's digest) -> the answer it got (body, status, headers, media type) and
        when (pruned RESULTS_KEPT_S later): a key sent again with another body or route is another request."""
        self.results_kept_s, self.pruned_at = results_kept_s, time.monotonic()
        self.sessions: dict[str, float] = {}
        """session_id -> the time of its last heartbeat (or its start)."""
        self.slots = slots
        self.models: dict[str, Model] = {}
        """model_id -> a model a live session holds: LoRA models of one rank, `slots` of them at most, or one fully
        fine-tuned model alone."""
        self.futures: dict[str, Future] = {}
        self.jobs: deque[Job] = deque()
        self.jobs_changed = threading.Condition()
        self.served: set[str] = set()
        """The models whose calls the last cycle (or a call alone) ran: the next waits a moment for their next ones."""
        self.last_cycle_s = 0.0
        self.said: set[str] = set()  # why a call runs alone, each reason said once
        self.lock = threading.RLock()
        threading.Thread(target=self._run_jobs, name="serve-jobs", daemon=True).start()

    def _queue(self, job: Job) -> None:
        with self.jobs_changed:
            self.jobs.append(job)
            self.jobs_changed.notify_all()

    def _run_jobs(self) -> None:
        while True:
            with self.jobs_changed:
                while not self.jobs:
                    self.jobs_changed.wait()
                job = self.jobs.popleft()
                try:
                    self._gather(job)
                    cycle = self._cycle(job)
                except Exception:  # noqa: BLE001 (the work thread must go on: the call runs alone, the cause kept)
                    self.keep_traceback(f"{job.future.label} (choosing its cycle)")
                    cycle = []
            began = time.monotonic()
            if cycle:
                self._run_cycle(job, cycle)
            else:
                try:
                    job.future.result = job.work()
                except BaseException:  # noqa: BLE001 (said on the future: the server goes on)
                    self._failed(job.future)
                self._done(job.future)
            if isinstance(job.work, Cycled) and job.model is not None:
                self.served = {each.model.model_id for each in [job, *cycle]}
                self.last_cycle_s = time.monotonic() - began

    def _gather(self, job: Job) -> None:
        """Before `job`'s cycle is chosen: wait a moment for the next call of each model the last cycle served.

        Called under jobs_changed. The other models' calls are waited for: a client awaiting each result sends its next
        call as its last returns: `gather_s` of the last cycle's time, at most 50 ms, so that clients in step keep
        training in one cycle."""
        if not isinstance(job.work, Cycled) or job.model is None:
            return
        others = self.served - {job.model.model_id}
        until = time.monotonic() + gather_s(self.last_cycle_s)
        while others - {each.model.model_id for each in self.jobs if each.model is not None}:
            left = until - time.monotonic()
            if left <= 0:
                return
            self.jobs_changed.wait(left)

    def _cycle(self, job: Job) -> list[Job]:
        """Under jobs_changed: the other models' calls that train with `job`'s in one cycle, taken off the queue.

        Each model's first waiting work, when it is a call of the same kind on the same group (as SlotGroup's cycle:
        whatever waits once `_gather` has waited its moment). [] when `job` runs alone."""
        if not isinstance(job.work, Cycled) or job.model is None or job.model.workers is None:
            return []
        group, why = job.model.workers.cycle(job.work.call, job.work.loss)
        if why is not None and why not in self.said:
            self.said.add(why)
            self.say(f"tinker_exp.serve: {why}")
        if group is None:
            return []
        taken, passed = [], {job.model.model_id}  # a model whose earlier work waits (or already in the cycle)
        for other in self.jobs:
            if other.model is None or other.model.model_id in passed:
                continue
            passed.add(other.model.model_id)
            work = other.work
            if (isinstance(work, Cycled) and (work.call, work.loss) == (job.work.call, job.work.loss)
                    and other.model.workers is not None and other.model.workers.cycle(work.call, work.loss)[0] is group):
                taken.append(other)
        for other in taken:
            self.jobs.remove(other)
        return taken

    def _run_cycle(self, job: Job, others: list[Job]) -> None:
        """`job`'s call and `others`' in one cycle on their group: each request its own result."""
        jobs = [job, *others]
        group = job.model.workers.cycle(job.work.call, job.work.loss)[0]
        calls = [(each.model.workers, each.work.args) for each in jobs]
        try:
            if job.work.call == OPTIM_STEP:
                results = group.optimizer_steps(calls)
            else:
                results = group.forward_backward_together(calls, forward_only=job.work.call == FORWARD)
        except BaseException:  # noqa: BLE001 (each request of the cycle fails with it)
            for each in jobs:
                self._failed(each.future)
                self._done(each.future)
            return
        others = len(jobs) - 1
        for each, result in zip(jobs, results, strict=True):
            each.future.note = f"in one cycle with {others} other model{'s' if others > 1 else ''}'{'' if others > 1 else 's'} {job.work.call}"
            try:
                each.future.result = each.work.done(result)
            except BaseException:  # noqa: BLE001
                self._failed(each.future)
            self._done(each.future)

    def _failed(self, future: Future) -> None:
        """Inside an except: its request failed.

        A BadRequest: that line; else a worker's failure: its last line, the traceback kept in the run dir."""
        import sys

        error = sys.exc_info()[1]
        if isinstance(error, BadRequest):
            future.error = str(error)
            return
        if not isinstance(error, Exception):
            raise error
        lines = [line for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
        future.error = lines[-1]  # a worker's error: its last line is the exception itself
        self.keep_traceback(future.label)
        future.kept = True

    def keep_traceback(self, label: str) -> None:
        """The traceback of a failure of the server's own, into the run dir's serve_errors.log (never the terminal)."""
        import traceback

        with open(self.run_dir / ERRORS_LOG, "a", encoding="utf-8") as errors:
            errors.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {label}\n{traceback.format_exc()}\n")

    def _done(self, future: Future, error: str | None = None) -> None:
        """A request is over: its future is set, and its line said (ok, or failed with its error)."""
        if error is not None:
            future.error = error
        future.ended = time.monotonic()
        future.done.set()
        if future.label:
            ms = (time.monotonic() - future.start) * 1e3
            note = f", {future.note}" if future.note else ""
            failed = f"failed ({ms:.0f} ms{note}): {future.error}" if future.error is not None else f"ok ({ms:.0f} ms{note})"
            self.say(f"tinker_exp.serve: {future.label}: {failed}"
                     + (f" (traceback in {self.run_dir / ERRORS_LOG})" if future.kept else ""))

    def _future(self, protobuf: bool, label: str = "") -> tuple[str, Future]:
        self.prune()
        request_id = str(uuid.uuid4())
        future = self.futures[request_id] = Future(protobuf=protobuf, label=label)
        return request_id, future

    def prune(self, now: bool = False) -> None:
        """Forget what no client will ask for again (at most once a second, unless `now`).

        Results and replies done more than results_kept_s ago, sessions past their heartbeat timeout (their models
        released)."""
        if not now and time.monotonic() - self.pruned_at < 1.0:
            return
        self.pruned_at = time.monotonic()
        old = self.pruned_at - self.results_kept_s
        with self.lock:
            for request_id in [r for r, f in self.futures.items() if f.done.is_set() and f.ended < old]:
                del self.futures[request_id]
            for key in [k for k, reply in self.replies.items() if reply[-1] < old]:
                del self.replies[key]
            for session_id in list(self.sessions):
                self.live_session(session_id)  # one past its timeout ends here

    def reply(self, route: str, key: str, body: bytes) -> tuple | None:
        """The answer a request with this idempotency key, route and body got (None: it is new)."""
        return self.replies.get((route, key, hashlib.sha256(body).hexdigest()))

    def keep_reply(self, route: str, key: str, body: bytes, answer: tuple) -> None:
        self.replies[(route, key, hashlib.sha256(body).hexdigest())] = (*answer, time.monotonic())

    def submit(self, work: Callable[[], Any], protobuf: bool = False, label: str = "", model: Model | None = None) -> str:
        """Queue `work` now (a request outside any model's sequence); `label`: its line on the terminal.

        `model`: the model it builds or frees, whose later calls no cycle takes before it."""
        request_id, future = self._future(protobuf, label)
        self._queue(Job(future, work, model))
        return request_id

    def in_turn(self, model: Model, seq_id: Any, check: Callable[[], Callable[[], Any]], protobuf: bool = False,
                method: str = "", body: Any = None) -> str:
        """A model's request, queued in the model's seq_id order once `check()` gives its work.

        `check()` refuses it (BadRequest) or gives its work, which is queued in the model's seq_id order: one that comes
        early waits for its predecessors (SEQ_GAP_TIMEOUT_S at most). Without a seq_id (not the SDK), the work is queued
        at once. A refused request's turn passes: its successors need not wait. `body` (a JSON dict or protobuf bytes):
        the request as sent; the same method and body sent again with its seq_id gets what the first got (its future, or
        its refusal), never a second run; another body, a 400."""
        label = f"{method} model {model.model_id} seq {seq_id}" if method else ""
        if seq_id is None:
            return self.submit(check(), protobuf, label, model)
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
            raise BadRequest(f"seq_id: {seq_id!r} is not a sequence number (an integer >= 1)")
        digest = hashlib.sha256(method.encode() + b"\0" + (
            body if isinstance(body, bytes) else json.dumps(body, sort_keys=True).encode())).hexdigest()
        with self.lock:
            if seq_id in model.sent and model.sent[seq_id][0] == digest:  # sent again: the first one's answer
                _, answer, refused = model.sent[seq_id]
                if refused:
                    raise BadRequest(answer)
                return answer
            if seq_id < model.next_seq or model.waiting.get(seq_id) is not None:
                raise BadRequest(f"seq_id: {seq_id} of model {model.model_id} was sent before with another request "
                                 f"(its turn is {'past' if seq_id < model.next_seq else 'taken'}; the next is "
                                 f"{model.next_seq})")
            try:
                work = check()
            except BadRequest as refusal:
                self._sent(model, seq_id, (digest, str(refusal), True))
                self._take_turn(model, seq_id, None)
                raise
            request_id, future = self._future(protobuf, label)
            self._sent(model, seq_id, (digest, request_id, False))
            self._take_turn(model, seq_id, (future, work))
        return request_id

    @staticmethod
    def _sent(model: Model, seq_id: int, what: tuple[str, str, bool]) -> None:
        model.sent[seq_id] = what
        while len(model.sent) > SEQ_IDS_KEPT:
            del model.sent[next(iter(model.sent))]  # the earliest sent

    def _take_turn(self, model: Model, seq_id: int, request: tuple[Future, Callable[[], Any]] | None) -> None:
        """Place a request at its seq_id, then queue every request whose turn has come."""
        model.waiting[seq_id] = request
        while model.next_seq in model.waiting:
            due = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            if due is not None:
                self._queue(Job(*due, model))
        if model.waiting.get(seq_id) is not None:
            timer = threading.Timer(self.seq_gap_timeout_s, self._gap_timed_out, (model, seq_id))
            timer.daemon = True
            timer.start()

    def _gap_timed_out(self, model: Model, seq_id: int) -> None:
        """A request waited SEQ_GAP_TIMEOUT_S for a predecessor that never came.

        Every waiting request of the model fails (none may run out of order), and the sequence goes on after the last of
        them."""
        with self.lock:
            if model.waiting.get(seq_id) is None:
                return
            missing, last = model.next_seq, max(s for s, r in model.waiting.items() if r is not None)
            for waiting in sorted(s for s in model.waiting if s <= last):
                request = model.waiting.pop(waiting)
                if request is not None:
                    self._done(request[0], f"seq_id: {waiting} of model {model.model_id} waited "
                                           f"{self.seq_gap_timeout_s:g} s for seq_id {missing}, which never came")
            model.next_seq = last + 1

    def served_model(self, model_id: Any) -> Model:
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None:
            raise BadRequest(f"model_id: {model_id!r} is not served here"
                             + (f" (served: {', '.join(self.models)})" if self.models else " (no model yet)"))
        return model

    def start_session(self) -> str:
        session_id = str(uuid.uuid4())
        self.sessions[session_id] = self.clock()
        return session_id

    def live_session(self, session_id: Any) -> bool:
        """Whether the session goes on (a heartbeat within SESSION_TIMEOUT_S); one that stopped beating ends now."""
        with self.lock:
            if session_id not in self.sessions:
                return False
            if self.clock() - self.sessions[session_id] > self.session_timeout_s:
                self.end_session(session_id)
                return False
            return True

    def heartbeat(self, session_id: Any) -> bool:
        """A session's heartbeat: False when the session has ended (the SDK stops beating on the 410 it gets)."""
        with self.lock:
            if not self.live_session(session_id):
                return False
            self.sessions[session_id] = self.clock()
            return True

    def end_session(self, session_id: str) -> None:
        """The session ends (finished by its client, or its heartbeats stopped): the models it holds are released.

        Their waiting requests fail, their slots or workers are freed once their queued work is done."""
        with self.lock:
            self.sessions.pop(session_id, None)
            for dropped in [s for s, held in self.sampling_sessions.items() if held["owner"] == session_id]:
                del self.sampling_sessions[dropped]
            released = [model for model in self.models.values() if model.session_id == session_id]
            for model in released:
                del self.models[model.model_id]
                for request in model.waiting.values():
                    if request is not None:
                        self._done(request[0], f"model_id: {model.model_id} was released (its session {session_id} ended)")
                model.waiting.clear()

        for model in released:
            self.submit(lambda model=model: self._free(model) or {}, model=model)

    @staticmethod
    def _free(model: Model) -> None:
        if model.rows is not None:
            model.rows.close()
            model.rows = None
        if model.workers is not None:
            model.workers.shutdown()
            model.workers = None

    def close(self) -> list[str]:
        """The server stops (Ctrl-C, SIGTERM): the held models' workers are freed now; their ids."""
        with self.lock:
            models, self.models = list(self.models.values()), {}
            for future in self.futures.values():  # no retrieve_future poll keeps the process from ending
                if not future.done.is_set():
                    future.error = "the server stopped"
                    future.done.set()
        for model in models:
            self._free(model)
        return [model.model_id for model in models]

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
        model = self._claim("create_model", body, base_model, rank)
        if isinstance(model, str):
            return model

        def build() -> dict:
            self._build(model)
            return {"model_id": model.model_id, "type": "create_model"}

        model.created = self.submit(build, label=f"create_model model {model.model_id} rank {rank}", model=model)
        return model.created

    def _claim(self, route: str, body: dict, base_model: str, rank: int) -> Model | str:
        """A new model for this client's session, if it fits beside the held ones (`_no_room`); else refused.

        The model's id is the SDK's: session_id:train:model_seq_id. The same call sent again (the SDK re-sends one whose
        reply it lost): the request_id the first one got."""
        session_id, seq = body.get("session_id"), body.get("model_seq_id", 0)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:  # it goes into the model's folder names
            raise BadRequest(f"model_seq_id: {seq!r} is not a model_seq_id (an integer >= 0: the SDK's count of "
                             "its training clients)")
        model_id = f"{session_id}:train:{seq}"
        with self.lock:
            held = self.models.get(model_id)
            if held is not None:
                if held.created:
                    return held.created
                raise BadRequest(f"{route}: model {model_id} is being created (the same call came twice at once)")
            for other in list(self.models.values()):  # a holder whose heartbeats stopped ends here, its models too
                self.live_session(other.session_id)
            refusal = self._no_room(rank)
            if refusal:
                raise BadRequest(f"{route}: {refusal}")
            if not self.live_session(session_id):
                raise BadRequest(f"session_id: {session_id!r} is not a session of this server (create_session first)")
            model = self.models[model_id] = Model(model_id, base_model, rank, session_id)
            return model

    def _no_room(self, rank: int) -> str:
        """Why a model of LoRA rank `rank` cannot be held now ('' when it can).

        LoRA models of one rank share one group, each on a slot, `slots` at most; a fully fine-tuned model (rank 0)
        holds its group alone."""
        held = list(self.models.values())
        if not held or (rank and all(model.lora_rank == rank for model in held) and len(held) < self.slots):
            return ""
        if not rank or not held[0].lora_rank:
            why = "a fully fine-tuned model (LoRA rank 0) trains alone"
        elif held[0].lora_rank != rank:
            why = f"its workers train LoRA rank {held[0].lora_rank} models; a rank {rank} model waits until they are freed"
        else:
            why = f"all {self.slots} slots (serve.slots) hold a model"
        left = min(self.session_timeout_s - (self.clock() - self.sessions[model.session_id]) for model in held)
        return (f"this server already serves model{'s' if len(held) > 1 else ''} {', '.join(m.model_id for m in held)}; "
                f"{why}. {'One' if len(held) > 1 else 'It'} is freed when its client closes its ServiceClient, or "
                f"{self.session_timeout_s:g} s after that client's last heartbeat (in {max(left, 0):.0f} s at most if "
                "it has stopped)")

    def _build(self, model: Model) -> None:
        try:
            model.workers = self.build_workers(model.lora_rank, model.model_id)
        except BaseException:
            with self.lock:
                if self.models.get(model.model_id) is model:
                    del self.models[model.model_id]
            raise

    def forward_backward(self, request: Any) -> tuple[str, str]:
        """A parsed ForwardBackwardRequest (wire.forward_backward_request)."""
        model = self.served_model(request.model_id)

        def check() -> Callable[[], bytes]:
            if len(request.data) > self.max_chunk_datums:
                raise BadRequest(f"data: {len(request.data)} datums exceed serve.max_chunk_datums="
                                 f"{self.max_chunk_datums} (the most in one request; the SDK splits a batch into "
                                 "chunks of that many)")
            data, params = forward_backward_data(request, self.vocab_size), loss_params(request)
            longest = max(range(len(data)), key=lambda i: len(data[i].tokens))
            if self.positions is not None and len(data[longest].tokens) > self.positions:
                raise BadRequest(f"data[{longest}]: {len(data[longest].tokens) - 1} tokens and the last target exceed "
                                 f"the model's {self.positions} positions (max_position_embeddings)")

            def alone() -> bytes:
                model.workers.use_loss(request.loss_fn, params)
                if request.forward_only:  # the SDK's forward(): no gradient, not part of the step's loss
                    return done(model.workers.forward(data))
                return done(model.workers.forward_backward(data))

            def done(result: tuple[float, list[list[float]]]) -> bytes:
                if not request.forward_only:
                    model.loss_since_step += result[0]
                return forward_backward_output(*result)

            # an RL loss never packs: its workers say so (`cycle`)
            return Cycled(FORWARD if request.forward_only else FORWARD_BACKWARD, request.loss_fn, data, alone, done)

        # seq_id 0: none (the proto's default; the SDK numbers from 1)
        method = "forward" if request.forward_only else "forward_backward"
        return self.in_turn(model, request.seq_id or None, check, True, method,
                            request.SerializeToString(deterministic=True)), model.model_id

    def optim_step(self, body: dict) -> tuple[str, str]:
        model = self.served_model(body.get("model_id"))

        def check() -> Callable[[], dict]:
            adam = body.get("adam_params")
            if not isinstance(adam, dict):
                raise BadRequest("adam_params: missing (only Adam's parameters are served)")
            unknown = sorted(set(adam) - set(ADAM_PARAMS))
            if unknown:
                raise BadRequest(f"adam_params.{unknown[0]}: not an AdamParams field ({', '.join(ADAM_PARAMS)})")
            for key in ADAM_PARAMS:
                value = adam.get(key, 0.0)
                if value is None:  # the SDK sends every field: null is a NaN or infinity that JSON could not carry
                    raise BadRequest(f"adam_params.{key}: null is not a number (NaN and infinities arrive as null)")
                if isinstance(value, float) and not math.isfinite(value):
                    raise BadRequest(f"adam_params.{key}: {value!r} is not a finite number")
            try:
                params = self.optim_params({key: adam[key] for key in ADAM_PARAMS if adam.get(key) is not None})
            except ConfigError as e:
                raise BadRequest(str(e).replace("override.", "adam_params.", 1)) from None

            def done(result: tuple[float, list]) -> dict:
                grad_norm, applied = result
                first = self.check_applied(model.step, params, applied)
                from tinker_exp.optim import flat_values

                self._rows(model).log({"train/step": model.step, "time": time.time(), "train/loss": model.loss_since_step,
                              "train/grad_norm": grad_norm, **flat_values("requested", params), **flat_values("applied", first)})
                model.step += 1
                model.loss_since_step = 0.0
                return {"metrics": {"grad_norm": grad_norm}, "type": "optim_step"}

            return Cycled(OPTIM_STEP, "", params, lambda: done(model.workers.optimizer_step(params)), done)

        return self.in_turn(model, body.get("seq_id"), check, method="optim_step", body=body), model.model_id

    def _rows(self, model: Model) -> Any:
        """The model's own metrics sink, opened at its served step (a rewound model's later rows are replaced)."""
        if model.rows is None:
            model.rows = self.open_rows(self.inside(self.run_dir / "models" / on_disk(model.model_id)), model.step)
        return model.rows

    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        return self.inside(self.checkpoints / on_disk(model_id) / kind / name)

    def inside(self, path: Path) -> Path:
        """`path`, which must be inside the run dir once resolved.

        The ids and names in it were checked: this is the last guard against a client's name leading elsewhere."""
        if not path.resolve().is_relative_to(self.run_dir.resolve()):
            raise BadRequest(f"path: {str(path)!r} is outside the server's run dir")
        return path

    @staticmethod
    def _name(name: Any) -> str:
        if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
            raise BadRequest(f"path: {name!r} is not a checkpoint name (letters, digits, '_', '-', '.'; no '/')")
        return name

    def _checkpoint(self, path: Any, kind: str, field: str = "path") -> tuple[Path, dict]:
        """A tinker:// path of this server's -> its folder and loop.json; anything else a one-line BadRequest."""
        parts = path.removeprefix("tinker://").split("/") if isinstance(path, str) and path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != kind or not MODEL_ID.fullmatch(parts[0]) or not CHECKPOINT_NAME.fullmatch(parts[2]):
            raise BadRequest(f"{field}: {path!r} is not a checkpoint path (tinker://<model_id>/{kind}/<name>)")
        folder = self._folder(parts[0], kind, parts[2])
        if not folder.is_dir():
            raise BadRequest(f"{field}: {path!r}: no such checkpoint on this server")
        why = problem(folder)
        if why is not None:
            raise BadRequest(f"{field}: {path!r}: {why}")
        return folder, json.loads((folder / LOOP_STATE).read_text())

    def _save(self, model: Model, folder: Path, write: Callable[[Path], None]) -> None:
        """`write(tmp)` fills a fresh folder beside `folder`, renamed into place after its manifest.

        The manifest is train/checkpoints.py's. A save that fails leaves no checkpoint of that name."""
        tmp = folder.with_name(f".{folder.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        meta = {"model_id": model.model_id, "base_model": model.base_model, "lora_rank": model.lora_rank}
        commit_save(tmp, model.step, meta, final=folder)

    def save_state(self, body: dict) -> tuple[str, str]:
        """save_state: the weights and the optimizer's state (every rank's verl checkpoint) at this step."""
        model = self.served_model(body.get("model_id"))

        def check() -> Callable[[], dict]:
            name = self._name(body.get("path"))
            folder = self._folder(model.model_id, STATE, name)
            if folder.exists() and body.get("overwrite") is not True:
                raise BadRequest(f"path: {name!r}: model {model.model_id} has a checkpoint of that name "
                                 "(overwrite=true replaces it)")

            def run() -> dict:
                self._save(model, folder, lambda tmp: model.workers.save_state(tmp / WORKERS, model.step))
                return {"path": f"tinker://{model.model_id}/{STATE}/{name}", "type": "save_weights"}

            return run

        return self.in_turn(model, body.get("seq_id"), check, method="save_state", body=body), model.model_id

    def load_state(self, body: dict) -> tuple[str, str]:
        """load_state (weights, a fresh optimizer) or load_state_with_optimizer (`optimizer`: true), onto a model.

        Onto the client's model (model_id) or onto a new one (session_id, model_seq_id:
        create_training_client_from_state), built with the checkpoint's LoRA rank."""
        optimizer, path = body.get("optimizer"), body.get("path")

        def checked(model: Model | None) -> tuple[Path, dict]:
            if not isinstance(optimizer, bool):
                raise BadRequest(f"optimizer: {optimizer!r} is not true or false")
            folder, meta = self._checkpoint(path, STATE)
            if model is not None and meta["lora_rank"] != model.lora_rank:
                raise BadRequest(f"path: {path!r} holds a model of LoRA rank {meta['lora_rank']}; model "
                                 f"{model.model_id} has rank {model.lora_rank}")
            return folder, meta

        def load(model: Model, folder: Path, meta: dict) -> Callable[[], dict]:
            def run() -> dict:
                if model.workers is None:
                    self._build(model)
                model.workers.load_state(folder / WORKERS, optimizer)
                model.step, model.loss_since_step = int(meta["step"]), 0.0
                if model.rows is not None:  # this model's rows of this step and later are logged again
                    model.rows.close()
                    model.rows = None
                return {"path": path, "model_id": model.model_id, "type": "load_weights"}

            return run

        if body.get("model_id") is not None:  # the client's own model (TrainingClient.load_state): in its turn
            model = self.served_model(body["model_id"])
            return (self.in_turn(model, body.get("seq_id"), lambda: load(model, *checked(model)), method="load_state",
                                 body=body), model.model_id)
        folder, meta = checked(None)  # a new model (ServiceClient.create_training_client_from_state)
        base_model = body.get("base_model") or meta["base_model"]
        if base_model != self.model_name:
            raise BadRequest(f"base_model: {base_model!r} is not served (this server serves {self.model_name!r})")
        model = self._claim("load_weights", body, base_model, meta["lora_rank"])
        if isinstance(model, str):
            return model, f"{body.get('session_id')}:train:{body.get('model_seq_id', 0)}"
        model.created = self.submit(load(model, folder, meta), label=f"load_state model {model.model_id} (new)", model=model)
        return model.created, model.model_id

    def _sampler(self):
        if self.sampler is None:
            self.sampler = self.make_sampler()
        return self.sampler

    def save_for_sampler(self, body: dict) -> tuple[str, str]:
        """save_weights_for_sampler(name): the weights as a sampler checkpoint, or in memory without a name.

        With a name: tinker://.../sampler_weights/name. Without a name (save_weights_and_get_sampling_client): a
        sampling session on these weights, in memory."""
        model = self.served_model(body.get("model_id"))
        return (self.in_turn(model, body.get("seq_id"), lambda: self._sampler_save(model, body),
                             method="save_weights_for_sampler", body=body), model.model_id)

    def _sampler_save(self, model: Model, body: dict) -> Callable[[], dict]:
        name = body.get("path")
        if name is not None:
            folder = self._folder(model.model_id, SAMPLER, self._name(name))

            def save() -> dict:
                self._save(model, folder, lambda tmp: self._sampler().write(model.workers, tmp, model.lora_rank))
                return {"path": f"tinker://{model.model_id}/{SAMPLER}/{name}", "type": "save_weights_for_sampler"}

            return save
        seq = body.get("sampling_session_seq_id")
        session_id = f"{model.model_id}:sample:{seq}:{uuid.uuid4().hex[:8]}"

        def snapshot() -> dict:
            import tempfile

            with tempfile.TemporaryDirectory(dir=self.checkpoints.parent) as tmp:
                self._sampler().write(model.workers, Path(tmp), model.lora_rank)
                tensors = self._sampler().weights(Path(tmp))
            self._open_sampling_session(session_id, model.base_model, None, tensors, model.session_id)
            self.snapshots.append(session_id)
            for dropped in self.snapshots[:-SNAPSHOTS_KEPT]:  # a sample already queued holds its own reference
                if dropped in self.sampling_sessions:
                    self.sampling_sessions[dropped]["weights"] = None
            del self.snapshots[:-SNAPSHOTS_KEPT]
            return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}

        return snapshot

    def _open_sampling_session(self, session_id: str, base_model: str, model_path: str | None, weights: Any,
                               owner: Any) -> None:
        with self.lock:
            self.sampling_sessions[session_id] = {"base_model": base_model, "model_path": model_path,
                                                  "weights": weights, "owner": owner}
            while len(self.sampling_sessions) > SAMPLING_SESSIONS_KEPT:
                del self.sampling_sessions[next(iter(self.sampling_sessions))]  # the oldest

    def create_sampling_session(self, body: dict) -> str:
        """A sampling session on a sampler checkpoint (model_path) or on the base model."""
        model_path, base_model = body.get("model_path"), body.get("base_model")
        if model_path is not None:
            folder, meta = self._checkpoint(model_path, SAMPLER, "model_path")
            base_model, weights = meta["base_model"], folder
        elif base_model != self.model_name:
            raise BadRequest(f"base_model: {base_model!r} is not served (this server serves {self.model_name!r})")
        else:
            weights = "base"
        session_id = f"{body.get('session_id')}:sample:{body.get('sampling_session_seq_id')}:{uuid.uuid4().hex[:8]}"
        self._open_sampling_session(session_id, base_model, model_path, weights, body.get("session_id"))
        return session_id

    def sampling_session(self, session_id: Any) -> dict:
        session = self.sampling_sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise BadRequest(f"sampling_session_id: {session_id!r} is not a sampling session of this server")
        return session

    def sample(self, body: dict) -> tuple[str, list[str]]:
        """asample: num_samples responses to the prompt from the session's weights.

        SamplingParams max_tokens, temperature (> 0), seed, stop (strings or token ids), top_k and top_p, and the
        prompt's log-probs."""
        session_id = body.get("sampling_session_id")
        session = self.sampling_session(session_id)
        weights = session["weights"]  # held from here: a save queued before this sample may drop the session's
        if weights is None:
            raise BadRequest(f"sampling_session_id: {session_id!r}: its weights were dropped (the server keeps the "
                             f"last {SNAPSHOTS_KEPT} unnamed snapshots; save_weights_for_sampler(name) keeps them)")
        prompt = prompt_tokens(body.get("prompt"), vocab_size=self.vocab_size)
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise BadRequest(f"num_samples: {n!r} is not a count (an integer >= 1)")
        if n > self.max_num_samples:
            raise BadRequest(f"num_samples: {n} exceeds serve.max_num_samples={self.max_num_samples}")
        params = body.get("sampling_params") or {}
        max_tokens, temperature, seed = params.get("max_tokens"), params.get("temperature", 1.0), params.get("seed")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"sampling_params.max_tokens: {max_tokens!r} is not a count (an integer >= 1)")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise BadRequest(f"sampling_params.temperature: {temperature!r} is not served (a number > 0)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(f"sampling_params.seed: {seed!r} is not an integer")
        limits = sampling_limits(params)
        with_prompt = body.get("prompt_logprobs") or False
        if not isinstance(with_prompt, bool):
            raise BadRequest(f"prompt_logprobs: {with_prompt!r} is not true or false")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs",
                    "prompt_logprobs_last_n"):
            if body.get(key):
                raise BadRequest(f"{key}: {body[key]!r} is not served")

        def run() -> bytes:
            sampler = self._sampler()
            if len(prompt) + max_tokens > sampler.positions:
                raise BadRequest(f"sampling_params.max_tokens: the prompt's {len(prompt)} tokens + {max_tokens} exceed "
                                 f"the model's {sampler.positions} positions")
            if weights == "base":
                sampler.use("base", sampler.base)
            elif isinstance(weights, Path):
                sampler.use(weights, lambda: sampler.weights(weights))
            else:
                sampler.use(session_id, weights)
            samples = sampler.sample(prompt, n, max_tokens, float(temperature), seed, **limits)
            return sample_response(samples, sampler.prompt_log_probs(prompt) if with_prompt else None)

        request_id = self.submit(run, protobuf=True, label=f"sample session {session_id} seq {body.get('seq_id')}")
        return request_id, [f"{request_id}:{i}" for i in range(n)]

    def retrieve(self, request_id: Any) -> Future:
        future = self.futures.get(request_id) if isinstance(request_id, str) else None
        if future is None:
            raise BadRequest(f"request_id: {request_id!r} is not a request of this server")
        future.done.wait(POLL_S)
        return future


class LimitedBody:
    """ASGI middleware that refuses a request body past `limit` bytes.

    A request body read past `limit` bytes is a BadRequest (a body with a Content-Length over the limit is refused
    before it is read, in build_app's key check): no request fills the server's memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise BadRequest(f"the request's body exceeds serve.max_body_bytes={self.limit}")
            return message

        return await self.app(scope, counted, send)


def bad_request_in(error: BaseException, kind: type = BadRequest) -> BaseException | None:
    """The BadRequest (or `kind`) `error` is or holds.

    Starlette's middleware raises what its receive raised in an ExceptionGroup."""
    if isinstance(error, kind):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = bad_request_in(inner, kind)
        if found is not None:
            return found
    return None


def build_app(server: Server, api_key: str = ""):
    """The FastAPI app over `server`: each route parses, checks, and answers (a future, or the value itself).

    `api_key`: the key every request must carry as X-API-Key (compared in constant time); empty: any tml- key."""
    import json

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    app = FastAPI()
    expected = api_key.encode()

    def refused(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": message, "detail": message}, status_code=status)

    def said_refused(request: Request, status: int, message: str) -> None:
        """A refused request's one line: its method (route), model and seq_id when it named them, and why."""
        who = getattr(request.state, "who", None) or (None, None)
        model = f" model {who[0]}" if who[0] else ""
        seq = f" seq {who[1]}" if who[1] is not None else ""
        ms = (time.monotonic() - getattr(request.state, "start", time.monotonic())) * 1e3
        client = request.client.host if request.client else "?"
        server.say(f"tinker_exp.serve: {request.url.path.removeprefix('/api/v1/')}{model}{seq}: refused "
                   f"({status}, {ms:.0f} ms, from {client}): {message}")

    @app.middleware("http")
    async def idempotent(request: Request, call_next):
        """The SDK retries a POST with the same X-Idempotency-Key: answer it once.

        One that was answered gets the same answer (the same future), so a retried forward_backward is not queued
        twice."""
        key = request.headers.get("x-idempotency-key")
        if request.method != "POST" or not key or request.url.path in UNCACHED:
            return await call_next(request)
        server.prune()
        sent = await request.body()  # the key with its route and body: the same key on another request is another
        answered = server.reply(request.url.path, key, sent)
        if answered is not None:
            return Response(*answered[:4])
        response = await call_next(request)
        body = b"".join([chunk async for chunk in response.body_iterator])
        if response.status_code in (200, 400):  # a refused request is refused again, in the same words
            server.keep_reply(request.url.path, key, sent, (body, response.status_code, None, response.media_type))
        return Response(body, response.status_code, None, response.media_type)

    @app.middleware("http")
    async def key(request: Request, call_next):
        """The API key check: with a key, a request without it (or with another) is a 401.

        Without one, any tml- key (loopback only: __main__ refuses another host without a key). The key is never in a
        line or a log."""
        request.state.start = time.monotonic()
        given = request.headers.get("x-api-key", "")
        if request.url.path.startswith("/api/v1/"):
            if expected and not hmac.compare_digest(given.encode(), expected):
                message = "X-API-Key: " + ("missing" if not given else "not this server's key") + " (TINKER_API_KEY)"
                said_refused(request, 401, message)
                return refused(message, 401)
            if not expected and not given.startswith("tml-"):
                said_refused(request, 401, "X-API-Key: a key starting with tml- is required")
                return refused("X-API-Key: a key starting with tml- is required", 401)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > server.max_body_bytes:  # refused before it is read
            message = f"the request's body ({int(length)} bytes) exceeds serve.max_body_bytes={server.max_body_bytes}"
            said_refused(request, 400, message)
            return refused(message)
        try:
            return await call_next(request)
        except Exception as error:  # a fault of the server's own: one line each to the client and the terminal
            too_large = bad_request_in(error)
            if too_large is not None:  # a body past the limit without a Content-Length (LimitedBody)
                said_refused(request, 400, str(too_large))
                return refused(str(too_large))
            if bad_request_in(error, ClientDisconnect) is not None:  # the client went away: no one to answer
                return Response(status_code=499)
            server.keep_traceback(request.url.path)  # the traceback: into the run dir
            message = [line for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()][-1]
            server.say(f"tinker_exp.serve: {request.url.path.removeprefix('/api/v1/')}: failed: {message} (traceback "
                       f"in {server.run_dir / ERRORS_LOG})")
            return refused(message, 500)

    app.add_middleware(LimitedBody, limit=server.max_body_bytes)  # the outermost: it counts what is received

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        said_refused(request, 400, str(error))
        return refused(str(error))

    async def json_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise BadRequest(f"{request.url.path}: the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest(f"{request.url.path}: the body is not a JSON object")
        request.state.who = (body.get("model_id") or body.get("sampling_session_id"), body.get("seq_id"))
        return body

    def future(request_id: str, model_id: str | None = None) -> dict:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        # parallel chunks: they arrive at once, the first last, and run in their seq_id order
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": True, "fwdbwd_max_chunk_len": server.max_chunk_datums,
                # the SDK's estimate of a chunk's bytes: half the limit leaves room for its error
                "fwdbwd_max_chunk_bytes_count": min(FWDBWD_CHUNK_BYTES, server.max_body_bytes // 2)}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await json_body(request)
        return {"session_id": server.start_session(), "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await json_body(request)
        if not server.heartbeat(body.get("session_id")):
            return refused(f"session_id: {body.get('session_id')!r} is not a session of this server", 410)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        """The SDK's `ServiceClient.close(status)`.

        The session ends (its heartbeats get 410 from now on) and the model it holds is released."""
        if not server.live_session(session_id):
            return refused(f"session_id: {session_id!r} is not a session of this server", 404)
        server.end_session(session_id)
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
        return {"supported_models": [{"model_name": server.model_name, "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        return future(server.create_model(await json_body(request)))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        model = server.served_model((await json_body(request)).get("model_id"))
        return {"type": "get_info", "model_id": model.model_id, "is_lora": model.lora_rank > 0,
                "lora_rank": model.lora_rank or None,
                # tokenizer_id: what the SDK's get_tokenizer() loads (AutoTokenizer.from_pretrained): the local dir
                "model_data": {"model_name": model.base_model, "tokenizer_id": server.tokenizer_id, "arch": "causal_lm"}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-encoding"):
            raise BadRequest(f"Content-Encoding: {request.headers['content-encoding']!r} is not served (send plain protobuf)")
        parsed = forward_backward_request(await request.body())
        request.state.who = (parsed.model_id, parsed.seq_id or None)
        return future(*server.forward_backward(parsed))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        return future(*server.optim_step(await json_body(request)))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        return future(*server.save_state(await json_body(request)))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        return future(*server.load_state(await json_body(request)))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        return future(*server.save_for_sampler(await json_body(request)))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        return {"sampling_session_id": server.create_sampling_session(await json_body(request)),
                "type": "create_sampling_session"}

    @app.get("/api/v1/samplers/{session_id}")
    async def get_sampler(session_id: str):
        session = server.sampling_session(session_id)
        return {"sampler_id": session_id, "base_model": session["base_model"], "model_path": session["model_path"]}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        request_id, sequence_ids = server.sample(await json_body(request))
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

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
