"""benchmarks/slice.py's `engine_step_ms` on CPU, over the tiny model: the step as the engine
runs it (graphs emulated, the sampler, the tokens to the host) and as overlapped execution
runs it (the next step launched from the last one's samples on the device) both decode, and
both advance the KDA states of the batch's slots only. Times are not checked."""

from __future__ import annotations

import pytest
import torch

from glm53.actors.caches import DSAState, KDAState, ModelCaches
from glm53.actors.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ModelRunner:
    return ModelRunner(str(tiny_checkpoint), num_blocks=8, num_slots=4, block_size=16)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import slice as slice_bench

    return slice_bench


@pytest.mark.parametrize("n", [1, 3])
def test_engine_step_ms_decodes_the_batch(runner, bench, n):
    cfg = runner.config
    block = bench.BLOCK
    ctx = 2 * block - 5  # inside the second block of each sequence
    caches = ModelCaches.allocate(cfg, 1 + 2 * n, block, n + 1,
                                  runner.model.embed_tokens.weight.dtype)
    tables = [[1 + 2 * i, 2 + 2 * i] for i in range(n)]
    kda = [s.recurrent for s in caches.layers if isinstance(s, KDAState)]
    with torch.inference_mode():
        ms, host = bench.engine_step_ms(runner.model, caches, cfg, n, ctx, tables, steps=2)
    assert ms > 0
    assert {"build_load_replay_ms", "sampler_calls_ms", "wait_ms", "overlapped_ms"} <= set(host)
    assert all(v > 0 for k, v in host.items() if k != "wait_ms")
    assert all(s[:n].abs().sum() > 0 for s in kda)  # decoded from zero states
    assert all(s[n:].abs().sum() == 0 for s in kda)  # the pad slot and beyond: untouched
    # each step writes position ctx - 1: the latent row of the second block of each table
    latent = [s.latent for s in caches.layers if isinstance(s, DSAState)]
    for cache in latent:
        written = cache[[t[1] for t in tables], (ctx - 1) % block]
        assert (written.abs().sum(-1) > 0).all()
        assert cache[0].abs().sum() == 0  # the null block stays clean
