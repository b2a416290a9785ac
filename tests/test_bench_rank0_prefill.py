"""benchmarks/rank0.py's modeled prefill FLOPs of rank 0 (the MFU it reports), on the meta-built
TP2/EP2/DCP2 rank-0 shard of the release config: no GPU, no memory."""

from __future__ import annotations

import pytest

from glm53.actors.memory_plan import meta_shard
from glm53.actors.release import release_config


@pytest.fixture(scope="module")
def rank0_shard():
    return meta_shard(release_config(), tp=2, ep=2, dcp=2, rank=0, quantize_experts="int4")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import rank0

    return rank0


def test_prefill_flops_match_the_design_budget(bench, rank0_shard):
    # performance.md §4.4: 35.3 GFLOP a token at 8K over the pair, 17.6-18.5 per rank
    assert 17.6 <= bench.prefill_gflop_per_token(rank0_shard, 0, 8192) <= 18.5
    # the linear part at position 0 (attention of one token, no pools): 2 x 16.11 B over two
    # ranks, a little more on each for the weights every rank holds (q_a, kv_a, indexer, mHC)
    kda = 34 * 32 * (5 * 2 * 64 * 128 + 3 * 2 * 128 * 128) / 1e9
    linear = bench.prefill_gflop_per_token(rank0_shard, 0, 1) - kda
    assert 16.11 <= linear <= 16.11 * 1.03


def test_attention_flops_by_hand(bench, rank0_shard):
    """A token at position 10,000 over one at position 0: 11 DSA layers of 32 local heads x
    2 x (2048 - 1) more selected rows x (512 + 512), and 2 x 32 x 128 x 2,500 pools scored."""
    mla = 11 * 32 * 2 * (2048 - 1) * 1024
    indexer = 11 * 2 * 32 * 128 * 2500
    gain = (bench.prefill_gflop_per_token(rank0_shard, 10_000, 1)
            - bench.prefill_gflop_per_token(rank0_shard, 0, 1))
    assert gain == pytest.approx((mla + indexer) / 1e9, rel=1e-9)
