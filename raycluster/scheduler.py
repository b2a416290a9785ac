"""Scheduler: one rule for prefill chunks and decodes, FCFS admission, preemption by recompute.

Each step gives every running request (in admission order) up to its pending token count,
within `max_num_batched_tokens`; then admits waiting requests while the budget, `max_num_seqs`,
free blocks and free state slots allow. When a running request cannot get the blocks it needs,
the most recently admitted request is preempted (blocks and state slot freed, counters reset,
requeued at the front) and recomputed later. With a prefix cache (prefix_cache.py), admission
first takes the longest cached prefix, prefill chunks stop at checkpoint positions, and
completed blocks and checkpoints are recorded after each step. Never touches tensors.

A step goes schedule -> (the engine builds its input) -> commit -> (it runs) -> update. `commit`
advances the counters as if the step had run (the workers' block tables included: the next step
sends only blocks added since) and stands a placeholder in for each token it will
sample, so the next step can be scheduled before this one's result is known (overlapped
scheduling); `update` replaces the placeholders by the sampled tokens, rolls back rejected
drafts and applies the stop rules. A request preempted or finished in between keeps nothing of
the counters of the step in flight (its `num_preemptions` tells the incarnation apart).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .prefix_cache import NO_HIT, PrefixCache
from .request import FinishReason, Request, RequestStatus
from .state_slots import StateSlotPool


class RequestRejectedError(ValueError):
    """A request that can never be served under this engine's limits."""


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens
    num_drafts: int = 0  # the last num_drafts of them are drafts to verify
    # the step reaches the request's last token, so its logits sample the next one (and with
    # drafts, every draft row is sampled too)
    samples: bool = False
    incarnation: int = 0  # request.num_preemptions when scheduled

    @classmethod
    def of(cls, request: Request, num_tokens: int, num_drafts: int = 0) -> ScheduledRequest:
        end = request.num_computed_tokens + num_tokens
        samples = end == request.num_tokens + request.num_placeholders + num_drafts
        return cls(request, num_tokens, num_drafts, samples, request.num_preemptions)

    @property
    def num_sample_rows(self) -> int:
        return 1 + self.num_drafts if self.samples else 0


