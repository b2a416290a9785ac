"""Triton KPool-DSA kernels vs `kernels/ref/sparse_mla.py` on small awkward shapes (fp32).

Tolerances (fp32, relative error): attention output 1e-5 and lse 1e-6 absolute; pooled keys
1e-5; indexer selections equal as sets (the scores are tie-free by construction: every query's
head weights are positive and a positive-part score is 0 only when all heads are negative,
which the seeded inputs avoid except at exact ties checked by value).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import sparse_mla as ref

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


def _tables(lens, block_size, n_blocks, gen):
    """Shuffled block tables (rows padded with block 0) for sequences of the given lengths."""
    perm = torch.randperm(n_blocks - 1, generator=gen) + 1
    width = max(-(-n // block_size) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = perm[used:used + nb]
        used += nb
    return table


@pytest.mark.parametrize("dcp", [(0, 1), (1, 2)])
def test_sparse_mla_attention_matches_ref(dcp):
    from glm53.kernels import sparse_mla

    rank, size = dcp
    g = torch.Generator().manual_seed(7)
    lens, heads, lc, bs = [13, 30, 5], 20, 24, 8
    table = _tables(lens, bs, 12, g)
    cache = torch.randn(12, bs // size, lc, generator=g)
    # queries: 2 of seq 0, 3 of seq 1, 1 of seq 2; W = 11 selected rows incl. -1 padding
    query_seq = torch.tensor([0, 0, 1, 1, 1, 2])
    width = 11
    idx = torch.full((6, width), -1, dtype=torch.long)
    for t, s in enumerate(query_seq.tolist()):
        n = min(lens[s], width - t % 3)
        idx[t, :n] = torch.randperm(lens[s], generator=g)[:n]
    idx[5] = -1  # a query with nothing selected: zeros and lse -inf
    q = torch.randn(6, heads, lc, generator=g)
    o_ref, lse_ref = ref.sparse_mla_attention(q, cache, table, query_seq, idx, 0.3, rank, size)
    d = [x.to(DEVICE) for x in (q, cache, table, query_seq, idx)]
    o, lse = sparse_mla.sparse_mla_attention(*d, 0.3, rank, size)
    assert rel_err(o, o_ref) < 1e-5
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert torch.allclose(lse.cpu()[fin], lse_ref[fin], atol=1e-5)
    assert torch.equal(o.cpu()[5], torch.zeros_like(o_ref[5]))


def test_sparse_mla_attention_split_selection_matches_ref():
    """A single query with a long selection is split across programs and merged by lse."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(8)
    heads, lc, bs, n = 16, 16, 16, 200
    table = _tables([n], bs, 20, g)
    cache = torch.randn(20, bs, lc, generator=g)
    idx = torch.randperm(n, generator=g)[None, :150]
    q = torch.randn(1, heads, lc, generator=g)
    o_ref, lse_ref = ref.sparse_mla_attention(q, cache, table, torch.tensor([0]), idx, 0.25)
    o, lse = sparse_mla.sparse_mla_attention(q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE),
                                             torch.tensor([0], device=DEVICE), idx.to(DEVICE),
                                             0.25)
    assert rel_err(o, o_ref) < 1e-5
    assert torch.allclose(lse.cpu(), lse_ref, atol=1e-5)


def test_merge_attention_states_matches_ref():
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(9)
    outs = torch.randn(3, 4, 5, 7, generator=g)
    lses = torch.randn(3, 4, 5, generator=g)
    lses[:, 0, 0] = float("-inf")  # nowhere any row: zeros
    lses[1, 1] = float("-inf")
    out = sparse_mla.merge_attention_states(outs.to(DEVICE), lses.to(DEVICE))
    assert rel_err(out, ref.merge_attention_states(outs, lses)) < 1e-6


def test_indexer_update_matches_ref():
    """Two steps over 3 sequences: prefill of 0/3/10 tokens (pools closed mid-step, open tails),
    then steps that close pools with rows carried in the ring (R = 8 > kpool = 4)."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(10)
    d, kpool, ring, bs = 12, 4, 8, 8
    lens_total = [14, 7, 22]
    table = _tables(lens_total, bs, 10, g)
    ape = torch.randn(kpool, d, generator=g)
    state = [torch.zeros(4, ring, 2 * d), torch.zeros(10, bs // kpool, d)]
    dev = [s.to(DEVICE) for s in state]
    slots = torch.tensor([3, 0, 1])
    done = [0, 0, 0]
    for step in ([3, 7, 10], [1, 0, 9], [10, 0, 3]):
        pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in enumerate(step)])
        seq = torch.repeat_interleave(torch.arange(3), torch.tensor(step))
        slot_map = table[seq, pos // bs] * bs + pos % bs
        cu = torch.tensor([0, *torch.tensor(step).cumsum(0).tolist()])
        t = int(cu[-1])
        keys, gates = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g) * 3
        ref.indexer_update(keys, gates, ape, state[0], state[1], pos, slot_map, cu, slots)
        sparse_mla.indexer_update(*(x.to(DEVICE) for x in (keys, gates, ape)), dev[0], dev[1],
                                  *(x.to(DEVICE) for x in (pos, slot_map, cu, slots)))
        assert rel_err(dev[1], state[1]) < 1e-5
        assert torch.equal(dev[0].cpu(), state[0])
        done = [a + b for a, b in zip(done, step, strict=True)]


def test_indexer_topk_matches_ref():
    """Budget 3 pools of 4: short sequences (all pools kept, empty tail pool at position 3),
    long ones (top-k), queries at positions 0..41 of 3 sequences."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(11)
    hi, d, kpool, bs, budget = 5, 16, 4, 8, 3
    lens = [42, 3, 17]
    table = _tables(lens, bs, 12, g)
    pools = torch.randn(12, bs // kpool, d, generator=g)
    rows = [(0, p) for p in (0, 3, 7, 15, 41)] + [(1, 2), (2, 11), (2, 16)]
    query_seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), hi, d, generator=g)
    w = torch.rand(len(rows), hi, generator=g) + 0.1
    out_ref = ref.indexer_topk(q, w, pools, table, query_seq, pos, budget, kpool)
    out = sparse_mla.indexer_topk(*(x.to(DEVICE) for x in (q, w, pools, table, query_seq, pos)),
                                  budget, kpool)
    assert out.shape == out_ref.shape
    sel, tail = out.cpu()[:, : budget * kpool], out.cpu()[:, budget * kpool:]
    assert torch.equal(tail, out_ref[:, budget * kpool:])
    for a, b in zip(sel, out_ref[:, : budget * kpool], strict=True):
        assert sorted(a.tolist()) == sorted(b.tolist())
