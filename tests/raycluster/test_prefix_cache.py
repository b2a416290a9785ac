"""Prefix caching on the tiny model (CPU): outputs with the cache equal outputs without it over
a randomized multi-turn workload (shared system prompts, branches, aborts, preemption, eviction),
with MTP and DFlash speculation and overlapped scheduling too; a replayed chat is served from
the cache; n > 1 choices share their prefill; a DFlash draft resumes from the ring saved with
the checkpoint; overlapped scheduling checkpoints what the synchronous loop does; hashes cover
what changes a block's rows; the counters add up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.loader import read_config
from glm53.actors.step import SamplingParams
from glm53.actors.tiny import write_tiny_draft
from glm53.kernels.ref.latent_quant import unpack_fp8
from glm53.raycluster.block_pool import BlockPool
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.prefix_cache import PrefixCache, cache_identity
from glm53.raycluster.request import Request
from glm53.raycluster.state_checkpoints import CheckpointPool

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIGHT = dict(num_blocks=30, block_size=8, max_num_batched_tokens=32, max_num_seqs=4,
             prefix_checkpoint_interval=16, prefix_checkpoints=5)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


@pytest.fixture(scope="module")
def draft(tiny, tmp_path_factory):
    """A tiny DFlash draft of the tiny model (a 16-token window: two blocks of TIGHT)."""
    return str(write_tiny_draft(tmp_path_factory.mktemp("dflash") / "draft", read_config(tiny),
                                seed=2))


def _spec(method: str | None, draft: str) -> dict:
    return {None: {}, "mtp": dict(speculative_method="mtp", num_speculative_tokens=2),
            "dflash": dict(speculative_method="dflash", num_speculative_tokens=3,
                           draft_model=draft)}[method]


def _engine(path: str, on: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, enable_prefix_caching=on, **{**TIGHT, **kw}))


def _workload(engine: LLMEngine, seed: int) -> dict[str, tuple]:
    """Waves of chat turns over 4 conversations on 2 shared system prompts; each wave also
    branches a conversation (same history, another message) and starts a request it aborts
    two steps later; some turns ask for prompt logprobs. Returns id -> (tokens, prompt lps)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 256, n).tolist() for n in (29, 18)]
    chats = [list(systems[i % 2]) for i in range(4)]
    results: dict[str, tuple] = {}
    for wave in range(3):
        ids, to_abort = {}, []
        for c, history in enumerate(chats):
            history += rng.integers(0, 256, int(rng.integers(3, 12))).tolist()
            lp = 2 if (wave + c) % 5 == 0 else None
            ids[engine.add_request(list(history), SamplingParams(
                max_tokens=int(rng.integers(4, 10)), temperature=0.0, ignore_eos=True,
                prompt_logprobs=lp), f"w{wave}c{c}")] = c
        branch = chats[wave % 4] + rng.integers(0, 256, 5).tolist()
        engine.add_request(branch, GREEDY, f"w{wave}branch")
        to_abort.append(engine.add_request(chats[(wave + 1) % 4] + [7, 7, 7], GREEDY,
                                           f"w{wave}abort"))
        outs: dict[str, list] = {}
        lps: dict[str, list] = {}
        steps = 0
        while engine.has_unfinished:
            if steps == 2:
                for rid in to_abort:
                    engine.abort(rid)
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
                lps.setdefault(out.request_id, []).extend(
                    (e.token_id, e.logprob) for e in out.prompt_logprobs or ())
            steps += 1
        for rid, c in ids.items():
            chats[c] += outs[rid]
        for rid in outs:
            if "abort" not in rid:
                results[rid] = (outs[rid], lps.get(rid, []))
    return results


def _assert_same(off: dict, on: dict) -> None:
    assert off.keys() == on.keys()
    for rid in off:
        assert on[rid][0] == off[rid][0], rid
        a, b = np.array(off[rid][1]).reshape(-1, 2), np.array(on[rid][1]).reshape(-1, 2)
        assert (a[:, 0] == b[:, 0]).all()
        np.testing.assert_allclose(b[:, 1], a[:, 1], atol=1e-4)


def _free_everything(engine: LLMEngine) -> bool:
    s = engine.scheduler
    return (s.blocks.num_free == s.blocks.num_usable and s.slots.num_free == s.slots.num_slots
            and engine.prefix.checkpoints.num_held == 0)


