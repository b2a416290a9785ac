"""Request: one generation's token ids, counters and resources (no tensors, no text).

The scheduler's single rule works on counters: a request is "behind" by
`num_tokens - num_computed_tokens` tokens (a prompt chunk, the last sampled token, later the
draft tokens to verify), and each step moves it forward within the token budget. With
overlapped scheduling a step is scheduled before the previous one's sampled token is known:
that token is a placeholder (`num_placeholders`), counted for scheduling, filled on the device.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from glm53.actors.step import ImageInput, SamplingParams

if TYPE_CHECKING:  # constraints imports the scheduler, which imports this module
    from .constraints import RequestConstraint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # the engine failed (e.g. a worker died); the output carries the message


@dataclass(frozen=True)
class RequestTiming:
    """When the engine reached a request's milestones, in `time.monotonic` seconds (None: not
    yet). Frozen and replaced at each milestone, so outputs can carry it to other threads."""

    queued: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one drawn by the engine
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # prompt positions whose next-token logprob has been reported (not repeated on recompute)
    num_prompt_logprobs_done: int = 0
    draft_ids: list[int] = field(default_factory=list)  # proposed tokens awaiting verification
    # tokens sampled by a step in flight, not yet known here (they follow output_ids)
    num_placeholders: int = 0
    # block_ids[:num_blocks_sent] are in the workers' block-table row of state_slot (0: the
    # row is to be reset; the step builder sends the rest as a delta)
    num_blocks_sent: int = 0
    constraint: RequestConstraint | None = None  # grammar / thinking budget state
    images: tuple[ImageInput, ...] = ()  # in prompt order; their placeholders are prompt ids
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    # block_ids as int32 for the step's block table, and the list it mirrors
    _table: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), init=False,
                               repr=False)
    _table_of: list[int] | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def image_digests(self) -> tuple[str, ...]:
        """What the prompt's image placeholders stand for (for prefix-cache keys)."""
        return tuple(image.digest for image in self.images)

    def image_chunk(self, n: int, pixel_budget: int,
                    start: int | None = None) -> tuple[int, int]:
        """(tokens, pixel bytes): how many of the `n` tokens from `start` (default: the
        computed ones; a prefix-cache hit at admission starts later) to compute when the step
        may carry `pixel_budget` more bytes of image pixels (a step that computes any
        placeholder of an image carries the whole image), ending the chunk before the first
        image that does not fit; and the bytes the chunk carries."""
        start = self.num_computed_tokens if start is None else start
        used = 0
        for image in self.images:
            if image.offset + image.num_tokens <= start or image.offset >= start + n:
                continue
            if used + image.pixel_values.nbytes > pixel_budget:
                return max(0, image.offset - start), used
            used += image.pixel_values.nbytes
        return n, used

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to compute before the next sample (placeholders and drafts included)."""
        return (self.num_tokens + self.num_placeholders + len(self.draft_ids)
                - self.num_computed_tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of prompt + output + placeholders (-1) + drafts
        (copying only those: a decode step asks for one token of a long output). Drafts that
        a step in flight proposes are -1 too."""
        out: list[int] = []
        base = 0
        for part in (self.prompt_ids, self.output_ids, [-1] * self.num_placeholders,
                     self.draft_ids):
            out += part[max(start - base, 0):max(end - base, 0)]
            base += len(part)
        return out

    def block_table(self) -> np.ndarray:
        """block_ids as an int32 array, converted once per new block rather than every step.
        The scheduler only extends block_ids or replaces the list (allocate, free)."""
        if self._table_of is not self.block_ids or len(self._table) != len(self.block_ids):
            self._table_of = self.block_ids
            self._table = np.asarray(self.block_ids, dtype=np.int32)
        return self._table

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    # milestones keep their first time (a preempted request is scheduled again, recomputed)
    def mark_scheduled(self, now: float) -> None:
        if self.timing.first_scheduled is None:
            self.timing = replace(self.timing, first_scheduled=now)

    def mark_token(self, now: float) -> None:
        if self.timing.first_token is None:
            self.timing = replace(self.timing, first_token=now)

    def mark_finished(self, now: float) -> None:
        if self.timing.finished is None:
            self.timing = replace(self.timing, finished=now)
