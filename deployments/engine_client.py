"""The engine as the LLM server sees it: token ids in, RequestOutput deltas out, plus stats.

`EngineClient` is the interface the server is written against, so tests can inject a scripted
engine (Ray Serve LLM's pattern of injecting the engine class). `LocalEngine` is the real one:
an `LLMEngine` (in-process executor, or the Ray executor for parallel layouts) driven by
`AsyncEngine` inside this replica. It also remembers each request's engine-side timestamps
(queued, first scheduled) for the latency metrics, and counts preemptions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.constraints import OutputConstraints
from glm53.raycluster.engine import AsyncEngine, LLMEngine, RequestOutput
from glm53.raycluster.request import Request

from .chat import THINK_END
from .config import ServingConfig
from .metrics import EngineStats
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    capacity: str  # one human line: cache tokens, sequences, state slots

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None:
        """Abort a request (queued behind its own submission, so it cannot be overtaken)."""
        ...

    async def check_request(self, params: SamplingParams) -> None:
        """Raise RequestRejectedError for sampling params this engine can never serve (a
        grammar that does not compile), before a stream is accepted."""
        ...

    def stats(self) -> EngineStats: ...

    def pop_times(self, request_id: str) -> tuple[float | None, float | None]:
        """(queued, first scheduled) monotonic times of a finished request, if known."""
        ...

    def check_health(self) -> None:
        """Raise if the engine can no longer serve."""
        ...

    def shutdown(self) -> None: ...


class _TrackedEngine(LLMEngine):
    """LLMEngine that keeps its requests' queue/schedule times and counts preemptions."""

    def __init__(self, config: EngineConfig, executor,
                 constraints: OutputConstraints | None = None) -> None:
        super().__init__(config, executor, constraints)
        self.times: dict[str, list[float | None]] = {}  # id -> [queued, first scheduled]
        self.num_preemptions = 0
        schedule = self.scheduler.schedule

        def timed_schedule():
            out = schedule()
            now = time.monotonic()
            self.num_preemptions += len(out.preempted)
            for item in out.scheduled:
                entry = self.times.get(item.request.request_id)
                if entry is not None and entry[1] is None:
                    entry[1] = now
            return out

        # NOTE: wraps the instance's method rather than editing the scheduler: timing is a
        # serving concern, and the scheduler stays free of clocks.
        self.scheduler.schedule = timed_schedule

    def add_request(self, prompt_ids, params, request_id=None) -> str:
        request_id = super().add_request(prompt_ids, params, request_id)
        request: Request = self.scheduler.requests[request_id]
        self.times[request_id] = [request.arrival_time, None]
        return request_id


def _spec_totals(engine: LLMEngine) -> dict:
    spec = getattr(engine, "spec_stats", None)
    if spec is None:
        return {}
    return {"spec_num_drafts": spec.num_verify_steps, "spec_num_draft_tokens": spec.num_drafts,
            "spec_num_accepted_tokens": spec.num_accepted,
            "spec_accepted_per_pos": tuple(spec.accepted_per_position)}


def make_executor(config: EngineConfig):
    """The engine's executor for `config` (the Ray executor when it spans several GPUs)."""
    from glm53.raycluster import engine as engine_module
    from glm53.raycluster.executor import InProcessExecutor

    factory = getattr(engine_module, "make_executor", None)
    if factory is not None:
        return factory(config)
    if config.world_size > 1:
        raise NotImplementedError("tensor/expert/decode-context parallel sizes > 1 are not "
                                  "supported yet by this engine build")
    return InProcessExecutor(config)


class LocalEngine:
    """The real engine, running in this process (its workers may be Ray actors)."""

    def __init__(self, config: ServingConfig, model_dir: Path, device: str) -> None:
        engine_config = config.engine_config(model_dir, device)
        executor = make_executor(engine_config)
        try:
            limit = min(executor.model_config.max_position_embeddings,
                        executor.cache_plan.num_tokens)
            max_len = config.max_model_len
            if max_len is not None and max_len > limit and config.from_profile("max_model_len"):
                logger.warning("profile %s asks for max_model_len %d; this model and cache "
                               "allow %d, serving that", config.profile, max_len, limit)
                engine_config = dataclasses.replace(engine_config, max_model_len=limit)
            tokenizer, mc = load_tokenizer(model_dir), executor.model_config
            self.constraints = OutputConstraints.from_tokenizer(
                tokenizer, mc.vocab_size, mc.eos_token_ids,
                tokenizer.get_added_vocab().get(THINK_END))
            self.engine = _TrackedEngine(engine_config, executor, self.constraints)
        except BaseException:
            executor.shutdown()
            raise
        self.async_engine = AsyncEngine(self.engine)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = tuple(self.engine.eos_ids)
        self.capacity = executor.cache_plan.describe(self.max_model_len)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]:
        return self.async_engine.generate(prompt_ids, params, request_id)

    async def check_request(self, params: SamplingParams) -> None:
        if params.structured_output is not None:
            # compiled off the event loop; the engine's step loop then finds it cached
            await asyncio.to_thread(self.constraints.compile, params.structured_output)

    async def abort(self, request_id: str) -> None:
        await self.async_engine.abort(request_id)

    def stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        slots = scheduler.slots
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.blocks.usage,
            state_slot_usage=slots.num_allocated / slots.num_slots,
            num_preemptions=self.engine.num_preemptions, **_spec_totals(self.engine))

    def pop_times(self, request_id: str) -> tuple[float | None, float | None]:
        entry = self.engine.times.pop(request_id, None)
        return (entry[0], entry[1]) if entry else (None, None)

    def check_health(self) -> None:
        dead = getattr(self.engine, "dead", None)  # set when the workers failed
        if dead:
            raise RuntimeError(f"engine is dead: {dead}")

    def shutdown(self) -> None:
        self.engine.shutdown()
