"""`glm53 bench latency` and `glm53 bench serve` on the tiny model, in this process: the
latency JSON (fields, sane values, acceptance per position with MTP), the serving load against
the real ingress + LLM server + engine on a loopback port (TTFT, ITL, tok/s, skipped cells,
the PNG plot), and how the load client counts tokens. The last test runs both commands as a
user would, against `glm53 serve` (slow: Ray Serve)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from glm53.deployments.bench_serve import RequestRecord, _count, summarize
from glm53.deployments.cli import main
from glm53.deployments.config import ServingConfig
from tests.deployments.local_ingress import local_ingress, served_over_http

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_latency_writes_a_record_with_sane_values(tiny_checkpoint: Path, tmp_path: Path,
                                                        capsys) -> None:
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_checkpoint), "--batch", "1,2",
                 "--context", "8,16", "--speculative", "none,mtp:2", "--output-len", "6",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "latency" and record["device"].startswith("cpu")
    assert record["date"] and "commit" in record and record["model"] == str(tiny_checkpoint)
    assert record["speculative"] == ["none", "mtp:2"] and record["synthetic_acceptance"] is None
    assert record["config"]["output_len"] == 6
    rows = record["results"]
    assert [(r["speculative"], r["context"], r["batch"]) for r in rows] == [
        (spec, context, batch) for spec in ("none", "mtp:2") for context in (8, 16)
        for batch in (1, 2)]
    for r in rows:
        assert r["prefill_ms"] > 0 and r["decode_steps"] >= 1
        assert 0 < r["step_ms_median"] <= r["step_ms_p90"]
        assert r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_per_user"])
        if r["speculative"] == "none":
            assert r["acceptance"] == "none" and r["accepted_per_position"] is None
            assert r["tokens_per_step"] == 1.0
        else:
            assert r["acceptance"] == "measured"
            assert len(r["accepted_per_position"]) == 2
            assert all(0.0 <= a <= 1.0 for a in r["accepted_per_position"])
            assert 1.0 <= r["mean_accepted_length"] <= 3.0
    table = capsys.readouterr().out
    assert "accepted by position" in table and "mtp:2" in table


def test_bench_latency_measures_the_overlapped_engine(tiny_checkpoint: Path,
                                                      tmp_path: Path) -> None:
    """--async-scheduling reaches the engine and the record; a step still yields one token per
    request (the step in flight at the end is drained, not timed)."""
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_checkpoint), "--batch", "2",
                 "--context", "8", "--speculative", "none", "--output-len", "6",
                 "--async-scheduling", "--no-warmup", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["async_scheduling"] is True
    (row,) = record["results"]
    assert row["tokens_per_step"] == 1.0 and row["decode_steps"] >= 1


def test_bench_latency_synthetic_acceptance_is_labelled(tiny_checkpoint: Path, tmp_path: Path,
                                                         capsys) -> None:
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_checkpoint), "--batch", "2",
                 "--context", "16", "--speculative", "mtp:2", "--output-len", "7",
                 "--synthetic-acceptance", "1,1", "--no-warmup", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["synthetic_acceptance"] == [1.0, 1.0]
    (row,) = record["results"]
    assert row["speculative"] == "mtp:2 synthetic" and row["acceptance"] == "synthetic 1,1"
    assert row["accepted_per_position"] == [1.0, 1.0] and row["tokens_per_step"] == 3.0
    captured = capsys.readouterr()
    assert "synthetic" in captured.out and "SYNTHETIC" in captured.err


@pytest.mark.parametrize(("args", "message"), [
    (["--output-len", "1"], "--output-len must be >= 2"),
    (["--synthetic-acceptance", "0.5,0.9", "--speculative", "mtp:2"], "must not increase"),
    (["--synthetic-acceptance", "0.5"], "needs a --speculative setting with drafts"),
    (["--speculative", "mtp:9"], "num_speculative_tokens must be in 0..8"),
])
def test_bench_latency_argument_errors(tiny_checkpoint: Path, args: list[str],
                                      message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "latency", "--model", str(tiny_checkpoint), "--batch", "1",
              "--context", "8", *args])


def test_bench_serve_against_the_real_server_in_process(tiny_checkpoint: Path, tmp_path: Path,
                                                        monkeypatch) -> None:
    config = ServingConfig(model=str(tiny_checkpoint), speculative="mtp:2", device="cpu",
                           max_num_seqs=4)
    app = local_ingress(monkeypatch, config=config, engine_factory=None)
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    with served_over_http(app) as url:
        status = main(["bench", "serve", "--url", url, "--concurrency", "1,3",
                       "--prompt-len", "16,48,8192", "--output-len", "6", "--requests", "3",
                       "--json", str(out), "--plot", str(plot)])
    assert status == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "serve" and record["model"] == config.model_name
    assert record["server"]["max_model_len"] == 4096  # the tiny model's context
    rows = {(r["prompt_len"], r["concurrency"]): r for r in record["results"]}
    assert set(rows) == {(p, c) for p in (16, 48, 8192) for c in (1, 3)}
    for (prompt_len, _), r in rows.items():
        if prompt_len == 8192:  # beyond the tiny model's context
            assert "max_model_len 4096" in r["skipped"]
            continue
        assert r["requests"] == 3 and r["failed"] == 0, r["errors"]
        assert r["output_tokens"] == 3 * 6
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p99"]
        assert r["itl_ms"]["p50"] > 0 and r["tpot_ms"]["mean"] > 0
        assert r["output_tok_s"] > 0 and r["tok_s_per_user"] > 0
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_a_chunk_of_several_tokens_counts_each_with_its_share_of_the_gap() -> None:
    record = RequestRecord(sent=0.0)
    _count(record, 1)
    first = record.first_token
    _count(record, 1)  # a chunk without a new token (usage repeated) changes nothing
    assert record.itl == [] and record.first_token == first
    time.sleep(0.03)
    _count(record, 4)  # three tokens in one chunk (accepted drafts)
    assert record.tokens == 4 and len(record.itl) == 3
    assert record.itl[0] == record.itl[2] == pytest.approx((record.last_token - first) / 3)


def test_summary_counts_failures_apart_from_the_timings() -> None:
    ok = RequestRecord(sent=0.0, first_token=0.1, last_token=0.5, finished=0.5, tokens=5,
                       itl=[0.1] * 4)
    failed = RequestRecord(sent=0.0, error="HTTP 503: busy")
    summary = summarize([ok, failed], duration_s=1.0)
    assert summary["requests"] == 2 and summary["failed"] == 1
    assert summary["errors"] == ["HTTP 503: busy"]
    assert summary["output_tokens"] == 5 and summary["output_tok_s"] == 5.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["tok_s_per_user"] == pytest.approx(10.0)


def test_bench_serve_reports_an_unreachable_server_in_one_line() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match="error: ConnectError"):
        main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1",
              "--prompt-len", "8", "--output-len", "2"])


@pytest.mark.slow
def test_both_commands_against_glm53_serve(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLM53_CACHE_DIR": str(tmp_path / "cache")}
    cli = [sys.executable, "-m", "glm53.deployments.cli"]
    model = ["--model", str(tiny_checkpoint)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # a file, not a pipe nobody reads while the server starts
        server = subprocess.Popen([*cli, "serve", *model, "--port", str(port),
                                   "--speculative", "none"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # while the server starts (its own engine and cache directory are not shared)
        latency = subprocess.run(
            [*cli, "bench", "latency", *model, "--batch", "1", "--context", "16",
             "--speculative", "mtp:2", "--output-len", "6", "--json",
             str(tmp_path / "latency.json")],
            env={**env, "GLM53_CACHE_DIR": str(tmp_path / "latency-cache")},
            capture_output=True, text=True, timeout=300)
        assert latency.returncode == 0, latency.stderr
        record = json.loads((tmp_path / "latency.json").read_text())
        assert record["results"][0]["decode_steps"] > 0
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert server.poll() is None, log.read_text()[-3000:]
        bench = subprocess.run(
            [*cli, "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--concurrency",
             "1,2", "--prompt-len", "32", "--output-len", "4", "--json",
             str(tmp_path / "serve.json"), "--plot", str(tmp_path / "serve.png")],
            env=env, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        rows = json.loads((tmp_path / "serve.json").read_text())["results"]
        assert [r["failed"] for r in rows] == [0, 0]
        assert all(r["ttft_ms"]["p50"] > 0 for r in rows)
        assert (tmp_path / "serve.png").read_bytes().startswith(PNG_MAGIC)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_bench_latency_adaptive_reports_the_chosen_draft_length_per_step(
        tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """A cost table that pays for drafts from 20% acceptance, and every draft accepted: the
    policy verifies both drafts in every timed step."""
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"results": [
        {"speculative": "none" if w == 0 else f"mtp:{w}", "batch": 1, "context": 16,
         "step_ms_median": 10.0 + 2.0 * w} for w in range(3)]}))
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_checkpoint), "--batch", "2",
                 "--context", "16", "--speculative", "mtp:2:auto", "--output-len", "12",
                 "--synthetic-acceptance", "1,1", "--draft-cost-table", str(table),
                 "--no-warmup", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["draft_cost_table"] == str(table)
    (row,) = record["results"]
    assert row["speculative"] == "mtp:2:auto synthetic"
    assert row["draft_length_steps"] == [0, 0, row["decode_steps"]]
    assert "steps by draft length" in capsys.readouterr().out
