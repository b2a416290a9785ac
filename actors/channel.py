"""StepChannel: the per-step mailbox between the engine and its workers, in shared memory.

A plain Ray actor call costs ~1-2 ms per step; a shared-memory mailbox that every rank polls
costs microseconds. One segment holds a header and two payload areas: the engine writes a
pickled StepInput and bumps `request_seq`; every rank polls for the new sequence number, runs
the step, and rank 0 writes its pickled StepOutput and bumps `response_seq`. The engine sends
the next step only after the previous response, and the step's collectives keep all ranks
in lockstep, so one request slot suffices. Pollers spin briefly, then back off to short sleeps
so idle workers do not burn a core. Same host only (a GPU pair is STRICT_PACK-placed).
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np

_HEADER = 64  # bytes: request_seq, request_len, response_seq, response_len (int64)
_REQ_SEQ, _REQ_LEN, _RESP_SEQ, _RESP_LEN = range(4)
STOP = "__stop__"


class ChannelClosed(RuntimeError):
    """The other side stopped the channel."""


class StepChannel:
    def __init__(self, name: str | None = None, capacity: int = 32 * 2**20,
                 create: bool = True) -> None:
        """capacity: bytes for each payload area. The engine creates; workers attach by name."""
        self.capacity = capacity
        if create:
            name = name or f"glm53-{uuid.uuid4().hex[:16]}"
            self.shm = shared_memory.SharedMemory(name=name, create=True,
                                                  size=_HEADER + 2 * capacity)
            self.shm.buf[:_HEADER] = bytes(_HEADER)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            # attaching must not make this process's resource tracker unlink the engine's
            # segment at exit (Python < 3.13 registers attachments too)
            resource_tracker.unregister(self.shm._name, "shared_memory")
            self.capacity = (self.shm.size - _HEADER) // 2
        self.name = self.shm.name
        self.owner = create
        self._header = np.ndarray((4,), dtype=np.int64, buffer=self.shm.buf)
        # counted from the segment's creation, so a worker that attaches after the first
        # request was published still sees it
        self._seen_request = self._seen_response = 0

    # ----- engine side -----
    def send(self, obj: object) -> None:
        self._write(obj, _HEADER, _REQ_SEQ, _REQ_LEN)

    def receive_response(self, alive: Callable[[], None] | None = None,
                         timeout: float | None = None) -> object:
        """Wait for rank 0's answer; `alive()` is called every ~50 ms and may raise."""
        return self._wait(_RESP_SEQ, _RESP_LEN, _HEADER + self.capacity, alive, timeout,
                          response=True)

    # ----- worker side -----
    def receive_request(self, timeout: float | None = None) -> object:
        obj = self._wait(_REQ_SEQ, _REQ_LEN, _HEADER, None, timeout, response=False)
        if isinstance(obj, str) and obj == STOP:
            raise ChannelClosed("the engine closed the step channel")
        return obj

    def respond(self, obj: object) -> None:
        self._write(obj, _HEADER + self.capacity, _RESP_SEQ, _RESP_LEN)

    # ----- shared -----
    def _write(self, obj: object, offset: int, seq_field: int, len_field: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.capacity:
            raise ValueError(f"step payload of {len(data)} bytes exceeds the channel capacity "
                             f"({self.capacity})")
        self.shm.buf[offset:offset + len(data)] = data
        self._header[len_field] = len(data)
        self._header[seq_field] += 1  # published last: readers poll this

    def _wait(self, seq_field: int, len_field: int, offset: int,
              alive: Callable[[], None] | None, timeout: float | None,
              response: bool) -> object:
        seen = self._seen_response if response else self._seen_request
        start = last_check = time.perf_counter()
        spins = 0
        while int(self._header[seq_field]) == seen:
            spins += 1
            if spins < 5000:
                os.sched_yield()  # spin, but let other runnable ranks have the core first
            else:  # idle for a while: back off so an idle rank costs (almost) nothing
                time.sleep(0.0002 if spins < 20000 else 0.002)
            now = time.perf_counter()
            if alive is not None and now - last_check > 0.05:
                alive()
                last_check = now
            if timeout is not None and now - start > timeout:
                raise TimeoutError("no message on the step channel")
        n = int(self._header[len_field])
        obj = pickle.loads(self.shm.buf[offset:offset + n])
        if response:
            self._seen_response += 1
        else:
            self._seen_request += 1
        return obj

    def close(self) -> None:
        self._header = None  # release the buffer export before closing
        self.shm.close()
        if self.owner:
            self.shm.unlink()