_PLAIN: dict[int, dict] = {}  # seed -> the workload's results without cache or speculation


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("method", [None, "mtp", "dflash"])
def test_randomized_multi_turn_workload_equals_caching_off(tiny, draft, method, overlap):
    """Plain decoding without the cache is the reference of every variant: speculation
    (drafts verified exactly) and overlapped scheduling (the step in flight's tokens known one
    step late) each give its tokens, with the cache on, under preemption and eviction."""
    seed = {None: 1, "mtp": 5, "dflash": 4}[method]
    if seed not in _PLAIN:
        _PLAIN[seed] = _workload(_engine(tiny, False), seed=seed)
    engine = _engine(tiny, True, async_scheduling=overlap, **_spec(method, draft))
    on = _workload(engine, seed=seed)
    _assert_same(_PLAIN[seed], on)
    prefix = engine.prefix
    # the workload really hit, preempted and evicted (blocks and checkpoints)
    assert prefix.hits > 0.2 * prefix.queries and prefix.checkpoint_hits > 5
    assert engine.num_preemptions > 0
    assert engine.scheduler.blocks.num_evictions > 0 and prefix.checkpoints.num_evictions > 0
    engine.step()  # drains the copies queued by the last finishes
    assert _free_everything(engine)


@pytest.mark.parametrize("ring", ["auto", "fp8"])
def test_dflash_hit_resumes_the_draft_ring_of_its_checkpoint(tiny, draft, ring):
    """The checkpoint keeps the draft's context ring with the KDA state: after a second turn
    resumes from the first one's checkpoint, its slot's ring holds the positions (and, within
    rounding, the keys and values) that computing its whole prompt gives, and nothing of the
    request that held the slot in between. An fp8 ring's rows travel with their scales; its
    values then agree within one e4m3 step (the two computations may round a value apart)."""
    rng = np.random.default_rng(8)
    first, between, message = (rng.integers(0, 256, n).tolist() for n in (37, 50, 3))
    rings = {}
    for on in (False, True):
        engine = _engine(tiny, on, max_num_seqs=1, draft_kv_cache_dtype=ring,
                         **_spec("dflash", draft))
        prompt = first + engine.generate([first], GREEDY)[0] + message
        engine.generate([between], GREEDY)  # the only slot changes hands
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        request = engine.scheduler.requests[rid]
        while engine.has_unfinished:
            engine.step()
        proposer = engine.executor.runner.proposer
        values = (unpack_fp8(proposer.ring[0], proposer.draft.config.head_dim)
                  if ring == "fp8" else proposer.ring[0].clone())
        rings[on] = values, proposer.ring_pos[0].clone()
    assert request.num_cached_tokens == 40  # the first turn's last block boundary
    window = rings[False][1]
    assert sorted(window.tolist()) == list(range(len(prompt) - len(window), len(prompt)))
    assert (rings[True][1] == window).all()
    assert rings[False][0].abs().amax() > 0
    tol = 1e-4 if ring == "auto" else 2**-3  # fp8: an e4m3 step is 2^-3 of the value
    torch.testing.assert_close(rings[True][0], rings[False][0], atol=1e-4, rtol=tol)


def _checkpointed(engine: LLMEngine, seed: int) -> tuple[dict, set[bytes]]:
    """Staggered arrivals sharing a system prompt, after a long prompt of its own: outputs,
    and the keys of every checkpoint taken (room for all: none evicted)."""
    keys, save = set(), engine.prefix.checkpoints.save
    engine.prefix.checkpoints.save = lambda h: keys.add(h) or save(h)
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 21).tolist()
    prompts = [rng.integers(0, 256, 50).tolist()] + [
        system + rng.integers(0, 256, int(rng.integers(2, 30))).tolist() for _ in range(5)]
    arrivals, outs = [0, 2, 3, 5, 5, 6], {}
    for step in range(1000):
        for i in (i for i, at in enumerate(arrivals) if at == step):
            engine.add_request(prompts[i], SamplingParams(
                max_tokens=int(rng.integers(5, 20)), temperature=0.0, ignore_eos=True), f"r{i}")
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step > max(arrivals) and not engine.has_unfinished:
            return outs, keys
    raise AssertionError("the workload did not finish")


def test_overlapped_scheduling_checkpoints_what_the_synchronous_loop_does(tiny):
    """A state copy runs before the next step the engine builds, and overlapped scheduling
    builds it before reading the step in flight: each position a step reaches is checkpointed
    when the step before it is read, and a request at a checkpoint position after the first
    step of a busy spell sits the next one out. Either missing loses checkpoints here. (It may
    take more: a request that ends at a block boundary had its last token computed by the
    step in flight when it finished.)"""
    room = dict(num_blocks=200, prefix_checkpoints=64)
    sync_out, sync_keys = _checkpointed(_engine(tiny, True, **room), seed=7)
    out, keys = _checkpointed(_engine(tiny, True, async_scheduling=True, **room), seed=7)
    assert out == sync_out
    assert keys >= sync_keys and len(sync_keys) > 15


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("method", [None, "mtp", "dflash"])
def test_ten_turn_chat_is_served_from_the_cache(tiny, draft, method, overlap):
    """Each turn's cacheable prompt (all of it before the turn's new message, cut to whole
    blocks below the prompt's last token) comes from the cache for >= 95% of its tokens."""
    engine = _engine(tiny, True, num_blocks=200, max_num_seqs=2, async_scheduling=overlap,
                     **_spec(method, draft))
    rng = np.random.default_rng(3)
    history = rng.integers(0, 256, 40).tolist()
    bs = engine.scheduler.blocks.block_size
    for turn in range(10):
        before = len(history)
        history += rng.integers(0, 256, int(rng.integers(4, 20))).tolist()
        rid = engine.add_request(list(history), GREEDY)
        request = engine.scheduler.requests[rid]
        while engine.has_unfinished:
            for o in engine.step():
                history += o.new_token_ids
        cacheable = (before - 1) // bs * bs  # the last computed token's block boundary
        if turn:
            assert request.num_cached_tokens >= 0.95 * cacheable, (turn, cacheable)


