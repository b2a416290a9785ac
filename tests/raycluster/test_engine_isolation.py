"""One request cannot take the engine down: parameters the sampler cannot represent are
refused up front, a request whose step input cannot be built fails alone, and if the step
loop itself dies every consumer gets an error (nothing hangs) and the engine says it is dead.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import AsyncEngine, EngineDeadError, LLMEngine
from glm53.raycluster.request import FinishReason
from glm53.raycluster.scheduler import RequestRejectedError

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture
def engine(tiny_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_path), num_blocks=64))


@pytest.mark.parametrize("fields", [
    {"top_k": 2**31}, {"max_tokens": 2**31}, {"seed": 2**63}, {"seed": -(2**63) - 1},
    {"stop_token_ids": (2**63,)}, {"stop_token_ids": (-1,)}, {"temperature": math.nan},
    {"top_p": math.nan}, {"min_p": math.nan}, {"repetition_penalty": math.inf},
    {"presence_penalty": math.nan}, {"frequency_penalty": -math.inf},
])
def test_sampling_params_refuse_what_the_sampler_cannot_represent(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)


def test_type_limits_themselves_are_accepted():
    SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1, seed=2**63 - 1)
    SamplingParams(seed=-(2**63))


def test_stop_token_ids_beyond_the_vocabulary_are_rejected(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestRejectedError, match="stop_token_ids"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(vocab,)))
    assert not engine.has_unfinished


def _smuggled(params: SamplingParams, **fields) -> SamplingParams:
    """Params past their own checks, as a caller that skips validation would build them."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_a_request_that_breaks_the_step_fails_alone(engine):
    """top_k = 2**31 overflows the sampler's int32 column while the step is built: that
    request ends with an error, the one beside it and a later one complete."""
    bad = _smuggled(SamplingParams(max_tokens=6, temperature=1.0), top_k=2**31)

    async def run():
        front = AsyncEngine(engine)
        good, broken = await asyncio.wait_for(asyncio.gather(
            _collect(front.generate([1, 2, 3], PARAMS, "good")),
            _collect(front.generate([4, 5], bad, "bad"))), timeout=60)
        later = await asyncio.wait_for(_collect(front.generate([6], PARAMS, "later")), 60)
        return good, broken, later

    good, broken, later = asyncio.run(run())
    assert broken[-1].finish_reason == FinishReason.ERROR and broken[-1].error
    for outs in (good, later):
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(o.new_token_ids) for o in outs) == 6
    assert engine.dead is None
    s = engine.scheduler
    assert s.blocks.num_free == s.blocks.num_usable and s.slots.num_free == s.slots.num_slots


def test_a_dead_loop_fails_every_request_and_marks_the_engine_dead(engine, monkeypatch):
    """A bug outside any one request (here: the scheduler's update raises) kills the loop:
    every stream ends with an error instead of hanging, and new requests are refused."""
    def broken_update(*args, **kwargs):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine.scheduler, "update", broken_update)

    async def run():
        front = AsyncEngine(engine)
        streams = [_collect(front.generate([1, 2, i + 3], PARAMS, f"r{i}")) for i in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
        with pytest.raises(EngineDeadError):
            await _collect(front.generate([1], PARAMS, "after"))
        return outs

    for outs in asyncio.run(run()):
        assert outs[-1].finish_reason == FinishReason.ERROR
    assert engine.dead and "RuntimeError" in engine.dead
