"""The server's bookkeeping without workers (tinker_exp/serve/app.py): a model's requests run in their seq_id order,
whatever order they arrive in; a session that ends, by its client or by silence, releases its model. Fakes stand in
for the workers here only; tests/test_serve.py drives the real server with the SDK."""

from __future__ import annotations

import threading

import pytest

from tinker_exp.serve.app import BadRequest, Server


class FakeWorkers:
    def __init__(self, rank: int):
        self.rank, self.stopped = rank, threading.Event()

    def shutdown(self) -> None:
        self.stopped.set()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def server(tmp_path, **kwargs) -> Server:
    built: list[FakeWorkers] = []

    def build(rank: int, model_id: str) -> FakeWorkers:
        built.append(FakeWorkers(rank))
        return built[-1]

    made = Server("tiny-llama", build, dict, lambda folder, first_step: None, lambda *a: {}, tmp_path, lambda: None, **kwargs)
    made.built = built
    return made


def claimed(made: Server, session_id: str | None = None, rank: int = 0, seq: int = 0):
    """A model of LoRA rank `rank` for a session (a fresh one if None), as create_model claims it, built."""
    session_id = session_id or made.start_session()
    request_id = made.create_model({"session_id": session_id, "model_seq_id": seq, "base_model": "tiny-llama",
                                    "lora_config": {"rank": rank}})
    assert made.retrieve(request_id).error is None
    return made.models[f"{session_id}:train:{seq}"]


def result(made: Server, request_id: str):
    future = made.retrieve(request_id)
    assert future.done.is_set(), request_id
    return future.error or future.result


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in(tmp_path):
    made = server(tmp_path)
    model = claimed(made)
    ran: list[int] = []

    def request(seq_id: int, body: str = "the first") -> str:
        return made.in_turn(model, seq_id, lambda: lambda: ran.append(seq_id) or seq_id, body={"b": body})

    late = [request(seq_id) for seq_id in (3, 4, 2)]  # the SDK's parallel chunks: the first one last
    assert ran == [] and not made.futures[late[0]].done.is_set()
    first = request(1)
    assert [result(made, r) for r in (first, late[2], late[0], late[1])] == [1, 2, 3, 4] and ran == [1, 2, 3, 4]
    for seq_id, turn in ((3, "past"), (0, None)):
        with pytest.raises(BadRequest) as refused:
            request(seq_id, "another")
        assert "\n" not in str(refused.value)
        assert str(refused.value) == (f"seq_id: {seq_id} of model {model.model_id} was sent before with another request "
                                      "(its turn is past; the next is 5)"
                                      if turn else "seq_id: 0 is not a sequence number (an integer >= 1)")
    waiting = request(6)
    with pytest.raises(BadRequest, match=f"^seq_id: 6 of model {model.model_id} was sent before with another request "
                                         "\\(its turn is taken; the next is 5\\)$"):
        request(6, "another")

    def refuse():
        raise BadRequest("loss_fn: 'nope' is not served")

    with pytest.raises(BadRequest, match="^loss_fn: 'nope' is not served$"):  # refused in its turn: the turn passes
        made.in_turn(model, 5, refuse)
    assert result(made, waiting) == 6 and ran[-1] == 6 and model.next_seq == 7


def test_a_request_sent_again_with_its_seq_id_gets_the_first_ones_answer_and_runs_once(tmp_path):
    """The SDK re-sends a request whose reply it lost with a new idempotency key and the same seq_id: the same
    method and body get the first one's future (the work ran once) or its refusal, whether the first is done or
    still waits for its turn; another body with that seq_id is refused."""
    made = server(tmp_path)
    model = claimed(made)
    ran: list[int] = []

    def request(seq_id: int, method: str = "optim_step", body: dict | None = None) -> str:
        return made.in_turn(model, seq_id, lambda: lambda: ran.append(seq_id) or seq_id, method=method,
                            body=body or {"model_id": model.model_id, "seq_id": seq_id, "lr": 0.1})

    early = request(2)  # waits for seq_id 1
    assert request(2) == early and ran == []
    done = request(1)
    assert result(made, done) == 1 and result(made, early) == 2
    assert request(1) == done and request(2) == early and ran == [1, 2]
    with pytest.raises(BadRequest, match="was sent before with another request"):
        request(2, method="save_state")
    with pytest.raises(BadRequest, match="was sent before with another request"):
        request(1, body={"model_id": model.model_id, "seq_id": 1, "lr": 0.2})

    def refuse():
        raise BadRequest("adam_params.beta1: 1.0 is not in [0, 1)")

    for _ in range(2):  # a refused one sent again: refused again, in the same words
        with pytest.raises(BadRequest, match=r"^adam_params.beta1: 1.0 is not in \[0, 1\)$"):
            made.in_turn(model, 3, refuse, method="optim_step", body={"beta1": 1.0})
    assert ran == [1, 2] and model.next_seq == 4
    session = model.session_id  # create_model sent again by its session: the same request
    assert made.create_model({"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama"}) == model.created
    assert len(made.built) == 1