@dataclass(frozen=True)
class Progress:
    """What a step gave one request: the tokens it emitted and its first sample row."""

    request: Request
    tokens: list[int]
    first_row: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockPool, slots: StateSlotPool, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, num_spec: int = 0,
                 max_step_image_bytes: int = 24 << 20, prefix: PrefixCache | None = None) -> None:
        self.blocks, self.slots, self.prefix = blocks, slots, prefix
        self.max_step_image_bytes = max_step_image_bytes  # image pixels one step may carry
        self.num_spec = num_spec  # drafts per step: blocks are kept ahead for their positions
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = min(max_num_seqs, slots.num_slots)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # ----- admission -----
    def add(self, request: Request) -> None:
        need = len(request.prompt_ids) + request.params.max_tokens
        if not request.prompt_ids:
            raise RequestRejectedError("the prompt is empty")
        if request.request_id in self.requests:
            raise RequestRejectedError(f"duplicate request id {request.request_id!r}")
        if need > self.max_model_len:
            raise RequestRejectedError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.params.max_tokens}) = {need} exceeds max_model_len "
                f"{self.max_model_len}")
        if self.blocks.blocks_for_tokens(need) > self.blocks.num_usable:
            raise RequestRejectedError(
                f"{need} tokens can never fit in the KV cache "
                f"({self.blocks.num_usable * self.blocks.block_size} tokens)")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is; returns it (None if unknown or already done)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    # ----- one step -----
    def schedule(self, hold: frozenset[Request] = frozenset()) -> SchedulerOutput:
        """hold: running requests to leave out of this step (the engine needs the result of
        the step in flight for them first)."""
        out = SchedulerOutput()
        budget, pixels = self.max_num_batched_tokens, self.max_step_image_bytes
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING or request in hold:
                continue  # preempted earlier in this loop, or held
            if request.num_pending_tokens > budget:
                request.draft_ids = []  # a verify step is all or nothing
            n = min(request.num_pending_tokens, budget)
            if self.prefix is not None and not request.draft_ids:
                n = self.prefix.limit_chunk(request, n)
            if request.images:
                n, carried = request.image_chunk(n, pixels)
                if n == 0:
                    continue
                pixels -= carried
            if not self._grow(request, request.num_computed_tokens + n, out):
                continue
            out.scheduled.append(ScheduledRequest.of(request, n, len(request.draft_ids)))
            budget -= n
        while self.waiting and budget > 0 and not out.preempted and (
                len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hit = NO_HIT
            if self.prefix is not None:
                if self.prefix.should_wait(request, self.running):
                    break
                hit = self.prefix.match(request)
            n = min(request.num_pending_tokens - hit.num_tokens, budget)
            if self.prefix is not None:
                n = self.prefix.limit_chunk(request, n, start=hit.num_tokens)
            if request.images:
                n, carried = request.image_chunk(n, pixels, start=hit.num_tokens)
                if n == 0:
                    break
                pixels -= carried
            need = (self.blocks.blocks_for_tokens(self._ahead(hit.num_tokens + n))
                    - len(hit.block_ids))
            taken = self.blocks.num_free_in(hit.block_ids)  # cached blocks nobody holds
            if not (self.blocks.can_allocate(need + taken) and self.slots.can_allocate()):
                break
            self.waiting.popleft()
            request.state_slot = self.slots.allocate()
            if self.prefix is not None:
                self.prefix.admit(request, hit)
            request.block_ids = hit.block_ids + self.blocks.allocate(need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, n))
            budget -= n
        return out

    def _ahead(self, num_tokens: int) -> int:
        """Tokens whose rows must have blocks: the computed ones plus the draft positions the
        proposer writes after this step."""
        return min(num_tokens + self.num_spec, self.max_model_len)

    def _grow(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `request` blocks for `num_tokens` (+ lookahead), preempting later requests if
        needed."""
        need = self.blocks.blocks_for_tokens(self._ahead(num_tokens)) - len(request.block_ids)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        if need > 0:
            request.block_ids.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_placeholders = 0
        request.draft_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, finished: bool = False) -> None:
        if request in self.running:
            self.running.remove(request)
        if self.prefix is not None:
            self.prefix.on_release(request, finished)
        if request.block_ids:
            # with a prefix cache, the tail blocks (the least shared) are evicted first
            self.blocks.free(request.block_ids[::-1] if self.prefix else request.block_ids)
            request.block_ids = []
        request.num_blocks_sent = 0
        if request.state_slot is not None:
            self.slots.free(request.state_slot)
            request.state_slot = None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is (waiting or running) and free its resources."""
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request, finished=True)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    # ----- the step is built and sent -----
    def commit(self, scheduled: list[ScheduledRequest],
               proposed: list[int] | None = None) -> None:
        """Count the step as computed: its tokens, and a placeholder for each token position it
        may sample (the target's token after the drafts, which update rolls back as needed).
        `proposed`: per scheduled request, how many drafts the step proposes; they stand in as
        placeholder drafts (-1), so that the next step can verify them before the engine sees
        them."""
        for i, item in enumerate(scheduled):
            request = item.request
            request.num_computed_tokens += item.num_tokens
            request.num_blocks_sent = len(request.block_ids)
            request.draft_ids = []  # the step verifies them: they are placeholders now
            if item.samples:
                request.num_placeholders += 1 + item.num_drafts
                if proposed is not None:
                    request.draft_ids = [-1] * proposed[i]

    # ----- after the step -----
    def update(self, scheduled: list[ScheduledRequest], sampled: list[int],
               eos_ids: tuple[int, ...], num_accepted: list[int] | None = None,
               drafts: list[list[int]] | None = None,
               in_flight: Sequence[ScheduledRequest] = ()) -> list[Progress]:
        """For a committed step: roll back rejected drafts, append each sampling request's
        emitted tokens (its target sample, or its accepted drafts then the target's token) in
        place of its placeholders, apply stop rules, keep the proposer's next drafts, and free
        finished requests. `sampled` holds every sample row in order; `num_accepted` /
        `drafts` are per scheduled request (speculative engines). A request preempted since
        the step was scheduled (its counters already reset) still gets its tokens: they are
        what its recompute would sample.

        Then the prefix cache records the blocks and checkpoints of the step's requests and of
        `in_flight`'s, the step committed after this one (overlapped scheduling): their
        counters already count it, and the state copies queued now run after it."""
        progressed: list[Progress] = []
        row = 0
        for i, item in enumerate(scheduled):
            request = item.request
            first_row, rows = row, item.num_sample_rows
            row += rows
            if request.finished:
                continue  # aborted, or stopped by the step before (overlapped scheduling)
            accepted = num_accepted[i] if num_accepted is not None and rows else 0
            current = item.incarnation == request.num_preemptions
            if current:
                request.num_computed_tokens -= item.num_drafts - accepted
                request.num_placeholders -= rows
            # a later step in flight continues the request: it verifies this one's drafts
            ahead = current and request.num_placeholders > 0
            if not rows:
                continue
            emitted = []
            for token in sampled[first_row:first_row + accepted + 1]:
                request.output_ids.append(token)
                emitted.append(token)
                if request.constraint is not None:
                    request.constraint.advance(token)
                reason = self._stop_reason(request, token, eos_ids)
                if reason is not None:
                    self.finish(request, reason)
                    break
            progressed.append(Progress(request, emitted, first_row))
            if drafts is not None and current and not ahead and not request.finished:
                room = min(request.params.max_tokens - len(request.output_ids),
                           self.max_model_len - request.num_tokens) - 1
                request.draft_ids = [d for d in drafts[i] if d >= 0][:max(room, 0)]
        if self.prefix is not None:
            for request in dict.fromkeys(item.request for item in (*scheduled, *in_flight)):
                if request.status == RequestStatus.RUNNING:
                    self.prefix.after_step(request)
        return progressed

    def _stop_reason(self, request: Request, token: int,
                     eos_ids: tuple[int, ...]) -> FinishReason | None:
        params = request.params
        n_out = len(request.output_ids)
        if request.constraint is not None and request.constraint.finished:
            return FinishReason.STOP  # the grammar took a stop token: it ends the output
        if n_out >= params.min_tokens and (
                token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)):
            return FinishReason.STOP
        if n_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
