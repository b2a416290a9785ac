"""The engine: requests in, token deltas out.

`LLMEngine` is the synchronous core (add_request / abort / step / stats). `AsyncEngine` runs
its step loop in a worker thread and streams per-request deltas to asyncio consumers; requests
and aborts from the event loop are queued and applied between steps, so the core stays
single-threaded. Each delta carries its request's timing (queued, first scheduled, first
token, finished), stamped by the engine as the step loop reaches each milestone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from glm53.actors.step import Logprobs, SamplingParams, StepInput

from .batch import build_step_input
from .block_pool import BlockPool
from .config import EngineConfig
from .constraints import OutputConstraints, RequestConstraint
from .executor import Executor, make_executor
from .prefix_cache import PrefixCache, cache_identity
from .request import FinishReason, Request, RequestTiming
from .scheduler import RequestRejectedError, Scheduler, SchedulerOutput
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
    if not config.enable_prefix_caching:
        return None
    with_mtp = config.with_mtp or config.speculative_method == "mtp"
    identity = cache_identity(config.model, config.dtype, config.quantize_experts, with_mtp)
    return PrefixCache(blocks, CheckpointPool(plan.num_checkpoints), plan.checkpoint_slot,
                       identity, config.prefix_checkpoint_interval, hash_next_token=with_mtp)


class EngineDeadError(RuntimeError):
    """The engine's workers failed; start a new engine."""


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
            config.max_num_seqs, self.max_model_len, config.num_speculative_tokens, self.prefix)
        self.spec_stats = SpecStats(config.num_speculative_tokens)
        self.num_preemptions = 0
        self.eos_ids = self.model_config.eos_token_ids
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        logger.info(plan.describe(self.max_model_len))

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; raises RequestRejectedError if it can never be served."""
        if self.dead:
            raise EngineDeadError(self.dead)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):  # they index the logits rows
            raise RequestRejectedError(f"stop_token_ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        request = Request(request_id, list(prompt_ids), params, seed)
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
        request.mark_finished(time.monotonic())
        return _output(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        scheduler, spec = self.scheduler, self.spec_stats
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.blocks.usage,
            state_slot_usage=scheduler.slots.num_allocated / scheduler.slots.num_slots,
            num_preemptions=self.num_preemptions, spec_num_drafts=spec.num_verify_steps,
            spec_num_draft_tokens=spec.num_drafts, spec_num_accepted_tokens=spec.num_accepted,
            spec_accepted_per_pos=tuple(spec.accepted_per_position),
            **(self.prefix.stats() if self.prefix is not None else {}))

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted)
        if not scheduled.scheduled:
            return []
        now = time.monotonic()
        for item in scheduled.scheduled:
            item.request.mark_scheduled(now)
        try:
            step = self._build(next(self._step_ids), scheduled.scheduled)
        except Exception:  # noqa: BLE001 - one request's data; find it, fail it, run the rest
            return self._fail_unbuildable(scheduled.scheduled)
        if self.prefix is not None and (copies := self.prefix.take_copies()) is not None:
            step = replace(step, state_copies=copies)
        try:
            result = self.executor.execute(step)
        except Exception as exc:  # noqa: BLE001 - every request must end, with the reason
            return self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        items = scheduled.scheduled
        prompt_lps = self._prompt_logprobs(step, result.prompt_logprobs, items)
        accepted = None if result.num_accepted is None else result.num_accepted.tolist()
        drafts = None if result.draft_ids is None else result.draft_ids.tolist()
        self.spec_stats.record(items, accepted)
        progressed = self.scheduler.update(items, result.sampled.tolist(), self.eos_ids,
                                           accepted, drafts)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for p in progressed:
            request, logprobs = p.request, None
            request.mark_token(now)
            if request.finished:
                request.mark_finished(now)
            if result.logprobs is not None and request.params.logprobs is not None:
                logprobs = [_token_logprobs(result.logprobs, p.first_row + j,
                                            request.params.logprobs, token)
                            for j, token in enumerate(p.tokens)]
            outputs.append(_output(request, p.tokens, logprobs, prompt_lps.pop(request, None)))
        for request, lps in prompt_lps.items():  # prompt chunks that sampled nothing yet
            if not request.finished:  # (an abort during the step has had its output)
                outputs.append(_output(request, prompt_logprobs=lps))
        return outputs

    def _build(self, step_id: int, items: list) -> StepInput:
        return build_step_input(step_id, SchedulerOutput(list(items)),
                                self.scheduler.blocks.block_size, self.eos_ids,
                                self.config.num_speculative_tokens, self.max_model_len)

    def _fail_unbuildable(self, items: list) -> list[RequestOutput]:
        """A step input could not be built: build each request alone and fail (ERROR) the
        ones that cannot be, freeing their resources. Nothing ran, so the others are
        scheduled again by the next step as if this one had not happened."""
        failed = []
        for item in items:
            try:
                self._build(-1, [item])
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
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.engine.dead:
            raise EngineDeadError(self.engine.dead)
        request_id = request_id or f"req-{next(self.engine._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[request_id] = queue
        done = loop.create_future()
        self._ops.append(("add", (prompt_ids, params, request_id), done))
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


