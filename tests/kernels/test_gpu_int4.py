"""INT4 routed experts on real shapes on a CUDA GPU (marker `gpu`): D = 4096, 288 experts of
I = 2048 (and 144 local experts of I = 1024 with an EP offset), top-8, T = 1..512, both paths,
the decode path's two variants forced (dot-free at 1, 2, 4 rows per block, with K splits;
tl.dot), the decode path replayed in a CUDA graph with new inputs (T = 1, 8, 64: each
dot-free block size the default picks, and 200 tokens: tl.dot), and the kernels one call
launches on the unsorted pairs (T <= 16: three).

Weights are random codes with scales ~0.0027 and zeros centring them (|w| <= 0.02, like the bf16
tests). Tolerance: relative error 1e-2 (fp16 / bf16 operands with fp32 accumulation against the
fp32 reference; the output is rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import int4 as ref_int4

from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL, DEV, D = 1e-2, "cuda", 4096


def random_int4_experts(n_local, inter, gen, group_size=128):
    """(w13_q, w13_scale, w13_zero, w2_q, w2_scale, w2_zero): random codes, per-group scales in
    [0.002, 0.003] and zero = -7.5 scale (the codes' midpoint at 0)."""
    def linear(n, kin):
        q = torch.randint(0, 256, (n_local, n, kin // 2), generator=gen, device=DEV,
                          dtype=torch.uint8)
        scale = (torch.rand(n_local, n, kin // group_size, generator=gen, device=DEV) * 1e-3
                 + 2e-3).half()
        return q, scale, (-7.5 * scale.float()).half()
    return (*linear(2 * inter, D), *linear(D, inter))


def _routes(tokens, n_experts, gen):
    # contiguous, as route_topk writes them (a strided view costs moe_int4 one copy launch)
    ids = torch.rand(tokens, n_experts, generator=gen, device=DEV).argsort(1)[:, :8].contiguous()
    return torch.rand(tokens, 8, generator=gen, device=DEV), ids


@pytest.fixture(scope="module")
def experts_288():
    return random_int4_experts(288, 2048, torch.Generator(device=DEV).manual_seed(0))


# 2048: ~57 rows an expert, the tl.dot variant's blocks of 64 rows (wgmma on sm_90, nibble trick)
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 2048])
def test_moe_int4_288_experts(experts_288, tokens):
    from glm53.kernels import int4

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    want = ref_int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
    paths = ("decode", "prefill") if tokens >= 64 else ("decode",)
    for path in paths:
        out = int4.moe_int4_on_path(x, *experts_288, wts, ids, 10.0, 0, 128, path=path)
        assert rel_err(out, want) < TOL, path
    assert rel_err(int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128), want) < TOL


@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_int4_ep_rank(tokens):
    """Rank 1 of EP 2: local experts 144..287 of I = 1024; the other half of the pairs skip."""
    from glm53.kernels import int4

    gen = torch.Generator(device=DEV).manual_seed(100 + tokens)
    experts = random_int4_experts(144, 1024, gen)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    ids[0, 0] = 200  # one local pair at least
    want = ref_int4.moe_int4(x, *experts, wts, ids, 10.0, 144, 128)
    for path in ("decode", "prefill"):
        out = int4.moe_int4_on_path(x, *experts, wts, ids, 10.0, 144, 128, path=path)
        assert rel_err(out, want) < TOL, path


@pytest.mark.parametrize("variant", ["dot", "gemv1", "gemv2", "gemv4", "gemv1-split8"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_moe_int4_decode_variants(experts_288, monkeypatch, variant, tokens):
    from glm53.kernels import int4, int4_gemv

    bm = {"dot": 0, "gemv1": 1, "gemv2": 2, "gemv4": 4, "gemv1-split8": 1}[variant]
    monkeypatch.setattr(int4_gemv, "DECODE_GEMV", ((10**9, bm),) if bm else ())
    if variant.endswith("split8"):
        monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", 8)
    gen = torch.Generator(device=DEV).manual_seed(200 + tokens)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    want = ref_int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
    out = int4.moe_int4_on_path(x, *experts_288, wts, ids, 10.0, 0, 128, path="decode")
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("tokens", [1, 8, 64, 200])
def test_moe_int4_decode_in_cuda_graph(experts_288, tokens):
    """Captured once on one batch, replayed on others written into its inputs."""
    from glm53.kernels import int4

    gen = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
    for seed in (8, 9):
        gen.manual_seed(seed)
        x.copy_(torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16))
        new_wts, new_ids = _routes(tokens, 288, gen)
        wts.copy_(new_wts)
        ids.copy_(new_ids)
        graph.replay()
        want = ref_int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
        assert rel_err(out, want) < TOL


@pytest.mark.parametrize("tokens", [1, 16])
def test_moe_int4_pairs_three_launches(experts_288, tokens):
    """Up to PAIRS_MAX_TOKENS a call is three kernels (w13, w2, the reduce) on bf16 x and bf16
    routing weights: no memset of an fp32 sum, no weight or output cast."""
    from torch.autograd import DeviceType

    from glm53.kernels import int4

    gen = torch.Generator(device=DEV).manual_seed(300 + tokens)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    wts = wts.bfloat16()
    int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)  # compiled outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(kernels) == 3, kernels
    want = ref_int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < TOL


@pytest.mark.parametrize("tokens", [1, 8])
def test_tiled_codes_give_the_row_major_bits(experts_288, tokens):
    """int4_gemv.tile_words' layout read with tiled=True: the row-major result bit for bit."""
    from glm53.kernels import int4_gemv

    gen = torch.Generator(device=DEV).manual_seed(500 + tokens)
    x = torch.randn(tokens, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    wts, ids = _routes(tokens, 288, gen)
    q13, s13, z13, q2, s2, z2 = experts_288
    tiled = ((int4_gemv.tile_words(q13), s13, z13), (int4_gemv.tile_words(q2), s2, z2))
    outs = [int4_gemv.moe_decode_pairs(x, w13, w2, 128, 128, ids, wts, 0, 10.0, 288,
                                       tiled=is_tiled)
            for (w13, w2), is_tiled in ((((q13, s13, z13), (q2, s2, z2)), False), (tiled, True))]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], ref_int4.moe_int4(x, *experts_288, wts, ids, 10.0, 0, 128)) < TOL
