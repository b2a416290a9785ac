"""benchmarks/pair_estimate.py: the 2x H200 estimate from rank-0 rows, checked against numbers
worked out by hand (no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import pair_estimate

    return pair_estimate


def test_hot_rank_factor(bench):
    # batch 1: 8 pairs over 2 ranks; E[max(X, 8 - X)] = 1304 / 256 = 5.09 experts, not 4
    assert bench.hot_rank_factor(1) == pytest.approx(1304 / 256 / 4, rel=1e-12)
    # more pairs even out: the factor falls toward 1
    assert 1 < bench.hot_rank_factor(64) < bench.hot_rank_factor(16) < bench.hot_rank_factor(1)


ROW = dict(phase="decode", batch=1, context=8192, kv_cache_dtype="bf16", graph_ms=9.0,
           engine_step_overlapped_ms=10.0, experts_gb=2.0, total_gb=8.0, mtp3_cycle_ms=20.0,
           mtp3_cycle_split=dict(verify_sample_ms=16.0), mtp3_tokens_per_cycle_assumed=[2.6, 2.8])


def test_estimate_row_by_hand(bench):
    out = bench.estimate_row(ROW)
    factor = 1304 / 256 / 4
    imbalance = 10.0 * 0.25 * (factor - 1)  # the experts' quarter of the step, 1.27x longer
    assert out["imbalance_ms"] == pytest.approx(imbalance)
    # 102 collectives at 4 and 9 us
    assert out["pair_step_ms"] == pytest.approx([10.0 + 0.408 + imbalance,
                                                 10.0 + 0.918 + imbalance])
    assert out["tok_s_per_user"] == pytest.approx([1e3 / (10.918 + imbalance),
                                                   1e3 / (10.408 + imbalance)])
    mtp = out["mtp3"]
    # verify (102) + 3 draft passes (4 each) = 114 collectives; the verify's experts see 4 tokens
    mtp_imbalance = 16.0 * 0.25 * (bench.hot_rank_factor(4) - 1)
    assert mtp["pair_cycle_ms"] == pytest.approx([20.0 + 0.456 + mtp_imbalance,
                                                  20.0 + 1.026 + mtp_imbalance])
    assert mtp["tok_s_per_user"] == pytest.approx([2600 / (21.026 + mtp_imbalance),
                                                   2800 / (20.456 + mtp_imbalance)])


def test_cli_refuses_a_partial_depth_run_and_labels_the_estimate(tmp_path):
    source = tmp_path / "rank0.json"
    out = tmp_path / "estimate.json"
    source.write_text(json.dumps(dict(layers=24, results=[ROW])))
    run = [sys.executable, "benchmarks/pair_estimate.py", str(source), "--json", str(out)]
    refused = subprocess.run(run, capture_output=True, text=True)
    assert refused.returncode != 0 and "45" in refused.stderr and not out.exists()
    source.write_text(json.dumps(dict(layers=45, device="NVIDIA H200", commit="abc",
                                      results=[ROW, dict(ROW, graph_ms=None)])))
    subprocess.run(run, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["estimate"] is True and "ESTIMATE" in result["note"]
    assert [r["batch"] for r in result["rows"]] == [1]  # the failed case is left out
