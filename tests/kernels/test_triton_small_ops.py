"""Triton MoE, SwiGLU, RMSNorm and mHC kernels vs their references (fp32, awkward sizes).

Tolerances (fp32 relative error): SwiGLU / RMSNorm 1e-6, mHC 1e-5 (the GEMM is summed in
another order), MoE 1e-5 (the reference accumulates experts in x's dtype, here in fp32), router
weights 1e-6 with identical expert sets.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import mhc as ref_mhc
from glm53.kernels.ref import moe as ref_moe
from glm53.kernels.ref import norm as ref_norm

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


def test_swiglu_matches_ref_on_strided_halves():
    from glm53.kernels import moe

    g = torch.Generator().manual_seed(20)
    h = torch.randn(7, 2 * 37, generator=g) * 8  # values beyond the clamp
    out = moe.swiglu(h.to(DEVICE)[:, :37], h.to(DEVICE)[:, 37:], 10.0)
    assert rel_err(out, ref_moe.swiglu(h[:, :37], h[:, 37:], 10.0)) < 1e-6


@pytest.mark.parametrize("expert_offset", [0, 3])
def test_fused_moe_matches_ref(expert_offset):
    """EP: with expert_offset 3 the rank holds experts 3..7 of 10; the others are skipped."""
    from glm53.kernels import moe

    g = torch.Generator().manual_seed(21)
    t, d, inter, n_local, k = 9, 24, 16, 5, 3
    x = torch.randn(t, d, generator=g)
    w13 = torch.randn(n_local, 2 * inter, d, generator=g) * 0.3
    w2 = torch.randn(n_local, d, inter, generator=g) * 0.3
    ids = torch.stack([torch.randperm(10, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    out_ref = ref_moe.fused_moe(x, w13, w2, wts, ids, 7.0, expert_offset)
    out = moe.fused_moe(*(a.to(DEVICE) for a in (x, w13, w2, wts, ids)), 7.0, expert_offset)
    assert rel_err(out, out_ref) < 1e-5


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_ref(with_weight):
    from glm53.kernels import norm

    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 5, 2 * 45, generator=g)[..., :45]  # strided rows, D not a power of 2
    w = torch.randn(45, generator=g) if with_weight else None
    out = norm.rms_norm(x.to(DEVICE), None if w is None else w.to(DEVICE), 1e-5)
    assert out.shape == x.shape
    assert rel_err(out, ref_norm.rms_norm(x, w, 1e-5)) < 1e-6


@pytest.mark.parametrize("t", [5, 37, 70])
@pytest.mark.parametrize("n,d,normed,columns,steps", [
    (4, 40, False, 4096, 1), (4, 40, True, 4096, 1), (2, 1100, True, 4096, 1),
    (2, 1100, True, 256, 1), (2, 1100, False, 256, 1), (2, 1100, True, 4096, 4),
    (2, 1100, True, 4096, "large")])
def test_hc_pre_matches_ref(monkeypatch, t, n, d, normed, columns, steps):
    """The projection's column parts: one partial (n*D = 160: two programs, the second short)
    or many (2 x 1100 = 2200: 18 programs, summed over a padded tile); with the block's input
    RMSNorm fused or not; the row in registers (one pass) or 256 columns a step (five, the
    last short, the normed row read back). Tokens one a program (5) or MIX_TOKENS (16: 37 = 2
    blocks and a short one, 70 = 4 and a short one) a program by tl.dot, whose M (2 + n) n =
    8 at n = 2 is padded to 16, there also 4 column steps a program (MIX_STEPS: 5 parts, the
    last with 2 steps inside the row and 2 past it); "large": the prefill tile MIX_LARGE (64
    tokens, 16 steps of 32 columns: 37 = one short block, 70 = one and a short one; 5 parts,
    the last 152 columns) from 32 tokens on."""
    from glm53.kernels import mhc

    monkeypatch.setattr(mhc, "PRE_COLUMNS", columns)
    if steps == "large":
        monkeypatch.setattr(mhc, "MIX_LARGE_MIN_TOKENS", 32)
        monkeypatch.setattr(mhc, "MIX_LARGE", (64, 32, 16))
    else:
        monkeypatch.setattr(mhc, "MIX_STEPS", steps)
    g = torch.Generator().manual_seed(23)
    streams = torch.randn(t, n, d, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    norm = (torch.rand(d, generator=g) + 0.5, 1e-5) if normed else (None, 0.0)
    refs = ref_mhc.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20, *norm)
    outs = mhc.hc_pre(*(a.to(DEVICE) for a in (streams, fn, base, scale)), 1e-6, 1e-6, 20,
                      None if norm[0] is None else norm[0].to(DEVICE), norm[1])
    for out, want in zip(outs, refs, strict=True):
        assert out.dtype == want.dtype and rel_err(out, want) < 1e-5
    if normed:  # the norm is really applied: mean square m / (m + eps) before its weight
        m = ref_mhc.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20)[2].square().mean(-1)
        unweighted = refs[2] / norm[0]
        assert torch.allclose(unweighted.square().mean(-1), m / (m + norm[1]), rtol=1e-4)


@pytest.mark.parametrize("t", [1, 6, 20])
@pytest.mark.parametrize("n,d,normed", [(4, 40, True), (2, 1100, False), (2, 1100, True)])
def test_hc_post_pre_matches_ref(t, n, d, normed):
    """One site's expansion feeding the next site: fused below 16 tokens (n = 4: 32 columns of
    D a program, so D = 40 is two programs, the second short; n = 2: 64, 18 programs), the two
    ops back to back from 16 on; comb not symmetric; the next site's norm fused or not."""
    from glm53.kernels import mhc

    g = torch.Generator().manual_seed(25)
    streams, y = torch.randn(t, n, d, generator=g), torch.randn(t, d, generator=g)
    post, comb = torch.rand(t, n, generator=g) * 2, torch.rand(t, n, n, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    norm = (torch.rand(d, generator=g) + 0.5, 1e-5) if normed else (None, 0.0)
    args = (streams, y, post, comb, fn, base, scale)
    refs = ref_mhc.hc_post_pre(*args, 1e-6, 1e-6, 20, *norm)
    outs = mhc.hc_post_pre(*(a.to(DEVICE) for a in args), 1e-6, 1e-6, 20,
                           None if norm[0] is None else norm[0].to(DEVICE), norm[1])
    assert len(outs) == 4
    for out, want in zip(outs, refs, strict=True):
        assert out.shape == want.shape and out.dtype == want.dtype
        assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("n,d", [(4, 40), (2, 1100), (1, 7)])
def test_hc_post_matches_ref(n, d):
    """D spans several column blocks (1100 > 512) or is tiny; comb is not symmetric."""
    from glm53.kernels import mhc

    g = torch.Generator().manual_seed(24)
    t = 6
    streams = torch.randn(t, n, d, generator=g)
    y = torch.randn(t, d, generator=g)
    post, comb = torch.rand(t, n, generator=g) * 2, torch.rand(t, n, n, generator=g)
    out = mhc.hc_post(*(a.to(DEVICE) for a in (streams, y, post, comb)))
    assert out.shape == streams.shape
    assert rel_err(out, ref_mhc.hc_post(streams, y, post, comb)) < 1e-6


@pytest.mark.parametrize("t", [1, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_matches_ref(t, dtype):
    """37 experts, D = 100 (not a power of 2), rows of x strided (a view of a wider tensor);
    up to 4 tokens the kernel, 6 the fallback; fp32 logits either way."""
    from glm53.kernels import moe

    g = torch.Generator().manual_seed(26)
    x = torch.randn(t, 2 * 100, generator=g).to(dtype)[:, :100]
    w = torch.randn(37, 100, generator=g)
    out = moe.router_logits(x.to(DEVICE), w.to(DEVICE))
    assert out.dtype == torch.float32 and out.shape == (t, 37)
    assert rel_err(out, ref_moe.router_logits(x, w)) < 1e-6


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_matches_ref(renormalize):
    """288-style routing on an awkward expert count (37, not a power of 2), strided logits,
    and a correction bias strong enough to change the winners (so it really is applied)."""
    from glm53.kernels import moe

    g = torch.Generator().manual_seed(25)
    t, e, k = 11, 37, 5
    logits = torch.randn(t, 2 * e, generator=g)[:, :e]
    bias = torch.randn(e, generator=g)
    w_ref, ids_ref = ref_moe.route_topk(logits, bias, k, renormalize, 2.5)
    w, ids = moe.route_topk(logits.to(DEVICE), bias.to(DEVICE), k, renormalize, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    unbiased = ref_moe.route_topk(logits, torch.zeros(e), k, renormalize, 2.5)[1]
    assert not torch.equal(unbiased.sort(-1).values, ids_ref.sort(-1).values)
    order, order_ref = ids.cpu().argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.cpu().gather(1, order), ids_ref.gather(1, order_ref))
    assert rel_err(w.cpu().gather(1, order), w_ref.gather(1, order_ref)) < 1e-6

