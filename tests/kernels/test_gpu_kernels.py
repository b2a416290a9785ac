"""Triton kernels vs their references on real shapes, on a CUDA GPU (marker `gpu`).

Shapes: KDA with 32 and 64 heads of 128, decode batches 1/16/64 and varlen prefill; sparse MLA
with 32 and 64 heads over the 512-wide bf16 latent at contexts 2K-128K, batches 1-64; the
indexer with 32 heads of 128; MoE with 288 experts (4096 -> 2x2048 -> 4096, top-8).
Tolerances, relative error: bf16 outputs 1e-2 (both sides fp32 inside, the output rounded to
bf16), fp32 KDA states 1e-4 from our fp32 recurrence and 1e-2 where long prefill takes a
chunked kernel (fla's chunk_kda when installed, else ours: tensor-core products inside, see
test_gpu_kda_chunk.py); indexer selections
overlap >= 99% (bf16 scores near-tie).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import kda as ref_kda
from glm53.kernels.ref import mhc as ref_mhc
from glm53.kernels.ref import moe as ref_moe
from glm53.kernels.ref import norm as ref_norm
from glm53.kernels.ref import sparse_mla as ref_mla

from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16_TOL, STATE_TOL = 1e-2, 1e-4
DEV = "cuda"


def _kda_inputs(lens, heads, gen, dk=128):
    t = sum(lens)
    mixed = torch.randn(t, 3 * heads * dk, generator=gen).to(DEV, torch.bfloat16)
    q, k, v = (c.view(t, heads, dk) for c in mixed.chunk(3, dim=-1))
    g = (-5 * torch.sigmoid(torch.randn(t, heads, dk, generator=gen))).to(DEV)
    beta = torch.sigmoid(torch.randn(t, heads, generator=gen)).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    return q, k, v, g, beta, cu


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("lens", [[1], [1] * 16, [1] * 64, [4] * 8, [700, 1, 2048, 77]])
def test_kda_attention(heads, lens):
    from glm53.kernels import kda

    gen = torch.Generator().manual_seed(len(lens) * heads)
    q, k, v, g, beta, cu = _kda_inputs(lens, heads, gen)
    n = len(lens)
    state = torch.randn(n + 3, heads, 128, 128, generator=gen).to(DEV) * 0.1
    ids = torch.randperm(n + 3, generator=gen)[:n].to(DEV)
    init = (torch.arange(n, device=DEV) % 3 != 0)
    s_ref = state.clone()
    o_ref = ref_kda.kda_attention(q, k, v, g, beta, s_ref, cu, ids, init)
    o = kda.kda_attention(q, k, v, g, beta, state, cu, ids, init)
    assert rel_err(o, o_ref) < BF16_TOL
    chunked = sum(lens) >= kda.CHUNK_MIN_TOKENS_PER_SEQ * n
    assert rel_err(state, s_ref) < (1e-2 if chunked else STATE_TOL)


@pytest.mark.parametrize("lens", [[1] * 64, [3, 1000, 17]])
def test_causal_conv1d(lens):
    from glm53.kernels import kda

    gen = torch.Generator().manual_seed(5)
    chans = 3 * 4096
    x = torch.randn(sum(lens), chans, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(chans, 4, generator=gen).to(DEV)
    n = len(lens)
    state = torch.randn(n, chans, 3, generator=gen).to(DEV, torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    ids, init = torch.arange(n, device=DEV).flip(0), torch.arange(n, device=DEV) % 2 == 0
    s_ref = state.clone()
    y_ref = ref_kda.causal_conv1d(x, w, s_ref, cu, ids, init)
    y = kda.causal_conv1d(x, w, state, cu, ids, init)
    assert rel_err(y, y_ref) < BF16_TOL
    assert torch.equal(state, s_ref)


def _paged(n_seq, ctx, bs, gen):
    blocks = -(-ctx // bs)
    perm = torch.randperm(n_seq * blocks + 1, generator=gen)
    perm = perm[perm != 0][: n_seq * blocks]
    return perm.view(n_seq, blocks).to(DEV), n_seq * blocks + 1


@pytest.mark.parametrize("heads,batch,ctx", [(64, 1, 131072), (64, 16, 32768), (32, 64, 2048),
                                             (64, 4, 8192)])
@pytest.mark.parametrize("verify", [1, 4])
def test_sparse_mla_attention(heads, batch, ctx, verify):
    from glm53.kernels import sparse_mla

    gen = torch.Generator().manual_seed(heads + batch)
    table, n_blocks = _paged(batch, ctx, 64, gen)
    cache = torch.randn(n_blocks, 64, 512, generator=gen).to(DEV, torch.bfloat16)
    t = batch * verify
    q = torch.randn(t, heads, 512, generator=gen).to(DEV, torch.bfloat16)
    width = min(2051, ctx)
    idx = torch.stack([torch.randperm(ctx, generator=gen)[:width] for _ in range(t)]).to(DEV)
    idx[:, -3:] = -1
    qs = torch.arange(batch, device=DEV).repeat_interleave(verify)
    o_ref, lse_ref = ref_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    o, lse = sparse_mla.sparse_mla_attention(q, cache, table, qs, idx, 1 / 16)
    assert rel_err(o, o_ref) < BF16_TOL
    assert torch.allclose(lse, lse_ref, atol=1e-2)


@pytest.mark.parametrize("batch,ctx", [(1, 131072), (16, 32768), (64, 2048)])
def test_indexer_topk(batch, ctx):
    from glm53.kernels import sparse_mla

    gen = torch.Generator().manual_seed(batch)
    table, n_blocks = _paged(batch, ctx, 64, gen)
    pools = torch.randn(n_blocks, 16, 128, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(batch, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(batch, 32, generator=gen) * 32**-0.5).to(DEV)
    pos = torch.full((batch,), ctx - 1, device=DEV)
    qs = torch.arange(batch, device=DEV)
    # the reference builds index tensors on the CPU: run it there
    out_ref = ref_mla.indexer_topk(*(x.cpu() for x in (q, w, pools, table, qs, pos)), 512, 4)
    out = sparse_mla.indexer_topk(q, w, pools, table, qs, pos, 512, 4)
    for a, b in zip(out.cpu(), out_ref.cpu(), strict=True):
        sa, sb = set(a.tolist()), set(b.tolist())
        assert len(sa & sb) >= 0.99 * len(sb)


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_fused_moe(tokens):
    from glm53.kernels import moe

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    e, d, inter = 288, 4096, 2048
    kw = dict(generator=gen, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(tokens, d, **kw)
    w13 = torch.randn(e, 2 * inter, d, **kw) * 0.02
    w2 = torch.randn(e, d, inter, **kw) * 0.02
    ids = torch.stack([torch.randperm(e, generator=gen, device=DEV)[:8] for _ in range(tokens)])
    wts = torch.rand(tokens, 8, generator=gen, device=DEV)
    out_ref = ref_moe.fused_moe(x, w13, w2, wts, ids, 10.0)
    assert rel_err(moe.fused_moe(x, w13, w2, wts, ids, 10.0), out_ref) < BF16_TOL


def test_small_ops():
    from glm53.kernels import mhc, norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(4096, generator=gen).to(DEV, torch.bfloat16)
    assert rel_err(norm.rms_norm(x, w, 1e-5), ref_norm.rms_norm(x, w, 1e-5)) < BF16_TOL
    fn = (torch.randn(24, 4 * 4096, generator=gen) * 0.01).to(DEV)
    base, scale = torch.randn(24, generator=gen).to(DEV), torch.rand(3, generator=gen).to(DEV)
    # the mixing pass one token a program (1), 16 by tl.dot (16), 64 by tl.dot (600)
    for tokens in (1, 600, 16):
        streams = torch.randn(tokens, 4, 4096, generator=gen).to(DEV, torch.bfloat16)
        for fused_norm in ((), (w, 1e-5)):  # with the block's input RMSNorm fused, and without
            for a, b in zip(mhc.hc_pre(streams, fn, base, scale, 1e-5, 1e-6, 20, *fused_norm),
                            ref_mhc.hc_pre(streams, fn, base, scale, 1e-5, 1e-6, 20,
                                           *fused_norm), strict=True):
                assert rel_err(a, b) < BF16_TOL
    post, comb, _ = ref_mhc.hc_pre(streams, fn, base, scale, 1e-5, 1e-6, 20)
    y = torch.randn(16, 4096, generator=gen).to(DEV, torch.bfloat16)
    assert rel_err(mhc.hc_post(streams, y, post, comb),
                   ref_mhc.hc_post(streams.float(), y.float(), post, comb)) < BF16_TOL
    # an expansion feeding the next site: fused at 1 and 8 tokens, the two ops at 16; the
    # reference expands in fp32 and rounds the streams once, as the kernels do
    for tokens in (1, 8, 16):
        args = (streams[:tokens], y[:tokens], post[:tokens], comb[:tokens], fn, base, scale)
        new = ref_mhc.hc_post(streams[:tokens].float(), y[:tokens].float(), post[:tokens],
                              comb[:tokens]).to(torch.bfloat16)
        want = (new, *ref_mhc.hc_pre(new, fn, base, scale, 1e-5, 1e-6, 20, w, 1e-5))
        got = mhc.hc_post_pre(*args, 1e-5, 1e-6, 20, w, 1e-5)
        for a, b in zip(got, want, strict=True):
            assert rel_err(a, b) < BF16_TOL, tokens


@pytest.mark.parametrize("tokens", [1, 4, 5])
def test_router_logits(tokens):
    """The real router GEMM (288 x 4096 fp32) from bf16 x: the kernel up to 4 tokens, cuBLAS
    on 5."""
    from glm53.kernels import moe

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, 4096, generator=gen, device=DEV).to(torch.bfloat16)
    w = torch.randn(288, 4096, generator=gen, device=DEV) * 0.02
    assert rel_err(moe.router_logits(x, w), ref_moe.router_logits(x, w)) < 1e-5


@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(12320, 4096), (4096, 128), (32, 4096), (77440, 4096)])
def test_linear_gemv(tokens, n, k, monkeypatch):
    """Rank 0's dense projections (KDA in_proj, f_b/g_b, the indexer's weights_proj, the LM
    head) at 1-4 token rows (the model takes it at one; dense_gemv.py times more): the GEMV
    against cuBLAS, bf16 out."""
    from glm53.kernels import linear
    from glm53.kernels.ref import linear as ref_linear

    monkeypatch.setattr(linear, "GEMV_MAX_TOKENS", 4)

    gen = torch.Generator(device=DEV).manual_seed(n + tokens)
    x = torch.randn(tokens, k, generator=gen, device=DEV).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    assert rel_err(linear.linear(x, w), ref_linear.linear(x, w)) < BF16_TOL


@pytest.mark.parametrize("tokens", [1, 4])
def test_linear_swiglu_and_add(tokens, monkeypatch):
    """The shared expert at rank 0's shapes: gate_up (2 x 1024 rows of 4096) with its swiglu,
    then down (4096 x 1024) adding the routed sum."""
    from glm53.kernels import linear
    from glm53.kernels.ref import linear as ref_linear

    monkeypatch.setattr(linear, "GEMV_MAX_TOKENS", 4)

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, 4096, generator=gen, device=DEV).to(torch.bfloat16)
    w13 = (torch.randn(2048, 4096, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4096, 1024, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    routed = torch.randn(tokens, 4096, generator=gen, device=DEV).to(torch.bfloat16)
    h = linear.linear_swiglu(x, w13, 10.0)
    assert rel_err(h, ref_linear.linear_swiglu(x, w13, 10.0)) < BF16_TOL
    assert rel_err(linear.linear(h, w2, add=routed), ref_linear.linear(h, w2, add=routed)) \
        < BF16_TOL


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_route_topk(tokens):
    """The real router: 288 experts, top-8, renormalised, scaling 2.5; same expert sets."""
    from glm53.kernels import moe

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    logits = torch.randn(tokens, 288, generator=gen, device=DEV)
    bias = torch.randn(288, generator=gen, device=DEV) * 0.1
    w, ids = moe.route_topk(logits, bias, 8, True, 2.5)
    w_ref, ids_ref = ref_moe.route_topk(logits, bias, 8, True, 2.5)
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    assert rel_err(w.gather(1, order), w_ref.gather(1, order_ref)) < 1e-6


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("lens,defer", [([1] * 64, None),
                                        ([4, 4, 4, 4], [True, False, True, False])])
def test_kda_mixer(heads, lens, defer):
    """The fused decode/verify mixer vs the reference composition on real widths (bf16
    projections, fp32 states): outputs and the written slots and windows."""
    from glm53.kernels import kda_mixer
    from glm53.kernels.ref import kda_mixer as ref_mixer

    gen = torch.Generator(device=DEV).manual_seed(heads + len(lens))
    n_tok, n_seq, chans = sum(lens), len(lens), 3 * heads * 128
    bf = dict(generator=gen, device=DEV, dtype=torch.bfloat16)
    pre = torch.randn(n_tok, chans, **bf)
    w = torch.randn(chans, 4, generator=gen, device=DEV) * 0.5
    conv = torch.randn(96, chans, 3, **bf)
    logits = torch.randn(n_tok, heads * 128, **bf)
    dt = torch.randn(heads * 128, generator=gen, device=DEV) * 0.1
    alog = torch.randn(heads, generator=gen, device=DEV) * 0.5
    bl, z = torch.randn(n_tok, heads, **bf), torch.randn(n_tok, heads, 128, **bf)
    nw = torch.randn(128, **bf)
    state = torch.randn(96, heads, 128, 128, generator=gen, device=DEV) * 0.05
    ids = torch.randperm(96, generator=gen, device=DEV)[:n_seq]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    init = torch.arange(n_seq, device=DEV) % 5 != 0
    dfr = None if defer is None else torch.tensor(defer, device=DEV)
    s_ref, c_ref = state.clone(), conv.clone()
    got = kda_mixer.kda_mixer(pre, w, conv, logits, dt, alog, -5.0, bl, z, nw, 1e-5, state, cu,
                              ids, init, dfr)
    want = ref_mixer.kda_mixer(pre, w, c_ref, logits, dt, alog, -5.0, bl, z, nw, 1e-5, s_ref,
                               cu, ids, init, dfr)
    assert (got[1] is None) == (want[1] is None) == (defer is None)
    for a, b in zip([got[0], *(got[1] or ())], [want[0], *(want[1] or ())], strict=True):
        assert rel_err(a, b) < BF16_TOL
    assert rel_err(state[ids], s_ref[ids]) < STATE_TOL
    assert rel_err(conv[ids], c_ref[ids]) < BF16_TOL
