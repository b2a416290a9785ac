"""`glm53 bench latency` (the engine in this process) and `glm53 bench serve` (a running server
under load): their flags, runs, tables and JSON records; `glm53 bench needle` lives in
bench_needle.py."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from .bench_needle import add_needle_parser, bench_needle
from .bench_report import plot_serve, record_header, table
from .config import CPU_CACHE_BYTES
from .engine_args import QUANTIZE_HELP, parse_bytes, parse_speculative


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1: {text!r}")
    return values


def _probabilities(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated floats: {text!r}") from exc


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark the engine (latency, needle) or a server "
                                         "(serve)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    lat = kinds.add_parser(
        "latency", help="engine step time, tok/s and acceptance, in this process",
        description="For each speculative setting, one engine in this process runs every "
                    "BATCH x CONTEXT case: BATCH requests of CONTEXT random tokens arrive "
                    "together and generate --output-len tokens (greedy, eos ignored). Reports "
                    "prefill time, the median decode step (the whole engine step), tok/s per "
                    "user and in total, and per draft position the fraction of drafts accepted.")
    lat.add_argument("--model", type=Path, default=None,
                     help="checkpoint directory (default: the embedded tiny model; "
                          "`glm53 make-tiny` writes random ones)")
    lat.add_argument("--batch", type=_ints, default=[1, 8], metavar="B[,B...]")
    lat.add_argument("--context", type=_ints, default=[128, 1024], metavar="N[,N...]",
                     help="prompt tokens of each request")
    lat.add_argument("--speculative", type=lambda t: [parse_speculative(x) for x in
                                                      t.split(",")],
                     default=[parse_speculative("none")],
                     metavar="none|mtp[:K][:auto]|dflash:PATH[:K][:auto][,...]",
                     help="':auto': adaptive draft length, up to K drafts a step (its choices "
                          "are reported per step)")
    lat.add_argument("--draft-cost-table", type=Path, default=None, metavar="JSON",
                     help="step times of adaptive settings: an earlier `glm53 bench latency "
                          "--json` record with none and mtp:K rows (default: the documented "
                          "estimate, see raycluster/draft_policy.py)")
    lat.add_argument("--output-len", type=int, default=64)
    lat.add_argument("--synthetic-acceptance", type=_probabilities, default=None,
                     metavar="P1[,P2...]",
                     help="measure the speculative mechanism, not the model: draft position j "
                          "is accepted with probability Pj (not increasing; later positions "
                          "never), whatever the drafts are; results are labelled synthetic")
    lat.add_argument("--json", type=Path, default=None, help="write the results here")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--no-warmup", dest="warmup", action="store_false",
                     help="skip the untimed case each engine runs first")
    eng = lat.add_argument_group("engine limits")
    eng.add_argument("--device", default="cpu")
    eng.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    eng.add_argument("--max-num-batched-tokens", type=int, default=8192)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=16)
    size = eng.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None)
    size.add_argument("--cache-bytes", type=parse_bytes, default=None)
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--quantize-experts", choices=["int4"], default=None, help=QUANTIZE_HELP)
    eng.add_argument("--enforce-eager", action="store_true")
    eng.add_argument("--async-scheduling", action="store_true",
                     help="schedule step N+1 while step N runs (overlapped host work)")

    srv = kinds.add_parser(
        "serve", help="TTFT, inter-token latency and tok/s of a running server",
        description="Streams completions of exact-length random token prompts to an "
                    "OpenAI-compatible server (`glm53 serve`, or vLLM) at each concurrency "
                    "level and prompt length; see README Benchmarking.")
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    srv.add_argument("--model", default=None, help="served model name (default: the first)")
    srv.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64], metavar="C[,C...]")
    srv.add_argument("--prompt-len", type=_ints, default=[1024, 8192, 32768, 131072],
                     metavar="N[,N...]", help="prompt tokens (cells beyond the server's "
                                              "max_model_len are skipped)")
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--requests", type=int, default=None,
                     help="requests per cell (default: twice the concurrency, at least 4)")
    srv.add_argument("--api-key", default=None, help="bearer key (default: $GLM53_API_KEY)")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--json", type=Path, default=None, help="write the results here")
    srv.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    add_needle_parser(kinds, _ints)


def run_bench(args: argparse.Namespace) -> int:
    runs = {"latency": bench_latency, "serve": bench_serve, "needle": bench_needle}
    return runs[args.bench](args)


def _spec_name(spec, synthetic: bool = False) -> str:
    method, k, path, adaptive = spec
    name = "none" if method is None else f"{method}:{path}:{k}" if path else f"{method}:{k}"
    name += ":auto" if adaptive else ""
    return f"{name} synthetic" if synthetic and method is not None else name


LATENCY_COLUMNS = [("spec", "speculative"), ("batch", "batch"), ("context", "context"),
                   ("prefill ms", "prefill_ms"), ("step ms", "step_ms_median"),
                   ("p90 ms", "step_ms_p90"), ("tok/s/user", "tok_s_per_user"),
                   ("tok/s", "tok_s_total"), ("drafts", "mean_draft_length"),
                   ("accept len", "mean_accepted_length"),
                   ("accepted by position", "accepted_per_position"),
                   ("steps by draft length", "draft_length_steps")]


def bench_latency(args: argparse.Namespace) -> int:
    from glm53.raycluster.api import (
        CheckpointError,
        EngineConfig,
        LatencyCase,
        LatencyRunner,
        RequestRejectedError,
        UnsupportedConfigError,
        describe_device,
    )

    from .tiny_model import embedded_tiny_model

    if args.output_len < 2:
        raise SystemExit("error: --output-len must be >= 2 (a decode step to time)")
    model_dir = args.model or embedded_tiny_model()
    cache_bytes = args.cache_bytes
    if cache_bytes is None and args.num_blocks is None and not args.device.startswith("cuda"):
        cache_bytes = CPU_CACHE_BYTES
    synthetic = args.synthetic_acceptance is not None
    if synthetic and all(spec.method is None for spec in args.speculative):
        raise SystemExit("error: --synthetic-acceptance needs a --speculative setting with "
                         "drafts (mtp:K or dflash:PATH:K)")
    if synthetic:
        print(f"SYNTHETIC acceptance {args.synthetic_acceptance}: drafts are accepted by "
              "chance, not by the model; these numbers measure the speculative mechanism "
              "only", file=sys.stderr, flush=True)
    rows = []
    for spec in args.speculative:
        method, k, draft, adaptive = spec
        try:
            config = EngineConfig(
                model=str(model_dir), dtype=args.dtype, device=args.device,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=max(args.batch), max_model_len=args.max_model_len,
                # a case's decode steps run at its batch or below: graphs for those only
                # (capture time is most of an engine's start on a large model)
                cuda_graph_batch_sizes=tuple(sorted(set(args.batch))),
                block_size=args.block_size, num_blocks=args.num_blocks, cache_bytes=cache_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                quantize_experts=args.quantize_experts, speculative_method=method,
                num_speculative_tokens=k, draft_model=draft, enforce_eager=args.enforce_eager,
                adaptive_drafts=adaptive, draft_cost_table=(
                    str(args.draft_cost_table) if adaptive and args.draft_cost_table else None),
                async_scheduling=args.async_scheduling, seed=args.seed,
                # the cases' random prompts share nothing, and its checkpoint positions
                # would cut the prefill chunks that the cases time
                enable_prefix_caching=False)
            runner = LatencyRunner(config, seed=args.seed, synthetic_acceptance=(
                args.synthetic_acceptance if method is not None else None))
        except (FileNotFoundError, CheckpointError, UnsupportedConfigError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from exc
        try:
            if args.warmup:
                runner.warm_up(max(args.batch), min(args.context))
            for context in args.context:
                for batch in args.batch:
                    result = runner.measure(LatencyCase(batch, context, args.output_len))
                    row = {"speculative": _spec_name(spec, synthetic),
                           **dataclasses.asdict(result)}
                    rows.append(row)
                    print(table([row], LATENCY_COLUMNS).splitlines()[-1], file=sys.stderr,
                          flush=True)
        except (RequestRejectedError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from exc
        finally:
            runner.shutdown()
    print(table(rows, LATENCY_COLUMNS))
    if synthetic:
        print("(synthetic acceptance: not the model's)")
    if args.json:
        record = record_header(
            "latency", device=describe_device(args.device), model=str(model_dir),
            config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k not in ("command", "bench", "json", "speculative", "model",
                                 "synthetic_acceptance")},
            speculative=[_spec_name(s, synthetic) for s in args.speculative],
            synthetic_acceptance=args.synthetic_acceptance, results=rows)
        args.json.write_text(json.dumps(record, indent=2))
    return 0


SERVE_COLUMNS = [("prompt", "prompt_len"), ("conc", "concurrency"), ("reqs", "requests"),
                 ("failed", "failed"), ("TTFT p50 ms", "ttft_p50"), ("TTFT p99", "ttft_p99"),
                 ("ITL p50 ms", "itl_p50"), ("ITL p99", "itl_p99"), ("TPOT p50", "tpot_p50"),
                 ("tok/s", "output_tok_s"), ("tok/s/user", "tok_s_per_user"),
                 ("skipped", "skipped")]


def _flat(row: dict) -> dict:
    out = dict(row)
    for key in ("ttft", "itl", "tpot"):
        stats = row.get(f"{key}_ms") or {}
        out[f"{key}_p50"], out[f"{key}_p99"] = stats.get("p50"), stats.get("p99")
    return out


def bench_serve(args: argparse.Namespace) -> int:
    import os

    from .bench_serve import bench_serve as run

    if args.output_len < 2:
        raise SystemExit("error: --output-len must be >= 2 (an inter-token latency to time)")
    for module in ("httpx", *(("matplotlib",) if args.plot else ())):
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"error: glm53 bench serve needs {module}: "
                             "pip install 'glm53[bench]'")
    api_key = args.api_key or os.environ.get("GLM53_API_KEY")

    def progress(row: dict) -> None:
        print(table([_flat(row)], SERVE_COLUMNS).splitlines()[-1], file=sys.stderr, flush=True)

    try:
        result = asyncio.run(run(args.url, args.concurrency, args.prompt_len, args.output_len,
                                 args.requests, args.model, api_key, args.seed, progress))
    except Exception as exc:  # noqa: BLE001 - unreachable server, HTTP errors: one clean line
        raise SystemExit(f"error: {type(exc).__name__}: {exc}") from exc
    record = record_header("serve", url=args.url, output_len=args.output_len,
                           concurrency=args.concurrency, prompt_len=args.prompt_len,
                           requests_per_level=args.requests, seed=args.seed, **result)
    print(table([_flat(r) for r in record["results"]], SERVE_COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    if args.plot:
        plot_serve(record, args.plot)
    return 1 if any(r.get("failed") for r in record["results"]) else 0
