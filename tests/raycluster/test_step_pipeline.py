"""StepPipeline: steps launched in order ahead of the one before them finishing, at most two
in flight, a continuation of a speculative step launched only after it finished, failures
reaching the step's future."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from glm53.raycluster.executor import StepPipeline


def _step(i: int, continues: bool = False) -> SimpleNamespace:
    return SimpleNamespace(step_id=i, previous_seqs=np.zeros(1) if continues else None)


class Device:
    """A fake device: `launch` records the order, `finish` blocks until the test releases
    the step (as waiting for a step the GPU is still running)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.release = {i: threading.Event() for i in range(10)}
        self.lock = threading.Lock()

    def launch(self, step):
        with self.lock:
            self.log.append(("launch", step.step_id))
        if step.step_id == 7:
            raise ValueError("step 7 cannot be built")
        return step

    def finish(self, step):
        assert self.release[step.step_id].wait(5)
        with self.lock:
            self.log.append(("finish", step.step_id))
        return f"out{step.step_id}"


def _wait_for(predicate, timeout: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        done.wait(0.005)
    raise AssertionError("timed out")


def test_the_next_step_launches_before_the_running_one_finishes():
    dev = Device()
    pipe = StepPipeline(dev.finish, dev.launch)
    futures = [pipe.submit(_step(i)) for i in range(3)]
    # steps 0 and 1 are launched while 0 still runs; 2 waits until 0 has finished
    _wait_for(lambda: ("launch", 1) in dev.log)
    assert dev.log == [("launch", 0), ("launch", 1)]
    dev.release[0].set()
    assert futures[0].result(5) == "out0"
    _wait_for(lambda: ("launch", 2) in dev.log)
    assert ("finish", 1) not in dev.log
    dev.release[1].set()
    dev.release[2].set()
    assert [f.result(5) for f in futures] == ["out0", "out1", "out2"]
    assert [e for e in dev.log if e[0] == "finish"] == [("finish", i) for i in range(3)]
    pipe.shutdown()


def test_a_continuation_of_a_speculative_step_waits_for_its_result():
    dev = Device()
    pipe = StepPipeline(dev.finish, dev.launch)
    first = pipe.submit(_step(3))
    second = pipe.submit(_step(4, continues=True))
    _wait_for(lambda: ("launch", 3) in dev.log)
    threading.Event().wait(0.05)
    assert ("launch", 4) not in dev.log  # step 3's tokens are not settled yet
    dev.release[3].set()
    dev.release[4].set()
    assert (first.result(5), second.result(5)) == ("out3", "out4")
    assert dev.log == [("launch", 3), ("finish", 3), ("launch", 4), ("finish", 4)]
    pipe.shutdown()


def test_a_failed_launch_fails_its_step_only():
    dev = Device()
    pipe = StepPipeline(dev.finish, dev.launch)
    for i in (6, 8):
        dev.release[i].set()
    futures = [pipe.submit(_step(i)) for i in (6, 7, 8)]
    assert futures[0].result(5) == "out6"
    with pytest.raises(ValueError, match="cannot be built"):
        futures[1].result(5)
    assert futures[2].result(5) == "out8"
    pipe.shutdown()


def test_without_a_launch_the_finish_runs_each_step_whole():
    ran = []
    pipe = StepPipeline(lambda step: ran.append(step.step_id) or step.step_id * 10)
    assert [pipe.submit(_step(i)).result(5) for i in range(4)] == [0, 10, 20, 30]
    assert ran == [0, 1, 2, 3]
    pipe.shutdown()
    pipe.shutdown()  # idempotent
