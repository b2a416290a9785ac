"""Triton EXL3 kernels vs the reference on real shapes, on a CUDA GPU (marker `gpu`).

Shapes: one 4096x2048 K4 MCG matrix (dequant, bit-exact); routed experts with D = 4096,
I = 2048 (288 experts, or 144 local of 288 under EP) and I = 1024 (the TP shape), top-8, bf16
activations, T = 1, 8, 64 (fused decode path) and 512 (scratch + grouped GEMM).
Tolerance 1e-2 relative against the fp32 reference: the decode path rounds the rotated inputs to
fp16 and the output to bf16; the prefill path also rounds What to bf16 (2^-9).
The decode path replays in a CUDA graph with new inputs copied into its static tensors.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import exl3 as ref

from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV, TOL = "cuda", 1e-2


def _words(gen, *shape):
    """Random trellis words: every bit pattern is a valid stream of random symbols."""
    return torch.randint(-(2**15), 2**15, shape, generator=gen, device=DEV, dtype=torch.int16)


def _scales(gen, *shape, mag):
    sign = torch.randint(0, 2, shape, generator=gen, device=DEV) * 2 - 1
    return ((torch.rand(*shape, generator=gen, device=DEV) + 0.5) * sign * mag).half()


def _experts(gen, n_local, d, inter):
    return (_words(gen, n_local, d // 16, 2 * inter // 16, 64),
            _scales(gen, n_local, 2, d, mag=0.02), _scales(gen, n_local, 2 * inter, mag=1.0),
            _words(gen, n_local, inter // 16, d // 16, 64),
            _scales(gen, n_local, inter, mag=0.02), _scales(gen, n_local, d, mag=1.0))


def _routing(gen, tokens, n_total, k=8):
    ids = torch.stack([torch.randperm(n_total, generator=gen, device=DEV)[:k]
                       for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen, device=DEV), ids


def test_dequant_bit_exact_full_matrix():
    from glm53.kernels import exl3

    trellis = _words(torch.Generator(device=DEV).manual_seed(0), 4096 // 16, 2048 // 16, 64)
    out = exl3.exl3_dequant(trellis, 1)
    assert torch.equal(out.view(torch.int16), ref.exl3_dequant(trellis, 1).view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
@pytest.mark.parametrize("n_local,offset,inter", [(288, 0, 2048), (144, 144, 2048),
                                                  (144, 0, 1024)])
def test_moe_exl3(tokens, n_local, offset, inter):
    from glm53.kernels import exl3

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    params = _experts(gen, n_local, 4096, inter)
    x = torch.randn(tokens, 4096, generator=gen, device=DEV).bfloat16()
    wts, ids = _routing(gen, tokens, 288)
    want = ref.moe_exl3(x.float(), *params, wts, ids, 10.0, offset, 1)
    out = exl3.moe_exl3(x, *params, wts, ids, 10.0, offset, 1)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < TOL
    if tokens == 64:  # the other path on the same data
        other = exl3.moe_exl3_on_path(x, *params, wts, ids, 10.0, offset, 1, decode=False)
        assert rel_err(other, want) < TOL


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("kd,n", [(4096, 4096), (2048, 4096)])
def test_gemv4_real_shapes(rows, kd, n):
    """The K = 4 symbol-order GEMV (MR rows per program) on w13 / w2 shapes vs a dense fp32
    matmul with the bit-exact What; runs of 1..5 rows, rows of other ranks' experts."""
    from glm53.kernels import exl3

    gen = torch.Generator(device=DEV).manual_seed(rows)
    runs = (1, 3, 0, 5, 1, 2, 1, 4)
    trellis = _words(gen, len(runs), kd // 16, n // 16, 64)
    key = torch.cat([torch.full((r,), e) for e, r in enumerate(runs)] + [torch.full((3,), 8)])
    key = key.to(DEV)
    starts = torch.searchsorted(key, torch.arange(len(runs) + 1, device=DEV)).to(torch.int32)
    a = torch.randn(2, key.numel(), kd, generator=gen, device=DEV).half().float()
    out = exl3._fused_gemm(a, trellis, key, starts, 1, rows=rows)
    w = exl3.exl3_dequant(trellis, 1).float()
    e = key.clamp(max=len(runs) - 1)
    ns = n // 2
    want = torch.cat([torch.bmm(a[s].unsqueeze(1), w[e][:, :, s * ns:(s + 1) * ns]).squeeze(1)
                      for s in range(2)], dim=1)
    want = torch.where((key < len(runs)).unsqueeze(1), want, 0.0)
    assert rel_err(out, want) < 1e-5


def test_moe_exl3_decode_cuda_graph():
    """Capture the decode path once; replays with new tokens and routes match eager calls."""
    from glm53.kernels import exl3

    gen = torch.Generator(device=DEV).manual_seed(7)
    params = _experts(gen, 144, 4096, 1024)
    x = torch.randn(8, 4096, generator=gen, device=DEV).bfloat16()
    wts, ids = _routing(gen, 8, 288)

    def step():
        return exl3.moe_exl3(x, *params, wts, ids, 10.0, 144, 1)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        gen.manual_seed(seed)
        x.copy_(torch.randn(8, 4096, generator=gen, device=DEV))
        new_wts, new_ids = _routing(gen, 8, 288)
        wts.copy_(new_wts)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, step()) < 1e-3  # index_add's atomics: any order of the k adds
        assert rel_err(out, ref.moe_exl3(x.float(), *params, wts, ids, 10.0, 144, 1)) < TOL
