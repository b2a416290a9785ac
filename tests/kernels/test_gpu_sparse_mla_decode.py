"""KPool-DSA decode kernels vs `kernels/ref/sparse_mla.py` on real shapes, on a CUDA GPU
(marker `gpu`): the all-heads sparse latent attention (64 heads, and 32 for a TP2 rank; latent
512 bf16; 2051 selected rows; batches 1/16/64, verify width 4, DCP 2, a prefill-sized call) and
the indexer's scoring + radix top-k (32 heads of 128; contexts 2K/32K/128K).

Tolerances: attention output rel 1e-2 (bf16 output; fp32 inside on both sides), lse abs 1e-2;
indexer selections overlap the reference >= 99% (bf16 tensor-core products reorder fp32 sums,
so near-ties may swap) and are exact top-k of the kernel's own ordering (distinct, visible,
budget-sized); results equal under CUDA-graph replay and across calls.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import sparse_mla as ref_mla

from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16_TOL, LSE_TOL = 1e-2, 1e-2
DEV = "cuda"
BLOCK, LATENT, BUDGET, KPOOL = 64, 512, 512, 4
WIDTH = BUDGET * KPOOL + KPOOL - 1  # 2051 rows a query


def _attention_inputs(heads, batch, ctx, verify, gen, dcp_size=1):
    """A latent cache of at most 4096 shared blocks (rows repeat across sequences: only the
    selection's math is checked), queries `verify` per sequence, distinct selected positions
    with the open-pool tail slots unused."""
    blocks = -(-ctx // BLOCK)
    n_blocks = min(batch * blocks, 4096)
    table = torch.randint(0, n_blocks, (batch, blocks), device=DEV, generator=gen)
    cache = torch.randn(n_blocks, BLOCK // dcp_size, LATENT, device=DEV, generator=gen,
                        dtype=torch.bfloat16)
    t = batch * verify
    q = torch.randn(t, heads, LATENT, device=DEV, generator=gen, dtype=torch.bfloat16)
    width = min(WIDTH, ctx)
    idx = torch.argsort(torch.rand(t, ctx, device=DEV, generator=gen), dim=1)[:, :width]
    idx[:, -3:] = -1
    qs = torch.arange(batch, device=DEV).repeat_interleave(verify)
    return q, cache, table, qs, idx


@pytest.mark.parametrize("heads,batch,ctx", [(64, 1, 131072), (64, 1, 2048), (64, 16, 32768),
                                             (64, 64, 2048), (32, 1, 32768), (32, 16, 131072),
                                             (32, 64, 32768)])
@pytest.mark.parametrize("verify", [1, 4])
def test_decode_attention(heads, batch, ctx, verify):
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(heads + batch + verify)
    q, cache, table, qs, idx = _attention_inputs(heads, batch, ctx, verify, gen)
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    o, lse = sparse_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse, lse_ref, atol=LSE_TOL)


@pytest.mark.parametrize("rows,col_tile,min_split,warps,stages,programs", [
    (64, 256, 128, 4, 4, 264), (16, 256, 128, 4, 4, 264), (32, 512, 256, 4, 4, 264),
    (64, 512, 64, 8, 3, 264), (32, 256, 128, 8, 2, 264), (64, 256, 128, 8, 4, 264),
    (32, 512, 64, 8, 4, 132), (32, 256, 128, 4, 3, 132), (64, 256, 64, 4, 4, 396)])
def test_decode_attention_tilings(monkeypatch, rows, col_tile, min_split, warps, stages,
                                  programs):
    """The tiling constants the benchmark sweeps (rows per step, halved latent or not, fewest
    rows per split, warps, pipeline depth, programs wanted in flight) give the reference's
    answer too, so a faster one can become the default."""
    from glm53.kernels import sparse_mla

    monkeypatch.setattr(sparse_mla, "ATTENTION_ROWS", rows)
    monkeypatch.setattr(sparse_mla, "ATTENTION_WARPS", warps)
    monkeypatch.setattr(sparse_mla, "COL_TILE", col_tile)
    monkeypatch.setattr(sparse_mla, "MIN_SPLIT_ROWS", min_split)
    monkeypatch.setattr(sparse_mla, "ATTENTION_STAGES", stages)
    monkeypatch.setattr(sparse_mla, "TARGET_PROGRAMS", programs)
    for heads, batch, verify in ((64, 1, 1), (64, 16, 4), (32, 64, 1)):
        gen = torch.Generator(device=DEV).manual_seed(rows + batch)
        q, cache, table, qs, idx = _attention_inputs(heads, batch, 32768, verify, gen)
        o_ref, lse_ref = ref_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
        o, lse = sparse_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
        assert rel_err(o, o_ref) < BF16_TOL
        assert torch.allclose(lse, lse_ref, atol=LSE_TOL)


@pytest.mark.parametrize("heads", [32, 64])
def test_decode_attention_dcp2(heads):
    """Rank 1 of 2 attends its half of the rows; queries with no row there get lse -inf."""
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(3)
    q, cache, table, qs, idx = _attention_inputs(heads, 16, 32768, 2, gen, dcp_size=2)
    idx[5] = idx[5] - idx[5] % 2  # even positions only: nothing on rank 1
    idx[5, -3:] = -1
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16, 1, 2)
    o, lse = sparse_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16, 1, 2)
    fin = torch.isfinite(lse_ref)
    assert not fin[5].any() and fin.sum() == fin.numel() - heads
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.equal(o[5], torch.zeros_like(o[5]))
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse[fin], lse_ref[fin], atol=LSE_TOL)


def test_prefill_attention():
    """512 queries of one sequence, causal selections of up to 2051 rows: the one-split path."""
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(4)
    q, cache, table, qs, idx = _attention_inputs(64, 1, 8192, 512, gen)
    pos = torch.arange(8192 - 512, 8192, device=DEV)
    idx = torch.where(idx <= pos[:, None], idx, -1)  # causal: only rows at or before the query
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    o, lse = sparse_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse, lse_ref, atol=LSE_TOL)


def _indexer_inputs(batch, ctx, verify, gen, spare_blocks=0):
    """Distinct pool blocks per sequence (tie-free keys); the block table addresses
    `spare_blocks` more blocks than the context needs (as a serving table does)."""
    blocks = -(-ctx // BLOCK) + spare_blocks
    table = torch.randperm(batch * blocks, device=DEV, generator=gen).view(batch, blocks)
    pools = torch.randn(batch * blocks, BLOCK // KPOOL, 128, device=DEV, generator=gen,
                        dtype=torch.bfloat16)
    t = batch * verify
    q = torch.randn(t, 32, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(t, 32, device=DEV, generator=gen) * 32**-0.5
    qs = torch.arange(batch, device=DEV).repeat_interleave(verify)
    pos = ctx - verify + torch.arange(t, device=DEV) % verify
    return q, w, pools, table, qs, pos


@pytest.mark.parametrize("batch,ctx,verify", [(1, 2048, 1), (1, 32768, 4), (1, 131072, 1),
                                              (16, 32768, 1), (16, 131072, 4), (64, 2048, 4),
                                              (64, 32768, 1)])
def test_indexer_topk(batch, ctx, verify, monkeypatch):
    """Against the reference; the select folds the chunk histograms by the last program or not
    (SELECT_FOLD_PROGRAMS), and both ways give the same tokens."""
    from glm53.kernels import radix_select, sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(batch + ctx + verify)
    q, w, pools, table, qs, pos = _indexer_inputs(batch, ctx, verify, gen, spare_blocks=7)
    # the reference builds index tensors on the CPU: run it there
    out_ref = ref_mla.indexer_topk(*(x.cpu() for x in (q, w, pools, table, qs, pos)), BUDGET,
                                   KPOOL)
    out = sparse_mla.indexer_topk(q, w, pools, table, qs, pos, BUDGET, KPOOL)
    assert torch.equal(out, sparse_mla.indexer_topk(q, w, pools, table, qs, pos, BUDGET, KPOOL))
    for fold_programs in (0, 1 << 30):
        monkeypatch.setattr(radix_select, "SELECT_FOLD_PROGRAMS", fold_programs)
        assert torch.equal(out, sparse_mla.indexer_topk(q, w, pools, table, qs, pos, BUDGET,
                                                        KPOOL))
    out = out.cpu()
    assert torch.equal(out[:, BUDGET * KPOOL:], out_ref[:, BUDGET * KPOOL:])
    for a, b, p in zip(out, out_ref, pos.tolist(), strict=True):
        sel = a[: BUDGET * KPOOL].view(BUDGET, KPOOL)
        used = sel[:, 0] >= 0
        n_vis = (p + 1) // KPOOL
        assert int(used.sum()) == min(BUDGET, n_vis)
        pool_ids = sel[used, 0] // KPOOL
        assert pool_ids.unique().numel() == pool_ids.numel() and int(pool_ids.max()) < n_vis
        sa, sb = set(a.tolist()) - {-1}, set(b.tolist()) - {-1}
        assert len(sa & sb) >= 0.99 * len(sb)


def test_decode_step_cuda_graph():
    """Indexer + attention captured in one CUDA graph (no host sync) replay the eager result."""
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(5)
    q_i, w, pools, table, qs, pos = _indexer_inputs(4, 32768, 1, gen)
    latent = torch.randn(table.numel(), BLOCK, LATENT, device=DEV, generator=gen,
                         dtype=torch.bfloat16)
    q = torch.randn(4, 64, LATENT, device=DEV, generator=gen, dtype=torch.bfloat16)

    def step():
        tokens = sparse_mla.indexer_topk(q_i, w, pools, table, qs, pos, BUDGET, KPOOL)
        return sparse_mla.sparse_mla_attention(q, latent, table, qs, tokens, 1 / 16)

    o_eager, lse_eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)
