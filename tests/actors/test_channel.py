"""StepChannel: two steps can be outstanding (the engine sends step s + 1 before rank 0 has
answered step s), each rank takes every step in order, answers come back in order, and an area
is rewritten only after every rank took (or the engine read) what it held."""

from __future__ import annotations

import threading

import pytest

from glm53.actors import channel as channel_module
from glm53.actors.channel import STOP, ChannelClosed, StepChannel


@pytest.fixture
def channel(monkeypatch):
    engine = StepChannel(capacity=1 << 12, ranks=2)
    # the workers attach in this process, whose tracker holds the engine's registration
    monkeypatch.setattr(channel_module.resource_tracker, "unregister", lambda *a: None)
    workers = [StepChannel(engine.name, create=False, ranks=2, rank=r) for r in range(2)]
    yield engine, workers
    for w in workers:
        w.close()
    engine.close()


def test_two_steps_in_flight_answered_in_order(channel):
    engine, (rank0, rank1) = channel
    engine.send({"step": 0})
    engine.send({"step": 1})  # before any answer
    for w in (rank0, rank1):
        assert w.wait_request(or_until=lambda: True)  # published: no wait
        assert [w.receive_request()["step"] for _ in range(2)] == [0, 1]
        assert not w.wait_request(or_until=lambda: True)  # nothing new: gives up
    rank0.respond("out0")
    rank0.respond("out1")
    assert [engine.receive_response(timeout=1) for _ in range(2)] == ["out0", "out1"]
    engine.send(STOP)
    with pytest.raises(ChannelClosed):
        rank1.receive_request(timeout=1)


def test_an_area_is_rewritten_only_after_every_rank_took_its_step(channel):
    engine, (rank0, rank1) = channel
    engine.send("a")
    engine.send("b")
    for _ in range(2):
        rank0.receive_request()
    rank1.receive_request()  # rank 1 has taken "a" only
    engine.send("c")  # into the area of "a": both took it
    sent = threading.Event()
    worker = threading.Thread(target=lambda: (engine.send("d"), sent.set()))
    worker.start()  # area of "b": rank 1 has not taken it
    assert not sent.wait(0.2)
    assert rank1.receive_request() == "b"
    assert sent.wait(5)
    worker.join()
    assert [rank1.receive_request() for _ in range(2)] == ["c", "d"]
    assert [rank0.receive_request() for _ in range(2)] == ["c", "d"]


def test_an_answer_is_not_written_over_one_the_engine_has_not_read(channel):
    engine, (rank0, _) = channel
    rank0.respond(1)
    rank0.respond(2)
    with pytest.raises(RuntimeError, match="has not read"):
        rank0.respond(3)
    assert engine.receive_response(timeout=1) == 1
    rank0.respond(3)
    assert [engine.receive_response(timeout=1) for _ in range(2)] == [2, 3]


def test_the_payload_must_fit(channel):
    engine, _ = channel
    with pytest.raises(ValueError, match="exceeds the channel capacity"):
        engine.send(b"x" * (1 << 13))
