"""The engine: requests in, token deltas out.

`LLMEngine` is the single-threaded core (add_request / abort / step / stats). `AsyncEngine` runs
its step loop in a worker thread and streams per-request deltas to asyncio consumers; requests
and aborts from the event loop are queued and applied between steps, so the core stays
single-threaded. Each delta carries its request's timing (queued, first scheduled, first
token, finished), stamped by the engine as the step loop reaches each milestone.

Overlapped scheduling (`EngineConfig.async_scheduling`): `step` submits step N+1 before it
waits for step N, so the workers never wait for the engine's host work (scheduling, building,
stop rules, outputs). Step N+1 is scheduled as if each sequence sampling in step N had its token
(a placeholder, filled on the device from step N's samples); once step N's result is in, a
sequence that finished by it has its step N+1 work dropped, never emitted. With speculation,
step N+1 verifies the drafts step N proposes, scheduled as if all of step N's drafts were
accepted; the worker settles tokens and positions from step N's acceptance (actors/overlap.py),
except for a sequence of which neither step verifies a draft (adaptive draft length at width 0):
its token is filled on the device, as without speculation, and the step need not wait.
A step whose result the next step needs on the host is waited for before the next one is
scheduled, as in the synchronous loop, if a grammar or penalties read a sampled token; a
speculating request near its end (max_tokens, max_model_len) or before min_tokens, whose draft
counts, proposals or banned tokens would depend on the acceptance, sits the next step out.
With a prefix cache, the KDA state copies the engine queues run before the next step it
builds, which is one step later than in the synchronous loop: see `_checkpoints_due`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from glm53.actors.step import ImageInput, Logprobs, SamplingParams, StepInput, StepOutput

from .batch import build_step_input
from .block_pool import BlockPool
from .config import EngineConfig
from .constraints import OutputConstraints, RequestConstraint
from .draft_policy import DraftLengthPolicy, StepCostModel
from .executor import Executor, make_executor
from .images import check_images
from .prefix_cache import PrefixCache, cache_identity
from .request import FinishReason, Request, RequestTiming
from .scheduler import RequestRejectedError, ScheduledRequest, Scheduler, SchedulerOutput
from .state_checkpoints import CheckpointPool
from .state_slots import StateSlotPool
from .stats import EngineStats, SpecStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class RequestOutput:
    """A delta of one request: tokens generated since the last output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # for prompt tokens 1.. (first chunk on)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # with FinishReason.ERROR
    timing: RequestTiming | None = None  # the engine's milestones so far (None: unknown)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _output(request: Request, tokens: list[int] | None = None,
            logprobs: list[TokenLogprob] | None = None,
            prompt_logprobs: list[TokenLogprob] | None = None,
            error: str | None = None) -> RequestOutput:
    return RequestOutput(request.request_id, tokens or [], request.finish_reason, logprobs,
                         prompt_logprobs, len(request.prompt_ids), len(request.output_ids),
                         error, request.timing)


def _token_logprobs(lp: Logprobs, row: int, k: int, token: int) -> TokenLogprob:
    top = tuple((int(i), float(v)) for i, v in
                zip(lp.top_ids[row, :k], lp.top_logprobs[row, :k], strict=True))
    return TokenLogprob(token, float(lp.token_logprobs[row]), int(lp.ranks[row]), top)


def _prefix_cache(config: EngineConfig, blocks: BlockPool, plan) -> PrefixCache | None:
    if not config.prefix_caching:
        if config.enable_prefix_caching is None:  # the default: say why it is off
            logger.warning("prefix caching is off: %s", config.prefix_caching_refusal)
        return None
    with_mtp = config.with_mtp or config.speculative_method == "mtp"
    identity = cache_identity(config.model, config.dtype, config.quantize_experts, with_mtp)
    return PrefixCache(blocks, CheckpointPool(plan.num_checkpoints), plan.checkpoint_slot,
                       identity, config.prefix_checkpoint_interval, hash_next_token=with_mtp)


class EngineDeadError(RuntimeError):
    """The engine's workers failed; start a new engine."""


