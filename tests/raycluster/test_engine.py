"""The engine end to end on a tiny model (CPU, in-process executor): continuous batching,
chunked prefill, preemption, aborts, seeded sampling, logprobs, the asyncio stream, and what the
engine reports (per-request timing, stats)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from glm53.actors.loader import load_model
from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import AsyncEngine, LLMEngine
from glm53.raycluster.request import FinishReason
from glm53.raycluster.scheduler import RequestRejectedError
from glm53.raycluster.stats import EngineStats
from tests.naive_runner import SequenceRunner, generate

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path = tiny_checkpoint
    return path, load_model(path, progress=False)


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    return LLMEngine(EngineConfig(model=str(path), **kw))


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 8, 9, 16, 17, 23, 31, 40, 47, 55, 62, 4, 33][:n]
    return [torch.randint(0, vocab, (n_tok,), generator=gen).tolist() for n_tok in lengths]


def _free_everything(engine: LLMEngine) -> bool:
    s = engine.scheduler
    return (s.blocks.num_free == s.blocks.num_usable and s.slots.num_free == s.slots.num_slots
            and not s.requests)


def test_continuous_batching_equals_each_request_alone(tiny):
    path, model = tiny
    prompts = _prompts(16, model.config.vocab_size)
    alone = [generate(model, p, GREEDY.max_tokens, temperature=0.0) for p in prompts]
    engine = _engine(path, max_num_batched_tokens=24, max_num_seqs=6)
    results: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(prompts)
    while pending or engine.has_unfinished:
        for _ in range(min(3, len(pending))):  # requests keep arriving while others run
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [results[i] for i in ids] == alone
    assert _free_everything(engine)


def test_engine_greedy_matches_transformers(tiny):
    from tests.actors.oracle import hf_greedy, load_hf

    path, model = tiny
    prompts = _prompts(16, model.config.vocab_size)[9:12]
    hf = load_hf(path)
    outs = _engine(path, max_num_batched_tokens=16).generate(prompts, GREEDY)
    assert outs == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_chunk_sizes_do_not_change_prompt_logprobs(tiny):
    path, model = tiny
    prompt = _prompts(16, model.config.vocab_size)[12]  # 55 tokens
    runner = SequenceRunner(model, max_seqs=1, max_len=128)
    runner.add(0)
    ref = torch.log_softmax(runner.step_logits({0: prompt}), dim=-1)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    for budget in (3, 7, 13, 16, 64):  # not multiples of 4 / of the block size, and whole
        engine = _engine(path, max_num_batched_tokens=budget)
        engine.add_request(prompt, params)
        got = []
        while engine.has_unfinished:
            for out in engine.step():
                got.extend(out.prompt_logprobs or [])
        assert [g.token_id for g in got] == prompt[1:]
        assert np.abs(np.array([g.logprob for g in got]) - want.numpy()).max() <= 1e-4


def test_preemption_recomputes_and_changes_nothing(tiny):
    path, model = tiny
    prompts = _prompts(12, model.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    roomy = _engine(path, max_num_batched_tokens=64).generate(prompts, params)
    engine = _engine(path, max_num_batched_tokens=64, num_blocks=13, block_size=8)
    tight = engine.generate(prompts, params)
    assert tight == roomy
    assert _free_everything(engine)
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len 96"):
        engine.add_request(list(range(90)), SamplingParams(max_tokens=10))


def test_preemption_happens_under_a_tight_cache(tiny):
    path, model = tiny
    prompts = _prompts(12, model.config.vocab_size, seed=1)
    engine = _engine(path, max_num_batched_tokens=64, num_blocks=13, block_size=8)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    preemptions = 0
    while engine.has_unfinished:
        engine.step()
        live = engine.scheduler.requests.values()
        preemptions = max(preemptions, sum(r.num_preemptions for r in live))
    assert preemptions > 0
    assert engine.stats().num_preemptions >= preemptions  # the engine's cumulative count


def test_rejections_are_clear(tiny):
    path, model = tiny
    engine = _engine(path, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestRejectedError, match="token ids"):
        engine.add_request([model.config.vocab_size], SamplingParams())
    assert _free_everything(engine)


def test_abort_mid_prefill_and_mid_decode_frees_everything(tiny):
    path, model = tiny
    engine = _engine(path, max_num_batched_tokens=8)
    long_id = engine.add_request(list(range(1, 60)), GREEDY)
    short_id = engine.add_request([5, 6], GREEDY)
    engine.step()  # the long prompt is mid-prefill
    assert engine.scheduler.requests[long_id].num_computed_tokens < 59
    assert engine.abort(long_id).finish_reason == FinishReason.ABORT
    while not engine.scheduler.requests[short_id].output_ids:
        engine.step()
    assert engine.abort(short_id).finish_reason == FinishReason.ABORT  # mid-decode
    assert engine.abort(short_id) is None  # already gone
    assert _free_everything(engine)


def test_engine_records_each_requests_milestones(tiny):
    path, model = tiny
    engine = _engine(path, max_num_batched_tokens=8, max_num_seqs=1)
    prompt = _prompts(16, model.config.vocab_size)[9]  # 31 tokens: four prefill chunks
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first, second = engine.add_request(prompt, params), engine.add_request(prompt, params)
    outputs: dict[str, list] = {first: [], second: []}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id].append(out)
    for outs in outputs.values():
        t = outs[-1].timing
        assert t.queued < t.first_scheduled < t.first_token < t.finished
        # every output carries the milestones reached so far
        assert [o.timing.finished is not None for o in outs] == [False] * (len(outs) - 1) + [True]
        assert {o.timing.first_token for o in outs} == {t.first_token}
    # one sequence at a time: the second is first scheduled once the first has finished
    assert outputs[second][-1].timing.first_scheduled >= outputs[first][-1].timing.finished


def test_aborted_requests_carry_their_timing(tiny):
    path, _ = tiny
    engine = _engine(path, max_num_seqs=1)
    running = engine.add_request([1, 2, 3], GREEDY)
    waiting = engine.add_request([4, 5], GREEDY)
    engine.step()
    never_ran = engine.abort(waiting).timing
    assert never_ran.first_scheduled is None and never_ran.finished > never_ran.queued
    ran = engine.abort(running).timing
    assert ran.queued < ran.first_scheduled < ran.first_token < ran.finished


def test_stats_snapshot_the_scheduler_and_ledgers(tiny):
    path, model = tiny
    engine = _engine(path, max_num_seqs=2)
    prompts = _prompts(3, model.config.vocab_size)
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    capacity = engine.executor.cache_plan.tokens_per_gib  # static: the cache's layout
    assert capacity > 0
    assert engine.stats() == EngineStats(num_waiting=3, kv_cache_tokens_per_gib=capacity)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.state_slot_usage) == (2, 1, 1.0)
    assert 0 < stats.kv_cache_usage < 1
    while engine.has_unfinished:
        engine.step()
    # the prefix cache (on by default) looked every prompt up; they share nothing
    assert engine.stats() == EngineStats(kv_cache_tokens_per_gib=capacity,
                                         prefix_cache_queries=sum(map(len, prompts)))


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    path, model = tiny
    prompts = _prompts(6, model.config.vocab_size, seed=2)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = _engine(path).generate([prompts[4]], seeded)[0]
    noisy = SamplingParams(max_tokens=5, temperature=0.8, ignore_eos=True)
    crowd = _engine(path, max_num_batched_tokens=9).generate(
        prompts[:4] + [prompts[4]] + prompts[5:], [noisy] * 4 + [seeded] + [noisy])
    assert crowd[4] == alone


def test_stop_rules(tiny):
    path, model = tiny
    engine = _engine(path)
    prompt = _prompts(16, model.config.vocab_size)[8]
    free_run = engine.generate([prompt], GREEDY)[0]
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,),
                            ignore_eos=True)
    assert engine.generate([prompt], params)[0] == free_run[:first + 1]
    late = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,),
                          ignore_eos=True, min_tokens=first + 2)
    out = engine.generate([prompt], late)[0]
    # the stop token is banned until min_tokens outputs exist, then stops the request again
    assert out[:first] == free_run[:first] and out[first] != stop_at
    assert stop_at not in out[:late.min_tokens]
    assert stop_at not in out[:-1] and (out[-1] == stop_at or len(out) == late.max_tokens)


def test_async_stream_yields_deltas_and_finish_reasons(tiny):
    path, model = tiny
    engine = AsyncEngine(_engine(path, max_num_batched_tokens=16))
    prompts = _prompts(3, model.config.vocab_size)

    async def collect(prompt, params):
        outs = [o async for o in engine.generate(prompt, params)]
        return outs

    async def main():
        a = collect(prompts[0], GREEDY)
        b = collect(prompts[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        return await asyncio.gather(a, b)

    first, second = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in first) == GREEDY.max_tokens
    assert first[-1].finish_reason == FinishReason.LENGTH
    assert first[-1].timing.finished >= first[-1].timing.first_token > first[0].timing.queued
    assert [o.finish_reason for o in second[:-1]] == [None] * (len(second) - 1)
    assert second[-1].num_output_tokens == 3
    assert _free_everything(engine.engine)


def test_async_consumer_leaving_early_aborts(tiny):
    path, model = tiny
    engine = AsyncEngine(_engine(path))

    async def main():
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(50):
            if not engine.engine.has_unfinished:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert _free_everything(engine.engine)