def test_n_choices_share_one_prefill(tiny):
    engine = _engine(tiny, True, num_blocks=100)
    prompt = np.random.default_rng(4).integers(0, 256, 45).tolist()
    ids = [engine.add_request(prompt, GREEDY) for _ in range(3)]
    requests = [engine.scheduler.requests[i] for i in ids]
    while engine.has_unfinished:
        engine.step()
    assert [r.num_cached_tokens for r in requests] == [0, 40, 40]


def _request(tokens: list[int]) -> Request:
    return Request("r", tokens, GREEDY, 0)


def test_hashes_chain_over_tokens_identity_and_the_next_token():
    def cache(identity: bytes, next_token: bool = False) -> PrefixCache:
        return PrefixCache(BlockPool(8, 4), CheckpointPool(2), lambda i: 10 + i, identity,
                           8, hash_next_token=next_token)

    a = cache(cache_identity("m", "bf16"))
    tokens = list(range(10))
    h = a.hashes(_request(tokens))
    assert len(h) == 2 and h[0] != h[1]
    assert a.hashes(_request([99] + tokens[1:]))[1] != h[1]  # the chain carries block 0
    assert cache(cache_identity("m", "fp32")).hashes(_request(tokens))[0] != h[0]
    mtp = cache(cache_identity("m", "bf16"), next_token=True)
    assert len(mtp.hashes(_request(tokens[:8]))) == 1  # block 1's next token is unknown
    assert mtp.hashes(_request(tokens[:5]))[0] != mtp.hashes(_request(tokens[:4] + [9]))[0]


def test_stats_count_prefix_queries_hits_and_checkpoints(tiny):
    engine = _engine(tiny, True, num_blocks=100)
    prompt = np.random.default_rng(5).integers(0, 256, 35).tolist()
    engine.generate([prompt], GREEDY)
    engine.generate([prompt + [1, 2]], GREEDY)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (35 + 37, 32)
    assert stats.prefix_checkpoint_hits == 1
    assert stats.prefix_checkpoint_evictions == 0


@pytest.mark.slow  # Ray worker actors, one per fake GPU
@pytest.mark.parametrize("method", [None, "dflash"])
def test_tp2_dcp2_workers_copy_their_own_checkpoint_shards(ray_session, tiny, draft, method):
    """The state copies travel in the StepInput through the shared-memory channel; each rank
    copies its shard of the KDA state (TP splits its heads), and its DFlash rings."""
    off = _workload(_engine(tiny, False), seed=3)
    engine = _engine(tiny, True, tensor_parallel_size=2, decode_context_parallel_size=2,
                     **_spec(method, draft))
    try:
        on = _workload(engine, seed=3)
    finally:
        engine.shutdown()
    _assert_same(off, on)
    assert engine.prefix.checkpoint_hits > 5


def test_by_default_settings_that_cannot_cache_turn_it_off_with_a_warning(tiny, caplog):
    """The default is on; a 24-token block does not divide the 2048-token checkpoint interval."""
    config = EngineConfig(model=tiny, num_blocks=30, block_size=24)
    with caplog.at_level("WARNING", logger="glm53.raycluster.engine"):
        engine = LLMEngine(config)
    assert engine.prefix is None and engine.executor.cache_plan.num_checkpoints == 0
    assert "prefix caching is off: prefix_checkpoint_interval 2048" in caplog.text
    assert LLMEngine(EngineConfig(model=tiny, num_blocks=30)).prefix is not None
    with pytest.raises(ValueError, match="multiple of the block"):
        EngineConfig(model=tiny, block_size=24, enable_prefix_caching=True)


@pytest.mark.parametrize("kw", [
    dict(async_scheduling=True),
    dict(speculative_method="dflash", num_speculative_tokens=3, draft_model="unused"),
    dict(vision=True),  # block hashes cover images (test_prefix_cache_images.py)
])
def test_prefix_caching_combines_with(kw):
    assert EngineConfig(model="unused", enable_prefix_caching=True, **kw).num_prefix_checkpoints