@pytest.mark.parametrize("seq", ["0/../../../../tmp/escaped", -1, True, 1.5, None])
def test_a_model_seq_id_that_is_not_an_integer_is_refused_before_any_path(tmp_path, seq):
    """The model id goes into folder names (models/<id>/, checkpoints/<id>/): model_seq_id must be the SDK's integer
    (the issue: '0/../../../../tmp/NAME' then save_weights wrote outside the run dir)."""
    made = server(tmp_path)
    session = made.start_session()
    for route, call in (("create_model", made.create_model), ("load_weights", made._claim)):
        body = {"session_id": session, "model_seq_id": seq, "base_model": "tiny-llama"}
        with pytest.raises(BadRequest) as refused:
            call(body) if route == "create_model" else call(route, body, "tiny-llama", 0)
        assert str(refused.value) == (f"model_seq_id: {seq!r} is not a model_seq_id (an integer >= 0: the SDK's count "
                                      "of its training clients)")
    assert not made.models and not made.built
    with pytest.raises(BadRequest, match="is outside the server's run dir"):
        made.inside(tmp_path / "checkpoints" / ".." / ".." / "elsewhere")


def test_finished_results_replies_and_sampling_sessions_are_pruned(tmp_path):
    """A finished request's future and a reply by idempotency key are forgotten results_kept_s after they were done
    (a pending one never); an idempotency key is one request with its route and body; a client session's end drops
    its sampling sessions."""
    made = server(tmp_path, results_kept_s=0.0)
    model = claimed(made)
    done = made.submit(lambda: "done")
    assert made.futures[done].done.wait(30)
    gate = threading.Event()
    pending = made.submit(lambda: gate.wait(30))
    made.keep_reply("/api/v1/optim_step", "key", b"{}", (b"answer", 200, None, "application/json"))
    assert made.reply("/api/v1/optim_step", "key", b"{}")[0] == b"answer"
    assert made.reply("/api/v1/optim_step", "key", b"{ }") is None and made.reply("/api/v1/save_weights", "key", b"{}") is None
    made.prune(now=True)
    assert done not in made.futures and pending in made.futures and not made.replies
    gate.set()
    made.create_sampling_session({"session_id": model.session_id, "sampling_session_seq_id": 0, "base_model": "tiny-llama"})
    other = made.create_sampling_session({"session_id": "another", "sampling_session_seq_id": 0, "base_model": "tiny-llama"})
    made.end_session(model.session_id)
    assert list(made.sampling_sessions) == [other]


def test_a_request_whose_predecessor_never_comes_fails_in_one_line_and_the_sequence_goes_on(tmp_path):
    made = server(tmp_path, seq_gap_timeout_s=0.2)
    model = claimed(made)
    ran: list[int] = []
    waiting = [made.in_turn(model, seq_id, lambda s=seq_id: lambda: ran.append(s)) for seq_id in (3, 2)]
    for request_id, seq_id in zip(waiting, (3, 2)):
        future = made.futures[request_id]
        assert future.done.wait(30)
        assert future.error == f"seq_id: {seq_id} of model {model.model_id} waited 0.2 s for seq_id 1, which never came"
    assert ran == [] and model.next_seq == 4
    assert made.retrieve(made.in_turn(model, 4, lambda: lambda: ran.append(4))).done.is_set() and ran == [4]