@dataclass(frozen=True)
class _InFlight:
    """A committed step the workers run while the engine prepares the next one."""

    step: StepInput
    items: list[ScheduledRequest]
    result: Future[StepOutput]

    def sample_rows(self) -> dict[Request, tuple[int, int, int]]:
        """Each sampling request's sequence index, first sample row (where its placeholders'
        tokens are) and the drafts it verifies."""
        rows, row = {}, 0
        for seq, item in enumerate(self.items):
            if item.samples:
                rows[item.request] = (seq, row, item.num_drafts)
            row += item.num_sample_rows
        return rows


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 constraints: OutputConstraints | None = None) -> None:
        """constraints: the grammar compiler for structured output and thinking budgets
        (built from the tokenizer by the serving layer); without it such requests are
        refused."""
        self.config = config
        self.constraints = constraints
        self.executor = executor or make_executor(config)
        self.dead: str | None = None
        self.model_config = self.executor.model_config
        plan = self.executor.cache_plan
        limit = min(self.model_config.max_position_embeddings, plan.num_tokens)
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds what the model and "
                             f"cache allow ({limit} tokens)")
        blocks = BlockPool(plan.num_blocks, plan.block_size,
                           pool_tokens=self.model_config.index_kpool)
        self.prefix = _prefix_cache(config, blocks, plan)
        self.scheduler = Scheduler(
            blocks, StateSlotPool(plan.num_slots), config.max_num_batched_tokens,
            config.max_num_seqs, self.max_model_len, config.num_speculative_tokens,
            config.max_step_image_bytes, self.prefix)
        self.spec_stats = SpecStats(config.num_speculative_tokens)
        self.draft_policy = _draft_policy(config) if config.adaptive_drafts else None
        self.num_preemptions = 0
        self.eos_ids = self.model_config.eos_token_ids
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self._in_flight: _InFlight | None = None  # overlapped scheduling only
        logger.info(plan.describe(self.max_model_len))

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    images: Sequence[ImageInput] = ()) -> str:
        """Queue a request; raises RequestRejectedError if it can never be served. `images`
        (prompt order) replace the prompt's image placeholders (see check_images)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):  # they index the logits rows
            raise RequestRejectedError(f"stop_token_ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        check_images(prompt_ids, images, self.model_config, self.config.vision,
                     self.config.max_step_image_bytes)
        request = Request(request_id, list(prompt_ids), params, seed, images=tuple(images))
        request.constraint = self._constraint(params)
        self.scheduler.add(request)
        return request_id

    def _constraint(self, params: SamplingParams) -> RequestConstraint | None:
        if self.constraints is None:
            if params.structured_output is not None or params.thinking_budget is not None:
                raise RequestRejectedError("structured output and thinking budgets need an "
                                           "engine built with output constraints")
            return None
        return self.constraints.for_request(params)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        if self.draft_policy is not None:
            self.draft_policy.forget(request_id)
        request.mark_finished(time.monotonic())
        return _output(request)

    @property
    def has_unfinished(self) -> bool:
        """Requests to run, or a step in flight whose result is still to be taken."""
        return self.scheduler.has_unfinished or self._in_flight is not None

    def stats(self) -> EngineStats:
        scheduler, spec = self.scheduler, self.spec_stats
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.blocks.usage,
            state_slot_usage=scheduler.slots.num_allocated / scheduler.slots.num_slots,
            num_preemptions=self.num_preemptions, spec_num_drafts=spec.num_verify_steps,
            spec_num_draft_tokens=spec.num_drafts, spec_num_accepted_tokens=spec.num_accepted,
            spec_accepted_per_pos=tuple(spec.accepted_per_position),
            kv_cache_tokens_per_gib=self.executor.cache_plan.tokens_per_gib,
            spec_draft_tokens_per_pos=tuple(spec.drafts_per_position),
            spec_draft_length_steps=tuple(spec.steps_by_draft_length)
            if self.draft_policy is not None else (),
            **(self.prefix.stats() if self.prefix is not None else {}))

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the step that completed (with overlapped
        scheduling, the one submitted by the call before, or this one when none was)."""
        if self.config.async_scheduling:
            return self._step_overlapped()
        prepared, failed = self._prepare(None)
        if prepared is None:
            return failed
        step, items = prepared
        try:
            result = self.executor.execute(step)
        except Exception as exc:  # noqa: BLE001 - every request must end, with the reason
            return self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        return self._process(step, items, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        fresh = self._in_flight is None  # no step ran before it: see _checkpoints_due
        if fresh:
            self._in_flight, outputs = self._submit(None)
            if self._in_flight is None:
                return outputs
        current, self._in_flight = self._in_flight, None
        hold = self._hold(current.items)
        if hold is not None and fresh and self.prefix is not None:
            hold |= self._checkpoints_due(current.items)
        if hold is not None:  # step N+1 goes before step N's result is read
            self._in_flight, failed = self._submit(current, hold)
            outputs += failed
        try:
            result = current.result.result()
        except Exception as exc:  # noqa: BLE001 - every request must end, with the reason
            return outputs + self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        return outputs + self._process(current.step, current.items, result)

    def _hold(self, items: list[ScheduledRequest]) -> frozenset[Request] | None:
        """The requests that must sit out a next step built before these items' result, or
        None if no such step can be built. The next step may only need, of this result, what
        the workers fill in (sampled tokens; with speculation, emitted tokens, drafts and the
        position shift). None after a sampling request whose next sampling rows read its
        outputs (a grammar's bitmask, the penalties' token counts): waiting for one step keeps
        it at full speed. With speculation, a sampling request sits out if it is within reach
        of its end over two steps (its draft counts and proposals would depend on the
        acceptance) or below min_tokens (its banned tokens would); with sampled drafts the
        step waits instead (the proposer keeps draft distributions for the next step only)."""
        k = self.config.num_speculative_tokens
        hold = set()
        for item in items:
            r = item.request
            if not item.samples:
                continue
            if r.constraint is not None or r.params.uses_penalties:
                return None
            if k and (len(r.output_ids) < r.params.min_tokens or min(
                    r.params.max_tokens - len(r.output_ids),
                    self.max_model_len - r.num_tokens) <= 3 * (k + 1) + 1):
                if self.config.draft_sampling == "probabilistic":
                    return None
                hold.add(r)
        return frozenset(hold)

    def _checkpoints_due(self, items: list[ScheduledRequest]) -> frozenset[Request]:
        """The requests that the step `items` leaves at a prefix-cache checkpoint position.
        A state copy the engine queues runs before the next step it builds, so a position
        reached by step N is checkpointed when the engine reads step N-1's result (step N,
        then in flight, is passed to the scheduler's update). A step that had no step before
        it in flight gets no such reading: its requests at a checkpoint position sit out the
        next step, and are checkpointed when its own result is read (the KDA state still at
        that position)."""
        return frozenset(item.request for item in items
                         if self.prefix.checkpoint_due(item.request))

    def _submit(self, in_flight: _InFlight | None, hold: frozenset[Request] = frozenset()
                ) -> tuple[_InFlight | None, list[RequestOutput]]:
        prepared, failed = self._prepare(in_flight, hold)
        if prepared is None:
            return None, failed
        step, items = prepared
        return _InFlight(step, items, self.executor.submit(step)), failed

    def _prepare(self, in_flight: _InFlight | None, hold: frozenset[Request] = frozenset()
                 ) -> tuple[tuple[StepInput, list[ScheduledRequest]] | None,
                            list[RequestOutput]]:
        """Schedule (leaving out `hold`), build and commit the next step (None if nothing
        runs), and the outputs of requests failed because their input could not be built."""
        num_drafts = self._choose_draft_length()
        scheduled = self.scheduler.schedule(hold)
        self.num_preemptions += len(scheduled.preempted)
        if not scheduled.scheduled:
            return None, []
        now = time.monotonic()
        for item in scheduled.scheduled:
            item.request.mark_scheduled(now)
        rows = None if in_flight is None else in_flight.sample_rows()
        try:
            step = self._build(next(self._step_ids), scheduled.scheduled, rows, num_drafts)
        except Exception:  # noqa: BLE001 - one request's data; find it, fail it, run the rest
            return None, self._fail_unbuildable(scheduled.scheduled, rows)
        if self.prefix is not None and (copies := self.prefix.take_copies()) is not None:
            step = replace(step, state_copies=copies)
        self.scheduler.commit(scheduled.scheduled,
                              None if step.propose is None else step.propose.tolist())
        return (step, scheduled.scheduled), []

    def _process(self, step: StepInput, items: list[ScheduledRequest],
                 result: StepOutput) -> list[RequestOutput]:
        """Apply a step's result: tokens, stop rules, drafts, and the outputs it gives."""
        prompt_lps = self._prompt_logprobs(step, result.prompt_logprobs, items)
        accepted = None if result.num_accepted is None else result.num_accepted.tolist()
        drafts = None if result.draft_ids is None else result.draft_ids.tolist()
        self.spec_stats.record(items, accepted)
        if self.draft_policy is not None:
            self.draft_policy.observe(items, accepted)
        progressed = self.scheduler.update(
            items, result.sampled.tolist(), self.eos_ids, accepted, drafts,
            self._in_flight.items if self._in_flight is not None else ())
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for p in progressed:
            request, logprobs = p.request, None
            request.mark_token(now)
            if request.finished:
                request.mark_finished(now)
                if self.draft_policy is not None:
                    self.draft_policy.forget(request.request_id)
            if result.logprobs is not None and request.params.logprobs is not None:
                logprobs = [_token_logprobs(result.logprobs, p.first_row + j,
                                            request.params.logprobs, token)
                            for j, token in enumerate(p.tokens)]
            outputs.append(_output(request, p.tokens, logprobs, prompt_lps.pop(request, None)))
        for request, lps in prompt_lps.items():  # prompt chunks that sampled nothing yet
            if not request.finished:  # (an abort during the step has had its output)
                outputs.append(_output(request, prompt_logprobs=lps))
        return outputs

    def _choose_draft_length(self) -> int:
        """Drafts each running request verifies this step and gets proposed for the next:
        num_speculative_tokens, or with adaptive draft length the policy's choice for the
        running batch (drafts beyond it are dropped unverified)."""
        if self.draft_policy is None:
            return self.config.num_speculative_tokens
        running = self.scheduler.running
        if not running:
            return self.config.num_speculative_tokens
        width = self.draft_policy.choose([r.request_id for r in running])
        for request in running:
            del request.draft_ids[width:]
        self.spec_stats.record_draft_length(width)
        return width

    def _build(self, step_id: int, items: list,
               in_flight_rows: dict[Request, tuple[int, int, int]] | None = None,
               num_drafts: int | None = None) -> StepInput:
        return build_step_input(step_id, SchedulerOutput(list(items)),
                                self.scheduler.blocks.block_size, self.eos_ids,
                                self.config.num_speculative_tokens, self.max_model_len,
                                in_flight_rows, num_drafts)

    def _fail_unbuildable(self, items: list,
                          in_flight_rows: dict[Request, tuple[int, int, int]] | None,
                          ) -> list[RequestOutput]:
        """A step input could not be built: build each request alone and fail (ERROR) the
        ones that cannot be, freeing their resources. Nothing ran (nor was committed), so the
        others are scheduled again by the next step as if this one had not happened."""
        failed = []
        for item in items:
            try:
                self._build(-1, [item], in_flight_rows)
            except Exception as exc:  # noqa: BLE001 - this request's own fault
                request = item.request
                logger.exception("request %s cannot be run; failing it", request.request_id)
                self.scheduler.finish(request, FinishReason.ERROR)
                request.mark_finished(time.monotonic())
                failed.append(_output(request,
                                      error=f"request cannot be run: {type(exc).__name__}"))
        if not failed:
            raise RuntimeError("a step input could not be built, yet each request builds alone")
        return failed

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """The workers are gone: finish every request with an error; refuse new ones."""
        logger.error(message)
        self.dead = message
        self._in_flight = None  # its result, if any, belongs to requests ended here
        failed = []
        now = time.monotonic()
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request, FinishReason.ERROR)
            request.mark_finished(now)
            failed.append(_output(request, error=message))
        return failed

    def _prompt_logprobs(self, step, lp: Logprobs | None, items) -> dict[Request, list]:
        if lp is None:
            return {}
        out: dict[Request, list[TokenLogprob]] = {}
        for row, (seq, target, k) in enumerate(zip(step.prompt_logprob_seqs,
                                                   step.prompt_logprob_targets,
                                                   step.prompt_logprob_k, strict=True)):
            request = items[int(seq)].request
            out.setdefault(request, []).append(_token_logprobs(lp, row, int(k), int(target)))
        for request, entries in out.items():
            request.num_prompt_logprobs_done += len(entries)
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[list[int]]:
        """Run prompts to completion concurrently (offline use); returns output ids in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished:
            for out in self.step():
                if out.finish_reason == FinishReason.ERROR:
                    raise EngineDeadError(out.error)
                results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()


def _draft_policy(config: EngineConfig) -> DraftLengthPolicy:
    k = config.num_speculative_tokens
    if config.draft_cost_table is not None:
        cost = StepCostModel.from_bench_record(config.draft_cost_table)
        logger.info("adaptive draft length (0..%d) with step times measured in %s", k,
                    cost.source)
    else:
        cost = StepCostModel.default(k)
        logger.warning("adaptive draft length (0..%d) with the DEFAULT step-time table "
                       "(estimates, not measured here): pass a `glm53 bench latency --json` "
                       "record as draft_cost_table", k)
    return DraftLengthPolicy(k, cost)


class AsyncEngine:
    """asyncio front of an LLMEngine: `generate` yields RequestOutput deltas of one request.

    The step loop survives anything one request does (the engine fails that request alone).
    If the loop itself fails, the engine is marked dead (`engine.dead`, which health checks
    read), every request in flight or queued ends with an ERROR output, and new ones are
    refused with EngineDeadError: nothing waits on a loop that is gone.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ops: deque = deque()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, images: Sequence[ImageInput] = (),
                       ) -> AsyncIterator[RequestOutput]:
        if self.engine.dead:
            raise EngineDeadError(self.engine.dead)
        request_id = request_id or f"req-{next(self.engine._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[request_id] = queue
        done = loop.create_future()
        self._ops.append(("add", (prompt_ids, params, request_id, images), done))
        self._ensure_loop(loop)
        finished = False
        try:
            await done  # raises the rejection, if any
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self.engine.dead:  # the consumer left early (maybe
                self._ops.append(("abort", request_id, None))  # before the add): ops run in order
                self._ensure_loop(loop)

    async def abort(self, request_id: str) -> None:
        if self.engine.dead:
            return
        self._ops.append(("abort", request_id, None))
        self._ensure_loop(asyncio.get_running_loop())

    def _ensure_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._run(loop))

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while (self._ops or self.engine.has_unfinished) and not self.engine.dead:
                outputs = await asyncio.to_thread(self._step_once, loop)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            if self.engine.dead:  # the workers failed (their requests already have errors)
                self._fail_pending(self.engine.dead)
        except BaseException as exc:
            logger.exception("the engine loop failed; the engine is dead")
            self._fail_pending(f"engine loop failed: {type(exc).__name__}")
            if not isinstance(exc, Exception):
                raise  # cancellation and exit requests go on

    def _fail_pending(self, message: str) -> None:
        """Mark the engine dead; end every waiting consumer and refuse the queued adds."""
        self.engine.dead = self.engine.dead or message
        while self._ops:
            kind, _, done = self._ops.popleft()
            if kind == "add":
                _resolve(done, EngineDeadError(message))
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(request_id, [], FinishReason.ERROR, error=message))

    def _step_once(self, loop: asyncio.AbstractEventLoop) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._ops:
            kind, payload, done = self._ops.popleft()
            if kind == "add":
                try:
                    self.engine.add_request(*payload)
                    loop.call_soon_threadsafe(_resolve, done, None)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    loop.call_soon_threadsafe(_resolve, done, exc)
            elif (aborted := self.engine.abort(payload)) is not None:
                outputs.append(aborted)
        return outputs + self.engine.step()


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


