"""The worker group's start when its rendezvous port is taken (EADDRINUSE: seen once on a busy machine, another
process took the port found free before rank 0 bound it): real verl workers on the shared Ray cluster, the port
taken for them by this test's listening socket and handed to the driver's port picker as free, no timing."""

from __future__ import annotations

import logging
import socket

import pytest

from helpers import compose


def taken_port() -> socket.socket:
    """A port held the way another process would hold it: bound and listening on every interface, IPv6 and IPv4
    (torch's TCPStore binds [::] with libuv, and would take an IPv4-only holder's port beside it)."""
    held = socket.socket(socket.AF_INET6)
    held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    held.bind(("::", 0))
    held.listen()
    return held


def workers_with_ports_taken(monkeypatch, port: int, taken: set[int]):
    """TinkerWorkers whose nth group start (from 1) is handed `port` when n is in `taken`: the driver's port picker
    (workers.free_port: on one node, rank 0's node is the driver's) answers it as if it were free, as it was when
    another process took it. verl's own picker, a Ray task on rank 0's node, is not asked on one node (it would cost a
    worker process a start). Returns (the workers, starting; the picks made: the port each start got)."""
    import verl.single_controller.ray.base as verl_ray

    from tinker_exp import config
    from tinker_exp.run import validate
    from tinker_exp.runtime import workers as workers_module
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.workers import TinkerWorkers

    picks: list[str] = []
    free_port = workers_module.free_port

    def picker() -> str:
        picks.append(str(port) if len(picks) + 1 in taken else free_port())
        return picks[-1]

    def verls_task(*args, **kwargs):
        raise AssertionError("verl's get_master_addr_port task was asked on a one-node cluster")

    monkeypatch.setattr(workers_module, "free_port", picker)
    monkeypatch.setattr(verl_ray.get_master_addr_port, "options", verls_task)
    cfg = config.load(compose("trainer.steps=1"))
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), validate(cfg).optimizer_values, "cpu")
    return workers, picks


def test_a_rendezvous_port_taken_before_rank_0_binds_it_starts_the_group_again_on_a_new_one(ray_address, caplog, monkeypatch):
    """The first start's port is held by another socket: rank 0 cannot bind it (EADDRINUSE), the group is freed and
    started again on a new port; its workers then build and answer. Taken twice: one line, the cause and that
    the same command starts again (WorkersStartError, exit 1), no traceback of the workers' for the user."""
    from tinker_exp.errors import WorkersStartError, one_line

    held = taken_port()
    port = held.getsockname()[1]
    try:
        workers, picks = workers_with_ports_taken(monkeypatch, port, {1})
        try:
            with caplog.at_level(logging.WARNING, logger="tinker_exp.runtime.workers"):
                workers.ready()
            assert len(picks) == 2 and picks[0] == str(port) != picks[1] == workers.group.master_port
            assert len(workers.param_group_values()) == 2  # both ranks built their optimizer on the new group
            (warned,) = [r.getMessage() for r in caplog.records if "rendezvous port" in r.getMessage()]
            assert warned.startswith(f"workers: the rendezvous port {port} was taken by another process")
        finally:
            workers.shutdown()

        workers, picks = workers_with_ports_taken(monkeypatch, port, {1, 2})
        try:
            with pytest.raises(WorkersStartError) as stopped:
                workers.ready()
        finally:
            workers.shutdown()
        assert one_line(stopped.value) == (
            f"workers did not start: the workers' rendezvous port was taken by another process twice (EADDRINUSE, ports "
            f"{port} and {port}): a busy machine; the same command starts again"
        )
        assert stopped.value.exit_code == 1 and picks == [str(port), str(port)]
    finally:
        held.close()
