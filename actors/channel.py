"""StepChannel: the per-step mailbox between the engine and its workers, in shared memory.

A plain Ray actor call costs ~1-2 ms per step; a shared-memory mailbox that every rank polls
costs microseconds. One segment holds a header and two request and two response areas, used in
turn: the engine writes a pickled StepInput into request area s % 2 and bumps `request_seq` to
s + 1; every rank polls for the new sequence number, copies the step out and notes that it has
(its `taken` counter), runs the step, and rank 0 writes its pickled StepOutput into response
area s % 2 and bumps `response_seq`. Two areas let the engine send step s + 1 while step s
runs (overlapped execution: a worker launches it before finishing step s). The engine keeps at
most two steps unanswered, so a request area is rewritten only after every rank took the step
that was in it, and a response area only after the engine read its answer; `send` checks the
first, `respond` the second. Pollers spin briefly, then back off to short sleeps so idle
workers do not burn a core. Same host only (a GPU pair is STRICT_PACK-placed).
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np

# header, int64 fields: request_seq, response_seq, responses read by the engine, the request
# and response areas' payload lengths, then per rank the requests it has taken
_REQ_SEQ, _RESP_SEQ, _RESP_READ = 0, 1, 2
_REQ_LEN, _RESP_LEN = 3, 5  # two each
_TAKEN = 8
MAX_RANKS = 56
_HEADER = 8 * (_TAKEN + MAX_RANKS)  # bytes
STOP = "__stop__"


def _pause(spins: int, longest: float = 0.002) -> None:
    """The poll loops' wait after `spins` empty polls: spin first, letting other runnable ranks
    have the core, then back off to sleeps of up to `longest` seconds, so that an idle rank
    costs (almost) nothing."""
    if spins < 5000:
        os.sched_yield()
    else:
        time.sleep(min(longest, 0.0002 if spins < 20000 else 0.002))


class ChannelClosed(RuntimeError):
    """The other side stopped the channel."""


class StepChannel:
    def __init__(self, name: str | None = None, capacity: int = 32 * 2**20,
                 create: bool = True, ranks: int = 1, rank: int = 0) -> None:
        """capacity: bytes for each payload area. The engine creates the channel for `ranks`
        workers; a worker attaches by name as `rank`."""
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"a step channel serves 1 to {MAX_RANKS} ranks, not {ranks}")
        self.capacity = capacity
        if create:
            name = name or f"glm53-{uuid.uuid4().hex[:16]}"
            self.shm = shared_memory.SharedMemory(name=name, create=True,
                                                  size=_HEADER + 4 * capacity)
            self.shm.buf[:_HEADER] = bytes(_HEADER)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            # attaching must not make this process's resource tracker unlink the engine's
            # segment at exit (Python < 3.13 registers attachments too)
            resource_tracker.unregister(self.shm._name, "shared_memory")
            self.capacity = (self.shm.size - _HEADER) // 4
        self.name = self.shm.name
        self.owner = create
        self.ranks, self.rank = ranks, rank
        self._header = np.ndarray((_TAKEN + MAX_RANKS,), dtype=np.int64, buffer=self.shm.buf)
        # counted from the segment's creation, so a worker that attaches after the first
        # request was published still sees it
        self._seen_request = self._seen_response = 0

    def _area(self, kind: int, seq: int) -> int:
        """Byte offset of request (kind 0) or response (kind 1) area for message `seq`."""
        return _HEADER + (2 * kind + seq % 2) * self.capacity

    # ----- engine side -----
    def send(self, obj: object) -> None:
        """Publish the next step (or STOP), once every rank has taken the step that was in its
        area (two before it: the engine's StepPipeline keeps at most two steps unanswered)."""
        seq = int(self._header[_REQ_SEQ])
        start = time.perf_counter()
        while seq >= 2 and int(self._header[_TAKEN:_TAKEN + self.ranks].min()) < seq - 1:
            # a rank still copying step seq - 2 out (it has answered it: only just)
            if time.perf_counter() - start > 60:
                raise TimeoutError(f"step channel: a rank has not taken request {seq - 2}")
            os.sched_yield()
        self._write(obj, self._area(0, seq), _REQ_SEQ, _REQ_LEN + seq % 2)

    def receive_response(self, alive: Callable[[], None] | None = None,
                         timeout: float | None = None) -> object:
        """Wait for rank 0's next answer; `alive()` is called every ~50 ms and may raise."""
        obj = self._wait(_RESP_SEQ, alive, timeout, response=True)
        self._header[_RESP_READ] = self._seen_response
        return obj

    # ----- worker side -----
    def wait_request(self, or_until: Callable[[], bool]) -> bool:
        """Wait until a request this rank has not taken is published (True) or `or_until()`
        holds (False), polling it at most every 50 us."""
        spins = 0
        while int(self._header[_REQ_SEQ]) == self._seen_request:
            if or_until():
                return False
            spins += 1
            _pause(spins, longest=0.00005)
        return True

    def receive_request(self, timeout: float | None = None) -> object:
        obj = self._wait(_REQ_SEQ, None, timeout, response=False)
        self._header[_TAKEN + self.rank] = self._seen_request
        if isinstance(obj, str) and obj == STOP:
            raise ChannelClosed("the engine closed the step channel")
        return obj

    def respond(self, obj: object) -> None:
        seq = int(self._header[_RESP_SEQ])
        if seq >= 2 and int(self._header[_RESP_READ]) < seq - 1:
            raise RuntimeError(f"step channel: response {seq} would overwrite response "
                               f"{seq - 2}, which the engine has not read yet")
        self._write(obj, self._area(1, seq), _RESP_SEQ, _RESP_LEN + seq % 2)

    # ----- shared -----
    def _write(self, obj: object, offset: int, seq_field: int, len_field: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.capacity:
            raise ValueError(f"step payload of {len(data)} bytes exceeds the channel capacity "
                             f"({self.capacity})")
        self.shm.buf[offset:offset + len(data)] = data
        self._header[len_field] = len(data)
        self._header[seq_field] += 1  # published last: readers poll this

    def _wait(self, seq_field: int, alive: Callable[[], None] | None, timeout: float | None,
              response: bool) -> object:
        seen = self._seen_response if response else self._seen_request
        start = last_check = time.perf_counter()
        spins = 0
        while int(self._header[seq_field]) == seen:
            spins += 1
            _pause(spins)
            now = time.perf_counter()
            if alive is not None and now - last_check > 0.05:
                alive()
                last_check = now
            if timeout is not None and now - start > timeout:
                raise TimeoutError("no message on the step channel")
        kind = 1 if response else 0
        len_field = (_RESP_LEN if response else _REQ_LEN) + seen % 2
        n = int(self._header[len_field])
        offset = self._area(kind, seen)
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
