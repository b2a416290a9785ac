"""The dense-projection GEMV vs its reference (cuBLAS / torch's GEMM), fp32 relative error.

Tolerance 1e-6 in fp32 (the products summed per K lane, then across lanes: another order than
the reference's); bf16 inputs compare the kernel's fp32 sum rounded once against the fp64
product rounded once, within one bf16 ulp (2^-7 relative) per element: the GPU rounds to
nearest (half an ulp), the interpreter's fp32 -> bf16 cast truncates (under one ulp).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import linear as ref_linear

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def gemv_rows_up_to_4(monkeypatch):
    """The kernel's multi-row form (dense_gemv.py times it; the model takes it at one row)."""
    from glm53.kernels import linear

    monkeypatch.setattr(linear, "GEMV_MAX_TOKENS", 4)


@pytest.mark.parametrize("t,n,k", [(1, 37, 72), (3, 70, 264), (4, 5, 40), (2, 129, 512)])
def test_linear_gemv_matches_ref(t, n, k):
    """Awkward N (a partial last block), K not a multiple of the step (masked tail) or equal to
    one step, token rows padded to a power of two."""
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(31)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(n, k, generator=g)
    out = linear.linear(x.to(DEVICE), w.to(DEVICE))
    assert out.shape == (t, n)
    assert rel_err(out, ref_linear.linear(x, w)) < 1e-6


def test_linear_gemv_adds_in_the_epilogue():
    """`add` (e.g. the routed experts' sum into the shared expert's down projection), with
    strided rows, on 3 token rows."""
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(34)
    x, w = torch.randn(3, 200, generator=g), torch.randn(50, 200, generator=g)
    add = torch.randn(3, 100, generator=g)[:, :50] * 10
    out = linear.linear(x.to(DEVICE), w.to(DEVICE), add=add.to(DEVICE))
    want = ref_linear.linear(x, w, add=add)
    assert rel_err(want, x @ w.t() + add) < 1e-6
    assert rel_err(out, want) < 1e-6


def test_linear_gemv_bf16_writes_out_and_keeps_leading_dims():
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(32)
    x = torch.randn(1, 2, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 96, generator=g) * 0.1).to(torch.bfloat16)
    exact = (x.double().reshape(2, 96) @ w.double().t())
    out = linear.linear(x.to(DEVICE), w.to(DEVICE))
    assert out.shape == (1, 2, 48) and out.dtype == torch.bfloat16
    assert ((out.reshape(2, 48).double().cpu() - exact).abs()
            <= exact.abs() * 2.0 ** -7 + 1e-6).all()
    buf = torch.full((2, 48), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = linear.linear(x.reshape(2, 96).to(DEVICE), w.to(DEVICE), out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf.cpu(), out.reshape(2, 48).cpu())


@pytest.mark.parametrize("t,inter,k", [(1, 37, 72), (3, 20, 264)])
def test_linear_swiglu_matches_ref(t, inter, k):
    """gate | up rows interleaved per program, an odd intermediate (a partial last block),
    values past the clamp."""
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(35)
    x, w = torch.randn(t, k, generator=g), torch.randn(2 * inter, k, generator=g)
    out = linear.linear_swiglu(x.to(DEVICE), w.to(DEVICE), 7.0)
    want = ref_linear.linear_swiglu(x, w, 7.0)
    assert out.shape == (t, inter) and (want.abs() > 0).all()
    assert (x @ w.t()).abs().max() > 7.0  # the clamp is exercised
    assert rel_err(out, want) < 1e-6


def test_linear_gemv_widens_bf16_rows_against_fp32_weights():
    """bf16 x times fp32 weights (the indexer's head weights) equals the reference, which
    casts x to fp32 first: the widening is exact either way."""
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(36)
    x = torch.randn(2, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 96, generator=g)
    out = linear.linear(x.to(DEVICE), w.to(DEVICE))
    assert out.dtype == torch.float32
    assert rel_err(out, ref_linear.linear(x, w)) < 1e-6


def test_linear_past_the_gemv_rows_or_strided_runs_the_reference(monkeypatch):
    """More token rows than GEMV_MAX_TOKENS, or rows that are not contiguous: cuBLAS (the
    kernel is never launched)."""
    from glm53.kernels import linear

    g = torch.Generator().manual_seed(33)
    w = torch.randn(24, 64, generator=g).to(DEVICE)
    launched = []
    monkeypatch.setattr(linear, "linear_gemv_kernel", _Recorder(launched))
    for x in (torch.randn(linear.GEMV_MAX_TOKENS + 1, 64, generator=g),
              torch.randn(2, 128, generator=g)[:, ::2]):
        out = linear.linear(x.to(DEVICE), w)
        assert rel_err(out, ref_linear.linear(x, w.cpu())) < 1e-6
    assert launched == []
    linear.linear(torch.randn(1, 64, generator=g).to(DEVICE), w)
    assert launched == [1]


def test_gemv_tile_fills_the_sms_and_bounds_the_products():
    from glm53.kernels import linear

    dev = torch.device("cpu")  # 132 SMs assumed off CUDA
    assert linear.gemv_tile(1, 12320, 4096, dev) == (1, 8, 512)  # 1540 programs
    assert linear.gemv_tile(1, 4096, 4096, dev) == (1, 4, 1024)  # 1024 programs
    assert linear.gemv_tile(1, 2048, 4096, dev) == (1, 2, 2048)  # 1024 programs
    assert linear.gemv_tile(3, 77440, 4096, dev) == (4, 2, 512)
    assert linear.gemv_tile(1, 37, 72, dev) == (1, 2, 128)


class _Recorder:
    """Stands in for the jitted kernel: records launches instead of running them."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(1)
        return launch
