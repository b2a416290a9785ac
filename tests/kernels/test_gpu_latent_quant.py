"""Quantised KV cache kernels on real shapes, on a CUDA GPU (marker `gpu`): the fp8 / nvfp4
latent store (bytes equal the reference's, special values included), sparse attention over
packed rows (64 and 32 heads, latent 512, 2051 rows, DCP 2), the indexer over fp8 pool keys,
and one decode step with quantised caches under CUDA-graph capture.

Tolerances as in test_gpu_sparse_mla_decode.py: attention rel 1e-2 and lse abs 1e-2 (both
sides read the same dequantised values), indexer selections overlap the reference >= 99%.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53.kernels.ref import latent_quant as lq
from glm53.kernels.ref import sparse_mla as ref_mla

from .test_gpu_sparse_mla_decode import (
    BF16_TOL,
    BLOCK,
    BUDGET,
    DEV,
    KPOOL,
    LATENT,
    LSE_TOL,
    _attention_inputs,
    _indexer_inputs,
)
from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OUTER = 2.0**-9  # the calibration rule's nvfp4 outer scale for randn rows


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dcp", [(0, 1), (1, 2)])
def test_store_latent_bytes_equal_ref(fmt, dcp):
    from glm53.kernels import latent_quant

    rank, size = dcp
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = (torch.randn(4096, LATENT, device=DEV, generator=gen)
            * torch.logspace(-20, 20, 4096, device=DEV)[:, None])
    rows[1, 3], rows[1, 5], rows[2, 0], rows[2, 7] = math.nan, math.inf, -math.inf, -0.0
    rows[3] = torch.randn(LATENT, device=DEV, generator=gen) * 2.0**-135  # fp32 denormals
    rows[4] = 0.0
    rows = torch.cat([rows, rows[:512].bfloat16().float()])  # bf16 inputs, as the model's
    slots = torch.randperm(80 * BLOCK, device=DEV, generator=gen)[:rows.shape[0]] + BLOCK
    cache = torch.zeros(81, BLOCK // size, lq.row_bytes(fmt, LATENT), dtype=torch.uint8,
                        device=DEV)
    want = cache.cpu()
    lq.store_latent(rows.cpu(), want, slots.cpu(), rank, size, fmt, OUTER)
    latent_quant.store_latent(rows, cache, slots, rank, size, fmt, OUTER)
    assert torch.equal(cache.cpu()[1:], want[1:])


@pytest.mark.parametrize("dcp", [(0, 1), (1, 2)])
def test_store_plain_latent_equals_ref(dcp):
    """Plain rows through the kernel (one launch, the slot arithmetic in it): fp32 rows of
    every magnitude into a bf16 cache, rounded to nearest even like torch's cast; under DCP
    another rank's rows are skipped."""
    from glm53.kernels import latent_quant

    rank, size = dcp
    gen = torch.Generator(device=DEV).manual_seed(2)
    rows = (torch.randn(1024, LATENT, device=DEV, generator=gen)
            * torch.logspace(-20, 20, 1024, device=DEV)[:, None])
    rows[1, 3], rows[1, 5], rows[2, 0], rows[2, 7] = math.nan, math.inf, -math.inf, -0.0
    slots = torch.randperm(80 * BLOCK, device=DEV, generator=gen)[:rows.shape[0]] + BLOCK
    cache = torch.randn(81, BLOCK // size, LATENT, device=DEV, generator=gen).bfloat16()
    want = cache.cpu()
    lq.store_latent(rows.cpu(), want, slots.cpu(), rank, size, "plain")
    latent_quant.store_latent(rows, cache, slots, rank, size, "plain")
    # bit for bit but NaN's payload (torch's cast and the kernel's cvt pick different ones)
    torch.testing.assert_close(cache.cpu()[1:], want[1:], rtol=0, atol=0, equal_nan=True)


def _packed(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    return lq.pack_latent(cache.reshape(-1, LATENT).float(), fmt, OUTER).view(
        *cache.shape[:2], -1)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("heads,batch,ctx,verify", [(64, 1, 131072, 1), (64, 16, 32768, 4),
                                                    (32, 64, 32768, 1), (64, 1, 2048, 1)])
def test_decode_attention_over_packed_rows(fmt, heads, batch, ctx, verify):
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(heads + batch + verify)
    q, cache, table, qs, idx = _attention_inputs(heads, batch, ctx, verify, gen)
    packed = _packed(cache, fmt)
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, packed, table, qs, idx, 1 / 16,
                                                  latent_format=fmt)
    o, lse = sparse_mla.sparse_mla_attention(q, packed, table, qs, idx, 1 / 16,
                                             latent_format=fmt)
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse, lse_ref, atol=LSE_TOL)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_decode_attention_over_packed_rows_dcp2(fmt):
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(3)
    q, cache, table, qs, idx = _attention_inputs(64, 16, 32768, 2, gen, dcp_size=2)
    packed = _packed(cache, fmt)
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, packed, table, qs, idx, 1 / 16, 1, 2, fmt)
    o, lse = sparse_mla.sparse_mla_attention(q, packed, table, qs, idx, 1 / 16, 1, 2, fmt)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin)
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse[fin], lse_ref[fin], atol=LSE_TOL)