def test_a_finished_session_releases_its_model_for_the_next_client(tmp_path):
    made = server(tmp_path)
    first = claimed(made)
    second_session = made.start_session()
    with pytest.raises(BadRequest, match=f"^create_model: this server already serves model {first.model_id}; a fully "
                       "fine-tuned model \\(LoRA rank 0\\) trains alone. It is freed when"):
        claimed(made, second_session)
    held = made.in_turn(first, 2, lambda: lambda: "never")  # waits for seq_id 1
    workers = first.workers
    made.end_session(first.session_id)
    assert made.futures[held].error == f"model_id: {first.model_id} was released (its session {first.session_id} ended)"
    second = claimed(made, second_session)
    assert workers.stopped.is_set() and not second.workers.stopped.is_set() and second.model_id.startswith(second_session)
    assert not made.heartbeat(first.session_id)  # the SDK stops its heartbeats on the 410 this gives
    with pytest.raises(BadRequest, match="^model_id: .* is not served here"):
        made.served_model(first.model_id)


def test_lora_models_of_one_rank_are_held_at_once_up_to_the_slots_and_a_full_one_alone(tmp_path):
    """serve.slots=2: two sessions' rank-8 models are held at once; a third, a rank-4 one and a fully fine-tuned one
    are each refused in one line saying why; a session's end frees each model it holds, and the next takes the room."""
    made = server(tmp_path, slots=2)
    a, b = claimed(made, rank=8), claimed(made, rank=8)
    assert set(made.models) == {a.model_id, b.model_id} and not a.workers.stopped.is_set()
    held = f"this server already serves models {a.model_id}, {b.model_id}; "
    refusals = [(8, "all 2 slots \\(serve.slots\\) hold a model. One is freed when its client closes"),
                (4, "its workers train LoRA rank 8 models; a rank 4 model waits until they are freed"),
                (0, "a fully fine-tuned model \\(LoRA rank 0\\) trains alone")]
    for rank, why in refusals:
        with pytest.raises(BadRequest, match=f"^create_model: {held}{why}"):
            claimed(made, rank=rank)
    assert len(made.built) == 2
    b_workers = b.workers
    made.end_session(b.session_id)
    c_session = made.start_session()
    c, d = claimed(made, c_session, rank=8), None
    with pytest.raises(BadRequest, match="all 2 slots"):
        d = claimed(made, c_session, rank=8, seq=1)  # the session's second training client: no room
    made.retrieve(made.submit(lambda: {})).done.wait(10)  # the frees queued before it are done
    assert b_workers.stopped.is_set() and d is None and set(made.models) == {a.model_id, c.model_id}
    assert made.served_model(c.model_id) is c
    with pytest.raises(BadRequest, match=f"^model_id: {b.model_id!r} is not served here \\(served: "):
        made.served_model(b.model_id)
    made.end_session(a.session_id)
    made.end_session(c_session)
    made.retrieve(made.submit(lambda: {})).done.wait(10)  # the frees queued before it are done
    assert all(w.stopped.is_set() for w in made.built) and not made.models
    assert claimed(made, rank=0).lora_rank == 0


def test_a_session_whose_heartbeats_stopped_releases_its_model(tmp_path):
    clock = Clock()
    made = server(tmp_path, session_timeout_s=120.0, clock=clock)
    first = claimed(made)
    other = made.start_session()
    clock.now = 100.0
    assert made.heartbeat(first.session_id)  # beating: it keeps its model
    clock.now = 200.0
    with pytest.raises(BadRequest, match=r"already serves model .* It is freed when its client closes its ServiceClient, "
                       r"or 120 s after that client's last heartbeat \(in 20 s at most if it has stopped\)$"):
        claimed(made, other)  # when it frees itself: 100 + 120 - 200
    clock.now = 320.5  # 120.5 s since its last heartbeat; the other session started at 0 and beat never: it ended too
    with pytest.raises(BadRequest, match=f"^session_id: '{other}' is not a session of this server"):
        claimed(made, other)
    second = claimed(made)
    assert list(made.models.values()) == [second] and made.built[0].stopped.is_set()
    assert not made.heartbeat(first.session_id)


class FakeSampler:
    """The driver's sampler, as bookkeeping: a snapshot's weights are a number (the model's step when saved); a
    sample answers with them as its token."""

    positions = 64

    def __init__(self):
        self.loaded = None

    @staticmethod
    def write(workers, folder, lora_rank: int) -> None:
        (folder / "step").write_text(str(workers.step))

    @staticmethod
    def weights(folder) -> dict:
        return {"step": int((folder / "step").read_text())}

    def use(self, key, tensors) -> None:
        self.loaded = tensors() if callable(tensors) else tensors

    def sample(self, prompt, n, max_tokens, temperature, seed, **limits) -> list:
        from tinker_exp.runtime.sampler import Sample

        return [Sample([self.loaded["step"]], [0.0], "", False) for _ in range(n)]


