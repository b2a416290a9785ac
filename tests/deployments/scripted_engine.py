"""A scripted engine for Serve tests: it "generates" the text the prompt asks for.

Injected into the LLM-server deployment instead of the real engine (Ray Serve LLM's pattern),
so the end-to-end tests can force model output (tool calls, reasoning) through the real
server, parsers and HTTP stack. The last user message must contain `SCRIPT:` followed by the
text to produce; it comes back one token per step (tiny byte-level tokenizer), then an eos,
each delta with the engine-side timing a real engine records (queued, then first scheduled
QUEUE_S later, first token, finished).
A script containing `FAIL!` makes the engine raise there (an engine failure mid-request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

from glm53.deployments.config import ServingConfig
from glm53.deployments.tokenizer import load_tokenizer
from glm53.raycluster.api import (
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestTiming,
    SamplingParams,
)

MARKER = "SCRIPT:"
FAIL = "FAIL!"
QUEUE_S = 0.01  # how long each request waits for the scripted scheduler


class ScriptedEngine:
    max_model_len = 1024
    capacity = "scripted engine (no cache)"

    def __init__(self, config: ServingConfig, model_dir: Path, device: str) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = len(self.tokenizer)
        self.eos_token_ids = (self.tokenizer.eos_token_id,)
        self.running = 0

    def _script(self, prompt_ids: list[int]) -> str:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return text.rsplit(MARKER, 1)[-1].split("<|assistant|>")[0] if MARKER in text else ""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str, images=()) -> AsyncIterator[RequestOutput]:
        script, fails, _ = self._script(prompt_ids).partition(FAIL)
        ids = list(self.tokenizer.encode(script, add_special_tokens=False))[:params.max_tokens]
        stop = len(ids) < params.max_tokens
        if stop:
            ids.append(self.eos_token_ids[0])
        self.running += 1
        try:
            if fails:
                for i, token in enumerate(ids):
                    yield RequestOutput(request_id, [token], num_prompt_tokens=len(prompt_ids),
                                        num_output_tokens=i + 1)
                raise RuntimeError("scripted engine failure")
            timing = RequestTiming(time.monotonic())
            await asyncio.sleep(QUEUE_S)
            timing = dataclasses.replace(timing, first_scheduled=time.monotonic())
            for i, token in enumerate(ids):
                await asyncio.sleep(0.002)
                last = i == len(ids) - 1
                reason = (FinishReason.STOP if stop else FinishReason.LENGTH) if last else None
                now = time.monotonic()
                timing = dataclasses.replace(timing, first_token=timing.first_token or now,
                                             finished=now if last else None)
                yield RequestOutput(request_id, [token], reason,
                                    num_prompt_tokens=len(prompt_ids), num_output_tokens=i + 1,
                                    timing=timing)
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        pass

    async def check_request(self, params: SamplingParams) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.running)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ReplicaEngine(ScriptedEngine):
    """Answers with the id of the Serve replica it runs in (which replica a request reached)."""

    def _script(self, prompt_ids: list[int]) -> str:
        from ray import serve

        return "</think>replica=" + serve.get_replica_context().replica_id.unique_id
