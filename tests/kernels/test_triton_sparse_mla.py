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


def test_sparse_mla_attention_rejects_mismatched_rows():
    """More queries than index rows would read past the index tensor: a clear error instead."""
    from glm53.kernels import sparse_mla

    q = torch.randn(3, 4, 16, device=DEVICE)
    cache = torch.randn(4, 16, 16, device=DEVICE)
    table = torch.zeros(2, 2, dtype=torch.long, device=DEVICE)
    idx = torch.zeros(2, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="3 queries but 2 index rows"):
        sparse_mla.sparse_mla_attention(q, cache, table, torch.zeros(3, dtype=torch.long,
                                                                     device=DEVICE), idx, 0.25)


def test_merge_attention_states_matches_ref():
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(9)
    outs = torch.randn(3, 4, 5, 7, generator=g)
    lses = torch.randn(3, 4, 5, generator=g)
    lses[:, 0, 0] = float("-inf")  # nowhere any row: zeros
    lses[1, 1] = float("-inf")
    out = sparse_mla.merge_attention_states(outs.to(DEVICE), lses.to(DEVICE))
    assert rel_err(out, ref.merge_attention_states(outs, lses)) < 1e-6


@pytest.mark.parametrize("pool_format", [None, "fp8"])
def test_indexer_update_matches_ref(pool_format):
    """Two steps over 3 sequences: prefill of 0/3/10 tokens (pools closed mid-step, open tails),
    then steps that close pools with rows carried in the ring (R = 8 > kpool = 4). fp8: the
    pools are stored as fp8 rows of rotated keys, Triton and the reference dequantise alike (the
    pooled sums round differently, so a code may differ by one step: rel 2e-2)."""
    from glm53.kernels import sparse_mla
    from glm53.kernels.ref import latent_quant as lq

    g = torch.Generator().manual_seed(10)
    d, kpool, ring, bs = (12 if pool_format is None else 16), 4, 8, 8
    lens_total = [14, 7, 22]
    table = _tables(lens_total, bs, 10, g)
    ape = torch.randn(kpool, d, generator=g)
    pools = (torch.zeros(10, bs // kpool, d) if pool_format is None else
             torch.zeros(10, bs // kpool, lq.fp8_row_bytes(d), dtype=torch.uint8))
    state = [torch.zeros(4, ring, 2 * d), pools]
    dev = [s.clone().to(DEVICE) for s in state]  # clone: .to(cpu) would alias the state
    slots = torch.tensor([3, 0, 1])
    done = [0, 0, 0]
    for step in ([3, 7, 10], [1, 0, 9], [10, 0, 3]):
        pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in enumerate(step)])
        seq = torch.repeat_interleave(torch.arange(3), torch.tensor(step))
        slot_map = table[seq, pos // bs] * bs + pos % bs
        cu = torch.tensor([0, *torch.tensor(step).cumsum(0).tolist()])
        t = int(cu[-1])
        keys, gates = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g) * 3
        fmt = () if pool_format is None else (pool_format,)
        ref.indexer_update(keys, gates, ape, state[0], state[1], pos, slot_map, cu, slots, *fmt)
        sparse_mla.indexer_update(*(x.to(DEVICE) for x in (keys, gates, ape)), dev[0], dev[1],
                                  *(x.to(DEVICE) for x in (pos, slot_map, cu, slots)), *fmt)
        if pool_format is None:
            assert rel_err(dev[1], state[1]) < 1e-5
        else:  # block 0 takes the rows of tokens that close no pool: not compared
            got, want = (lq.unpack_fp8(c.cpu()[1:], d) for c in (dev[1], state[1]))
            assert want.abs().sum() > 0 and rel_err(got, want) < 2e-2
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


def test_indexer_head_scale_is_applied_where_the_weights_are_read():
    """The model's n_heads^-0.5 on the head weights, folded into the scoring kernel (no
    launch of its own), rounds as the multiply it replaces: the visible pools' scores equal
    those of pre-scaled weights bit for bit (and are not the unscaled ones). The reference
    applies it too: a positive scale keeps every ranking, so a negative one (which reverses
    it) shows it does."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(12)
    hi, d, kpool, bs, budget, c = 5, 16, 4, 8, 2, 5**-0.5
    lens = [42, 17]
    table = _tables(lens, bs, 12, g)
    pools = torch.randn(12, bs // kpool, d, generator=g)
    query_seq, pos = torch.tensor([0, 0, 1]), torch.tensor([41, 20, 16])
    q = torch.randn(3, hi, d, generator=g)
    w = torch.randn(3, hi, generator=g)
    args = [x.to(DEVICE) for x in (q, w, pools, table, query_seq, pos)]

    def scores(weights, scale):
        out = sparse_mla._score_pools(args[0], weights, *args[2:], kpool, "plain", scale).cpu()
        visible = torch.arange(out.shape[1]) * kpool + kpool - 1 <= pos.unsqueeze(1)
        return out[visible]

    folded = scores(args[1], c)
    assert torch.equal(folded, scores((w * c).to(DEVICE), 1.0))
    assert not torch.equal(folded, scores(args[1], 1.0))
    reversed_ = ref.indexer_topk(q, w, pools, table, query_seq, pos, budget, kpool,
                                 head_scale=-c)
    assert torch.equal(reversed_, ref.indexer_topk(q, w * -c, pools, table, query_seq, pos,
                                                   budget, kpool))
    assert not torch.equal(reversed_, ref.indexer_topk(q, w, pools, table, query_seq, pos,
                                                       budget, kpool))


def _selection(query_seq, lens, width, gen):
    """token_indices [T, width]: distinct random positions of each query's sequence, -1 padded
    at random slots (a selection may be shorter than the width)."""
    idx = torch.full((len(query_seq), width), -1, dtype=torch.long)
    for t, s in enumerate(query_seq.tolist()):
        n = min(lens[s], width - t % 5)
        slots = torch.randperm(width, generator=gen)[:n]
        idx[t, slots] = torch.randperm(lens[s], generator=gen)[:n]
    return idx


@pytest.mark.parametrize("heads,lc,dcp", [(3, 32, (0, 1)), (20, 48, (1, 2)), (80, 16, (0, 1)),
                                          (16, 32, (0, 2))])
def test_sparse_mla_decode_all_heads_matches_ref(heads, lc, dcp):
    """Decode and verify shapes: 3 sequences (lengths off the block size), 2-3 queries each
    (verify width > 1), selections of up to 40 rows split across programs, latent columns
    tiled across programs, head counts below, at and above one 64-head tile; a query with
    nothing selected. fp32: output rel 1e-5, lse abs 1e-5."""
    from glm53.kernels import sparse_mla

    rank, size = dcp
    g = torch.Generator().manual_seed(heads * lc + rank)
    lens, bs, width = [75, 41, 130], 16, 40
    table = _tables(lens, bs, 20, g)
    cache = torch.randn(20, bs // size, lc, generator=g)
    query_seq = torch.tensor([0, 0, 1, 1, 2])
    idx = _selection(query_seq, lens, width, g)
    idx[3] = -1
    q = torch.randn(len(query_seq), heads, lc, generator=g)
    plan = sparse_mla._attention_plan(len(query_seq), heads, width, lc, True)
    assert plan["splits"] > 1  # the split path runs
    assert plan["grid_c"] > 1 or lc <= sparse_mla.COL_TILE  # and the column tiles
    o_ref, lse_ref = ref.sparse_mla_attention(q, cache, table, query_seq, idx, 0.2, rank, size)
    d = [x.to(DEVICE) for x in (q, cache, table, query_seq, idx)]
    o, lse = sparse_mla.sparse_mla_attention(*d, 0.2, rank, size)
    assert rel_err(o, o_ref) < 1e-5
    fin = torch.isfinite(lse_ref)
    assert fin.sum() > 2 * heads  # most queries have rows here
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert torch.allclose(lse.cpu()[fin], lse_ref[fin], atol=1e-5)
    assert torch.equal(o.cpu()[3], torch.zeros_like(o_ref[3]))


def test_sparse_mla_prefill_many_queries_matches_ref():
    """Many queries of one sequence (prefill): one split, causal selections."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(12)
    heads, lc, bs, n = 16, 16, 8, 27
    table = _tables([n], bs, 8, g)
    cache = torch.randn(8, bs, lc, generator=g)
    idx = torch.full((n, 20), -1, dtype=torch.long)
    for t in range(n):
        k = min(t + 1, 20)
        idx[t, :k] = torch.randperm(t + 1, generator=g)[:k]
    q = torch.randn(n, heads, lc, generator=g)
    assert sparse_mla._attention_plan(n, heads, 20, lc, True)["splits"] == 1
    qs = torch.zeros(n, dtype=torch.long)
    o_ref, lse_ref = ref.sparse_mla_attention(q, cache, table, qs, idx, 0.3)
    o, lse = sparse_mla.sparse_mla_attention(*(x.to(DEVICE) for x in (q, cache, table, qs, idx)),
                                             0.3)
    assert rel_err(o, o_ref) < 1e-5
    assert torch.allclose(lse.cpu(), lse_ref, atol=1e-5)


def _pool_scores(q, w, pools, table, seq, n_pools):
    """Reference index scores [P] of one query (fp32), as ref.indexer_topk computes them."""
    keys = ref._gather_pools(pools, table[seq], n_pools).float()
    s = torch.relu(torch.einsum("hd,pd->hp", q.float(), keys) * q.shape[-1] ** -0.5)
    return torch.einsum("h,hp->p", w.float(), s)


@pytest.mark.parametrize("fold", [False, True])
def test_indexer_topk_radix_select_matches_ref(fold, monkeypatch):
    """Radix select over several 64-pool chunks: 3 sequences (lengths off the block and pool
    size), verify-width runs of consecutive positions, queries seeing fewer pools than the
    budget, none, or an empty open pool; mixed-sign head weights (negative scores) and
    duplicated pool keys (exact ties at the threshold). The selected pools must be distinct,
    visible, and carry the top-k scores (rel 1e-5); tie-free queries equal the reference as
    sets; the tails equal exactly. Both ways to carry the prefix between passes: re-read from
    every chunk's histograms, or folded once by the query's last program (`fold`)."""
    from glm53.kernels import radix_select, sparse_mla

    monkeypatch.setattr(radix_select, "SELECT_FOLD_PROGRAMS", 0 if fold else 1 << 30)

    g = torch.Generator().manual_seed(13)
    hi, d, kpool, bs, budget = 6, 16, 4, 16, 20
    lens = [611, 38, 301]
    table = _tables(lens, bs, 64, g)
    pools = torch.randn(64, bs // kpool, d, generator=g)
    # sequence 2: blocks 1-4 repeat block 0's pool keys, so scores tie in groups of five
    pools[table[2, 1:5]] = pools[table[2, 0]].clone()
    rows = ([(0, p) for p in (610, 608, 607, 250, 2)] + [(1, 37)]
            + [(2, p) for p in (300, 299, 95)])
    query_seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), hi, d, generator=g)
    w = torch.rand(len(rows), hi, generator=g) + 0.1
    w[1::3] -= 0.8  # some negative head weights: negative and mixed-sign scores
    out_ref = ref.indexer_topk(q, w, pools, table, query_seq, pos, budget, kpool)
    out = sparse_mla.indexer_topk(*(x.to(DEVICE) for x in (q, w, pools, table, query_seq, pos)),
                                  budget, kpool).cpu()
    assert out.shape == out_ref.shape
    assert torch.equal(out[:, budget * kpool:], out_ref[:, budget * kpool:])
    assert (out[:, budget * kpool:] == -1).all(dim=1).any()  # an empty open pool is covered
    sel = out[:, : budget * kpool].view(len(rows), budget, kpool)
    for t, (s, p) in enumerate(rows):
        n_vis = (p + 1) // kpool
        tok = sel[t]
        used = tok[:, 0] >= 0
        assert int(used.sum()) == min(budget, n_vis)
        if n_vis == 0:
            continue
        assert torch.equal(tok[~used], torch.full_like(tok[~used], -1))
        pool_ids = tok[used, 0] // kpool
        assert torch.equal(tok[used], pool_ids[:, None] * kpool + torch.arange(kpool))
        assert len(set(pool_ids.tolist())) == len(pool_ids) and int(pool_ids.max()) < n_vis
        scores = _pool_scores(q[t], w[t], pools, table, s, n_vis)
        top = scores.topk(min(budget, n_vis)).values
        got = scores[pool_ids].sort(descending=True).values
        assert torch.allclose(got, top, rtol=1e-5, atol=1e-6)
        if s != 2:  # tie-free: the same pools as the reference
            assert sorted(tok[used].flatten().tolist()) == sorted(
                x for x in out_ref[t, : budget * kpool].tolist() if x >= 0)
    assert (w < 0).any() and n_vis > budget


def test_indexer_topk_table_within_budget():
    """A block table addressing no more pools than the budget: every visible pool, no passes."""
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(14)
    hi, d, kpool, bs, budget = 4, 16, 4, 8, 6
    table = _tables([22, 9], bs, 8, g)  # 3 blocks: 6 pool slots
    pools = torch.randn(8, bs // kpool, d, generator=g)
    query_seq, pos = torch.tensor([0, 0, 1]), torch.tensor([21, 20, 8])
    q = torch.randn(3, hi, d, generator=g)
    w = torch.rand(3, hi, generator=g) + 0.1
    out_ref = ref.indexer_topk(q, w, pools, table, query_seq, pos, budget, kpool)
    out = sparse_mla.indexer_topk(*(x.to(DEVICE) for x in (q, w, pools, table, query_seq, pos)),
                                  budget, kpool).cpu()
    for a, b in zip(out, out_ref, strict=True):
        assert sorted(a.tolist()) == sorted(b.tolist())
    assert (out[:, :budget * kpool] >= 0).sum() == 4 * (5 + 5 + 2)