def test_a_sample_accepted_before_saves_drop_its_snapshot_samples_its_weights(tmp_path):
    """Unnamed snapshots beyond SNAPSHOTS_KEPT are dropped; a sample accepted while its snapshot was kept holds its
    weights, even when the saves queued before it drop the snapshot (the issue: a TypeError from the workers'
    reload of None); one sent after the drop is the documented one-line 400."""
    from tinker.proto import tinker_public_pb2 as pb

    from tinker_exp.serve.app import SNAPSHOTS_KEPT

    sampler = FakeSampler()
    made = Server("tiny-llama", lambda rank, model_id: FakeWorkers(rank), dict, lambda folder, first_step: None, lambda *a: {},
                  tmp_path, lambda: sampler)
    model = claimed(made)
    model.workers.step = 0

    def snapshot(seq_id: int) -> str:
        request_id = made.save_for_sampler({"model_id": model.model_id, "seq_id": seq_id, "sampling_session_seq_id": seq_id})[0]
        return request_id

    first = result(made, snapshot(1))["sampling_session_id"]
    sample = {"sampling_session_id": first, "num_samples": 1, "prompt": {"chunks": [{"tokens": [1]}]},
              "sampling_params": {"max_tokens": 1}}
    gate = threading.Event()
    made.submit(gate.wait)  # the work thread busy: what follows is queued, in order
    model.workers.step = 7  # the later snapshots' weights
    saves = [snapshot(seq_id) for seq_id in range(2, 2 + SNAPSHOTS_KEPT)]
    accepted = made.sample(sample)[0]  # its snapshot is still kept: accepted, queued behind the saves
    gate.set()
    for save in saves:
        result(made, save)
    assert made.sampling_sessions[first]["weights"] is None  # dropped by the saves queued before the sample
    response = pb.SampleResponse()
    response.ParseFromString(result(made, accepted))
    assert list(__import__("numpy").frombuffer(response.sequences[0].tokens, dtype="int32")) == [0]  # its own weights
    with pytest.raises(BadRequest, match=f"^sampling_session_id: '{first}': its weights were dropped \\(the server keeps "
                                         f"the last {SNAPSHOTS_KEPT} unnamed snapshots"):
        made.sample(sample)


def test_a_run_dir_that_is_a_file_is_one_line_and_nothing_is_written(tmp_path):
    from helpers import run_module

    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    for run_dir, where in ((taken, ""), (taken / "sub", f": {str(taken)!r}")):
        done = run_module("tinker_exp.serve", f"serve.run_dir={run_dir}", timeout=120)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            f"tinker_exp: config error: serve.run_dir: {str(run_dir)!r}{where} is a file, not a folder; give a folder "
            "(it is made if it does not exist)"], done.stderr
        assert not done.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["taken"] and taken.read_text() == "a file\n"


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_chunk_length_that_is_not_a_count_is_one_line_before_anything_starts(tmp_path, value):
    from helpers import run_module

    run_dir = tmp_path / "run"
    done = run_module("tinker_exp.serve", f"serve.max_chunk_datums={value}", f"serve.run_dir={run_dir}", timeout=120)
    shown = int(value) if value.isdigit() else value
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"tinker_exp: config error: serve.max_chunk_datums: {shown!r} is not a count (an integer >= 1)"], done.stderr
    assert not run_dir.exists() and not done.stdout


def test_a_failure_of_the_servers_own_is_one_line_and_its_traceback_goes_to_the_run_dir(tmp_path):
    """A request whose work raises (a worker's error): its future fails with the error's last line, the terminal gets
    one line naming serve_errors.log, and the traceback is there, not on the terminal; a request that works is one
    ok line with its method, model and seq_id."""
    lines: list[str] = []
    made = server(tmp_path, say=lines.append)
    model = claimed(made)

    def fails():
        raise RuntimeError("in a worker:\n  File x\nIndexError: index out of range in self")

    ok = made.in_turn(model, 1, lambda: lambda: {"fine": True}, method="optim_step")
    failed = made.in_turn(model, 2, lambda: fails, method="forward_backward")
    assert result(made, ok) == {"fine": True}
    assert result(made, failed) == "IndexError: index out of range in self"
    assert lines[-2].startswith(f"tinker_exp.serve: optim_step model {model.model_id} seq 1: ok (")
    assert lines[-1].startswith(f"tinker_exp.serve: forward_backward model {model.model_id} seq 2: failed (")
    assert lines[-1].endswith(f"IndexError: index out of range in self (traceback in {tmp_path / 'serve_errors.log'})")
    assert "Traceback (most recent call last)" in (tmp_path / "serve_errors.log").read_text()
    assert not any("Traceback" in line for line in lines)