@pytest.mark.parametrize("batch,ctx,verify", [(1, 131072, 1), (16, 32768, 4)])
def test_indexer_topk_over_fp8_pool_keys(batch, ctx, verify):
    from glm53.kernels import sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(batch + ctx)
    q, w, pools, table, qs, pos = _indexer_inputs(batch, ctx, verify, gen, spare_blocks=3)
    packed = lq.pack_pool_keys(pools.reshape(-1, pools.shape[-1])).view(*pools.shape[:2], -1)
    out_ref = ref_mla.indexer_topk(*(x.cpu() for x in (q, w, packed, table, qs, pos)), BUDGET,
                                   KPOOL, "fp8")
    out = sparse_mla.indexer_topk(q, w, packed, table, qs, pos, BUDGET, KPOOL, "fp8").cpu()
    for a, b in zip(out, out_ref, strict=True):
        sa, sb = set(a.tolist()) - {-1}, set(b.tolist()) - {-1}
        assert len(sa & sb) >= 0.99 * len(sb)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantised_decode_step_cuda_graph(fmt):
    """Store of the new latent and pool rows, indexer over fp8 pool keys and attention over
    packed rows, captured in one CUDA graph, replay the eager step (no host sync, no
    host-to-device copy)."""
    from glm53.kernels import latent_quant, sparse_mla

    gen = torch.Generator(device=DEV).manual_seed(5)
    q_i, w, pools, table, qs, pos = _indexer_inputs(4, 32768, 1, gen)
    packed_pools = lq.pack_pool_keys(pools.reshape(-1, 128)).view(*pools.shape[:2], -1)
    latent = _packed(torch.randn(table.numel(), BLOCK, LATENT, device=DEV, generator=gen,
                                 dtype=torch.bfloat16), fmt)
    q = torch.randn(4, 64, LATENT, device=DEV, generator=gen, dtype=torch.bfloat16)
    new_rows = torch.randn(4, LATENT, device=DEV, generator=gen, dtype=torch.bfloat16)
    slots = table[:, -1] * BLOCK + BLOCK - 1
    keys = torch.randn(4, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    gates = torch.randn(4, 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    ape = torch.randn(KPOOL, 128, device=DEV, generator=gen)
    ring = torch.randn(4, 8, 256, device=DEV, generator=gen, dtype=torch.bfloat16)
    cu, ids = torch.arange(5, device=DEV), torch.arange(4, device=DEV)
    caches = (latent, packed_pools, ring)
    saved = [c.clone() for c in caches]

    def step():
        latent_quant.store_latent(new_rows, latent, slots, 0, 1, fmt, OUTER)
        sparse_mla.indexer_update(keys, gates, ape, ring, packed_pools, pos, slots, cu, ids,
                                  "fp8")
        tokens = sparse_mla.indexer_topk(q_i, w, packed_pools, table, qs, pos, BUDGET, KPOOL,
                                         "fp8")
        return sparse_mla.sparse_mla_attention(q, latent, table, qs, tokens, 1 / 16,
                                               latent_format=fmt)

    o_eager, lse_eager = step()
    after = [c.clone() for c in caches]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = step()
    for c, s in zip(caches, saved, strict=True):
        c.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)
    for c, a in zip(caches, after, strict=True):
        assert torch.equal(c, a)
