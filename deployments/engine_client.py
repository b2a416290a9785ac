"""The engine as the LLM server sees it: token ids in, RequestOutput deltas out, plus stats.

`EngineClient` is the interface the server is written against, so tests can inject a scripted
engine (Ray Serve LLM's pattern of injecting the engine class). `LocalEngine` is the real one:
an `LLMEngine` (in-process executor, or the Ray executor for parallel layouts) driven by
`AsyncEngine` inside this replica. The engine itself records each request's timing (carried
by its outputs) and its own counters (`stats`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

from glm53.raycluster.api import (
    AsyncEngine,
    EngineStats,
    ImageInput,
    LLMEngine,
    OutputConstraints,
    RequestOutput,
    SamplingParams,
    make_executor,
)

from .chat import THINK_END
from .config import ServingConfig
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    capacity: str  # one human line: cache tokens, sequences, state slots

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 images: Sequence[ImageInput] = ()) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None:
        """Abort a request (queued behind its own submission, so it cannot be overtaken)."""
        ...

    async def check_request(self, params: SamplingParams) -> None:
        """Raise RequestRejectedError for sampling params this engine can never serve (a
        grammar that does not compile), before a stream is accepted."""
        ...

    def stats(self) -> EngineStats: ...

    def check_health(self) -> None:
        """Raise if the engine can no longer serve."""
        ...

    def shutdown(self) -> None: ...


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
            self.engine = LLMEngine(engine_config, executor, self.constraints)
        except BaseException:
            executor.shutdown()
            raise
        self.async_engine = AsyncEngine(self.engine)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.eos_token_ids = tuple(self.engine.eos_ids)
        self.capacity = executor.cache_plan.describe(self.max_model_len)

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 images: Sequence[ImageInput] = ()) -> AsyncIterator[RequestOutput]:
        return self.async_engine.generate(prompt_ids, params, request_id, images)

    async def check_request(self, params: SamplingParams) -> None:
        if params.structured_output is not None:
            # compiled off the event loop; the engine's step loop then finds it cached
            await asyncio.to_thread(self.constraints.compile, params.structured_output)

    async def abort(self, request_id: str) -> None:
        await self.async_engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_health(self) -> None:
        if self.engine.dead:  # set when the workers or the step loop failed
            raise RuntimeError(f"engine is dead: {self.engine.dead}")

    def shutdown(self) -> None:
        self.engine.shutdown()