class FakeGroup:
    """The slots' group as the work thread sees it: records each cycle (the call and the models' workers in it)."""

    def __init__(self):
        self.cycles: list[tuple[str, list]] = []
        self.fails = False

    def forward_backward_together(self, calls, forward_only=False):
        self.cycles.append(("forward" if forward_only else "forward_backward", [workers for workers, _ in calls]))
        if self.fails:
            raise RuntimeError("in a worker:\nRuntimeError: a packed step failed")
        return [(float(len(data)), [[0.0]] * len(data)) for _, data in calls]

    def optimizer_steps(self, calls):
        self.cycles.append(("optim_step", [workers for workers, _ in calls]))
        return [(params["lr"], []) for _, params in calls]


class SlotFake(FakeWorkers):
    """A model's slot on a FakeGroup: its cross_entropy calls and optim_steps join cycles, other losses run alone."""

    def __init__(self, rank: int, group: FakeGroup):
        super().__init__(rank)
        self.group = group

    def cycle(self, call: str, loss: str):
        if call != "optim_step" and loss != "cross_entropy":
            return None, f"{call} with loss {loss} runs alone"
        return self.group, None


def test_the_calls_of_several_models_waiting_at_once_train_in_cycles_each_models_order_kept(tmp_path):
    """While the work thread is busy, five models' calls wait. A cycle takes each other model's first waiting call
    when it is of the same kind (call and loss) on the same group, never a model's call behind its own earlier work:
    A's forward_backward with E's (D's first is a save, B's an optim_step, C's another loss), then A's and B's
    optim_steps, D's save, then D's forward_backward with B's, then C's ppo calls alone (said once). Each request
    gets its own result and its line says it shared a cycle. A cycle that fails fails each of its requests in one
    line, and the thread goes on."""
    from tinker_exp.serve.app import Cycled

    lines: list[str] = []
    group = FakeGroup()
    made = Server("tiny-llama", lambda rank, model_id: SlotFake(rank, group), dict, lambda folder, first_step: None,
                  lambda *a: {}, tmp_path, lambda: None, say=lines.append, slots=8)
    models = {name: claimed(made, rank=8) for name in "ABCDE"}
    ran: list[str] = []

    def call(name: str, seq: int, kind: str, loss: str = "cross_entropy") -> str:
        def alone():
            ran.append(f"{name}.{kind} alone")
            return {"alone": name}

        args = {"lr": float(ord(name))} if kind == "optim_step" else [name] * seq
        work = Cycled(kind, "" if kind == "optim_step" else loss, args, alone, lambda result: {"result": result})
        return made.in_turn(models[name], seq, lambda: work, method=kind)

    def save(name: str, seq: int) -> str:
        return made.in_turn(models[name], seq, lambda: lambda: ran.append(f"{name}.save") or {}, method="save_state")

    gate, busy = threading.Event(), threading.Event()
    def holding() -> dict:  # the work thread busy until the gate opens
        busy.set()
        assert gate.wait(60)
        return {}

    held = made.submit(holding)
    assert busy.wait(60)
    sent = {"A": [call("A", 1, "forward_backward"), call("A", 2, "optim_step")],
            "D": [save("D", 1), call("D", 2, "forward_backward")],
            "B": [call("B", 1, "optim_step"), call("B", 2, "forward_backward")],
            "C": [call("C", 1, "forward_backward", "ppo"), call("C", 2, "forward_backward", "ppo")],
            "E": [call("E", 1, "forward_backward")]}
    gate.set()
    assert result(made, held) == {}
    got = {name: [result(made, request_id) for request_id in ids] for name, ids in sent.items()}
    workers = {name: model.workers for name, model in models.items()}
    assert group.cycles == [("forward_backward", [workers["A"], workers["E"]]), ("optim_step", [workers["A"], workers["B"]]),
                            ("forward_backward", [workers["D"], workers["B"]])]
    assert ran == ["D.save", "C.forward_backward alone", "C.forward_backward alone"]
    assert got["A"] == [{"result": (1.0, [[0.0]])}, {"result": (65.0, [])}] and got["E"] == [{"result": (1.0, [[0.0]])}]
    assert got["B"] == [{"result": (66.0, [])}, {"result": (2.0, [[0.0]] * 2)}] and got["C"] == [{"alone": "C"}] * 2
    assert lines.count("tinker_exp.serve: forward_backward with loss ppo runs alone") == 1
    for name, seq, method in (("A", 1, "forward_backward"), ("E", 1, "forward_backward"), ("B", 1, "optim_step"), ("D", 2, "forward_backward")):
        line = next(line for line in lines if f"{method} model {models[name].model_id} seq {seq}: " in line)
        assert line.endswith(f", in one cycle with 1 other model's {method})"), line

    group.fails = True  # a failing cycle: each of its requests fails in one line, the thread goes on
    gate.clear()
    busy.clear()
    held = made.submit(holding)
    assert busy.wait(60)
    failed = [call("A", 3, "forward_backward"), call("E", 2, "forward_backward")]
    gate.set()
    assert result(made, held) == {} and [result(made, r) for r in failed] == ["RuntimeError: a packed step failed"] * 2
    assert result(made, call("A", 4, "optim_step")) == {"alone": "A"}  # alone in its cycle: the thread goes on


