"""benchmarks/moe_4bit.py --sweep: the grid a device run sweeps int4's constants over (no GPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import moe_4bit

    return moe_4bit


def test_overrides_replace_only_their_constants(bench):
    grid = bench.sweep_grid(["GEMV_BN13=32,64", "GEMV_AHEAD=2", "PAIRS_MAX_TOKENS=8,16"])
    assert grid["GEMV_BN13"] == [32, 64] and grid["GEMV_AHEAD"] == [2]
    assert grid["PAIRS_MAX_TOKENS"] == [8, 16]  # added: a constant outside INT4_SWEEP
    assert bench.sweep_grid(["DOT_BM_MAX=16,64"])["DOT_BM_MAX"] == [16, 64]  # int4's
    assert bench.sweep_grid(["GEMV_W2_SPLIT=1,2"])["GEMV_W2_SPLIT"] == [1, 2]  # None by default
    assert grid["GEMV_BN2"] == bench.INT4_SWEEP["GEMV_BN2"]
    assert bench.sweep_grid([]) == bench.INT4_SWEEP
    assert bench.INT4_SWEEP["GEMV_BN13"] == [32, 64, 128]  # the module's grid is left alone


@pytest.mark.parametrize("item", ["GEMV_BN13", "GEMV_BN13=", "NOT_A_CONSTANT=1",
                                  "DECODE_GEMV=1"])  # a table, not an int
def test_bad_overrides_are_refused(bench, item):
    with pytest.raises(SystemExit, match="NAME=V1,V2"):
        bench.sweep_grid([item])
