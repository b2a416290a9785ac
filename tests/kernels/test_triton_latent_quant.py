"""Triton store of quantised latent rows and the attention that dequantises them, against
`kernels/ref` (bytes bit-exact; attention within fp32 tolerance), on small awkward shapes."""

from __future__ import annotations

import math

import pytest
import torch

from glm53.kernels.ref import latent_quant as lq
from glm53.kernels.ref import sparse_mla as ref

from .test_triton_sparse_mla import _tables
from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


def _awkward_rows(n: int, lc: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of mixed magnitudes with NaN, +-inf, -0.0, fp32 denormals and an all-zero row."""
    x = torch.randn(n, lc, generator=gen) * torch.logspace(-3, 3, n).unsqueeze(1)
    x[1, 3], x[1, 5], x[2, 0], x[2, 7] = math.nan, math.inf, -math.inf, -0.0
    x[3] = torch.randn(lc, generator=gen) * 2.0**-135  # denormals only
    x[4] = 0.0
    return x


@pytest.mark.parametrize("latent_format", ["fp8", "nvfp4", "plain"])
@pytest.mark.parametrize("lc", [16, 48, 160])
@pytest.mark.parametrize("dcp", [(0, 1), (1, 2)])
def test_store_latent_bytes_equal_ref(latent_format, lc, dcp):
    """Quantised rows byte for byte; plain bf16 rows (NaN and infinities too) bit for bit, each
    at its slot or, under DCP, skipped when another rank's. (Plain rows in the cache's dtype:
    the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even, as torch.)"""
    from glm53.kernels import latent_quant

    rank, size = dcp
    g = torch.Generator().manual_seed(lc)
    rows = _awkward_rows(9, lc, g)
    slots = torch.randperm(5 * 8, generator=g)[:9] + 8  # blocks 1..5 of 8 tokens
    if latent_format == "plain":
        rows = rows.to(torch.bfloat16)
        cache_ref = torch.randn(6, 8 // size, lc, generator=g).to(torch.bfloat16)
    else:
        rb = lq.row_bytes(latent_format, lc)
        cache_ref = torch.randint(0, 256, (6, 8 // size, rb), generator=g, dtype=torch.uint8)
    cache = cache_ref.clone().to(DEVICE)
    before = cache_ref.clone()
    lq.store_latent(rows, cache_ref, slots, rank, size, latent_format, 0.25)
    latent_quant.store_latent(rows.to(DEVICE), cache, slots.to(DEVICE), rank, size,
                            latent_format, 0.25)
    # row 0 of the null block takes the other rank's tokens (any of them): not compared
    assert torch.equal(cache.cpu()[1:].view(torch.uint8), cache_ref[1:].view(torch.uint8))
    assert not torch.equal(cache.cpu()[1:].view(torch.uint8), before[1:].view(torch.uint8))


def test_e4m3_encoding_matches_torch_at_every_code_and_midpoint():
    from glm53.kernels import latent_quant

    # every finite e4m3 value and every midpoint between neighbours (the ties), both signs;
    # a 448 in each 128-wide tile pins its scale to 1, so the codes are the casts of x itself
    values = lq.e4m3_values(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, -values, -mids, torch.tensor([2.0**-10, 3 * 2.0**-10])])
    pad = (-len(x)) % 127
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), 448.0), x], dim=1)
    cache = torch.zeros(1, x.shape[0], lq.fp8_row_bytes(128), dtype=torch.uint8).to(DEVICE)
    latent_quant.store_latent(x.to(DEVICE), cache, torch.arange(x.shape[0]).to(DEVICE),
                            latent_format="fp8")
    assert torch.equal(cache.cpu()[0, :, :128], x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("latent_format", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dcp", [(0, 1), (1, 2)])
def test_sparse_mla_attention_dequantises_like_ref(latent_format, dcp):
    from glm53.kernels import sparse_mla

    rank, size = dcp
    g = torch.Generator().manual_seed(3)
    lens, heads, lc, bs = [13, 30, 5], 20, 48, 8
    table = _tables(lens, bs, 12, g)
    values = torch.randn(12 * (bs // size), lc, generator=g)
    cache = lq.pack_latent(values, latent_format, 0.5).view(12, bs // size, -1)
    query_seq = torch.tensor([0, 0, 1, 1, 1, 2])
    width = 11
    idx = torch.full((6, width), -1, dtype=torch.long)
    for t, s in enumerate(query_seq.tolist()):
        n = min(lens[s], width - t % 3)
        idx[t, :n] = torch.randperm(lens[s], generator=g)[:n]
    q = torch.randn(6, heads, lc, generator=g)
    o_ref, lse_ref = ref.sparse_mla_attention(q, cache, table, query_seq, idx, 0.3, rank, size,
                                              latent_format)
    # the reference reads the dequantised values: the same as attending them in plain fp32
    o_plain, _ = ref.sparse_mla_attention(q, lq.unpack_latent(cache, lc, latent_format), table,
                                          query_seq, idx, 0.3, rank, size)
    assert torch.equal(o_ref, o_plain)
    d = [x.to(DEVICE) for x in (q, cache, table, query_seq, idx)]
    o, lse = sparse_mla.sparse_mla_attention(*d, 0.3, rank, size, latent_format)
    assert rel_err(o, o_ref) < 1e-5
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert torch.allclose(lse.cpu()[fin], lse_ref[fin], atol=1e-5)


def test_fp8_pool_keys_topk_matches_ref_and_rotation_keeps_scores():
    from glm53.kernels import sparse_mla

    g = torch.Generator().manual_seed(11)
    hi, d, kpool, bs, budget = 5, 16, 4, 8, 3
    lens = [42, 3, 17]
    table = _tables(lens, bs, 12, g)
    keys = torch.randn(12 * (bs // kpool), d, generator=g)
    pools = lq.pack_pool_keys(keys).view(12, bs // kpool, -1)
    # the stored rows are the rotated keys to fp8 precision (H is its own inverse), and the
    # butterflies compute x @ H for the Sylvester matrix H
    back = lq.hadamard_rotate(lq.unpack_fp8(pools, d).view(-1, d))
    assert rel_err(back, keys) < 2**-4
    sylvester = torch.tensor([[1.0]])
    while sylvester.shape[0] < d:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1),
                               torch.cat([sylvester, -sylvester], 1)])
    assert torch.allclose(lq.hadamard_rotate(keys), keys @ sylvester / d**0.5, atol=1e-5)
    rows = [(0, p) for p in (0, 3, 7, 15, 41)] + [(1, 2), (2, 11), (2, 16)]
    query_seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), hi, d, generator=g)
    w = torch.rand(len(rows), hi, generator=g) + 0.1
    out_ref = ref.indexer_topk(q, w, pools, table, query_seq, pos, budget, kpool, "fp8")
    out = sparse_mla.indexer_topk(*(x.to(DEVICE) for x in (q, w, pools, table, query_seq, pos)),
                                  budget, kpool, "fp8")
    for a, b in zip(out.cpu(), out_ref, strict=True):
        assert sorted(a.tolist()) == sorted(b.tolist())