def test_clients_that_await_each_result_fall_into_step_the_next_cycle_waiting_a_moment_for_the_last_ones_models(tmp_path, monkeypatch):
    """Two models that trained in one cycle: the next cycle, taken up by A's call, waits for B's next call (a client
    that awaits each result sends its next as the last returns) and trains both in one cycle; a model alone on the
    server never waits for another."""
    from tinker_exp.runtime import slots as slots_module
    from tinker_exp.serve.app import Cycled

    monkeypatch.setattr(slots_module, "GATHER_FRACTION", 1e6)
    monkeypatch.setattr(slots_module, "GATHER_MAX_S", 600.0)  # so only B's arrival ends the wait
    group = FakeGroup()
    made = Server("tiny-llama", lambda rank, model_id: SlotFake(rank, group), dict, lambda folder, first_step: None,
                  lambda *a: {}, tmp_path, lambda: None, slots=8)
    models = {name: claimed(made, rank=8) for name in "AB"}
    gathering = threading.Event()  # set as a call's cycle starts waiting for another model's
    gather = made._gather

    def noted(job) -> None:
        if isinstance(job.work, Cycled) and made.served - {job.model.model_id}:
            gathering.set()
        gather(job)

    monkeypatch.setattr(made, "_gather", noted)

    def call(name: str, seq: int, kind: str) -> str:
        args = {"lr": 1.0} if kind == "optim_step" else [name]
        work = Cycled(kind, "" if kind == "optim_step" else "cross_entropy", args, lambda: {"alone": name}, lambda r: {"result": r})
        return made.in_turn(models[name], seq, lambda: work, method=kind)

    # A alone: its calls run as they come (the last cycle served A only), none waits for B
    assert result(made, call("A", 1, "forward_backward")) == {"alone": "A"}
    assert result(made, call("A", 2, "optim_step")) == {"alone": "A"} and group.cycles == []
    gate, busy = threading.Event(), threading.Event()
    held = made.submit(lambda: busy.set() or gate.wait(60) and {})
    assert busy.wait(60)
    first = [call("A", 3, "forward_backward"), call("B", 1, "forward_backward")]
    gate.set()
    assert result(made, held) == {} and [result(made, r) for r in first] == [{"result": (1.0, [[0.0]])}] * 2
    assert not gathering.is_set()
    a_step = call("A", 4, "optim_step")  # A's next, alone in the queue: its cycle waits for B's
    assert gathering.wait(60) and len(group.cycles) == 1
    b_step = call("B", 2, "optim_step")
    assert result(made, a_step) == result(made, b_step) == {"result": (1.0, [])}
    workers = [models[name].workers for name in "AB"]
    assert group.cycles == [("forward_backward", workers), ("optim_step", workers)]
