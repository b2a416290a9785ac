"""benchmarks/dense_gemv.py: rank 0's dense projections, counted as a step reads them (no GPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import dense_gemv

    return dense_gemv


def test_rank0_shapes_are_the_release_ranks_projections(bench):
    shapes = bench.rank0_shapes()
    # 34 KDA layers (TP2: 32 heads of q|k|v of 128 + beta), 43 MoE shared experts (gate_up
    # with their swiglu, 1024 x 2 rows at TP2), 3 dense FFNs, the vocab-sharded LM head
    assert shapes[(12320, 4096, False)] == 34
    assert shapes[(2048, 4096, True)] == 43 and shapes[(12288, 4096, True)] == 3
    assert shapes[(4096, 1024, False)] == 43
    assert shapes[(77440, 4096, False)] == 1
    assert shapes[(4096, 128, False)] == 2 * 34  # f_b and g_b
    assert not any(n == 16384 and k == 512 for n, k, _ in shapes)  # kv_b_proj: einsums
    gb = sum(2 * n * k * c for (n, k, _), c in shapes.items()) / 1e9
    assert 8.3 < gb < 8.5, gb


def test_smoke_checks_the_gemv_against_cublas_reference(bench, monkeypatch, capsys):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from glm53.kernels import utils

    if not utils.INTERPRET:
        pytest.skip("the kernels were imported without the interpreter")
    monkeypatch.setattr("sys.argv", ["dense_gemv.py", "--smoke", "--tokens", "1,3"])
    bench.main()
    err = float(capsys.readouterr().out.split("error")[-1])
    assert 0 < err < 1e-5
    # past the model's one row too: the GEMV, not cuBLAS against itself (exactly 0 error)
    assert bench.check([(37, 72)], [3], "cpu") > 0
