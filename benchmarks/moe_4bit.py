"""Routed experts of one MoE layer on one GPU: bf16 grouped GEMM vs EXL3 K4 vs INT4.

Real shapes: D = 4096, moe intermediate 2048, 288 experts, top-8 (--ep2: the 144 experts of EP
rank 0, routing still over 288 so about half the pairs are another rank's). Tokens 1, 8, 64,
512 with uniform random routing (8 distinct experts per token). Formats:
  bf16  glm53.kernels.moe.fused_moe (torch._grouped_mm)
  exl3  glm53.kernels.exl3.moe_exl3, K = 4, codebook 1 (MCG): random int16 trellis codes,
        suh = +-1 and svh = +-0.02 (weights ~0.02 like the bf16 ones)
  int4  glm53.kernels.int4.moe_int4, group 128
  int4t the same codes in int4_gemv.tile_words' layout, on the unsorted-pairs path at every
        token count (int4_gemv.moe_decode_pairs(tiled=True))
Each call is first checked against its format's reference on the first tokens (abort above
TOL). It is then captured in a CUDA graph together with ROUTINGS - 1 more calls on other
routings (so replays do not find the previous call's experts in L2), the graph is replayed
--replays times between CUDA events, and ms per call is the median over --repeats such runs.
Bytes read per call: distinct local experts touched x the format's bytes per expert, plus the
bf16 activations in and out; % of 4.3 TB/s (the H200 copy bandwidth of benchmarks/kernels.py).

With --profile, each (format, tokens) row also gets the device time per kernel of one eager
call (torch.profiler); --int4-sweep times int4 at each token count under every setting of
INT4_SWEEP (the dot-free variant's tiles, warps, K splits and the unsorted-pairs bound), the
defaults row included, so kernels/int4_gemv.py's constants are chosen on measurements;
--sweep NAME=V1,V2 (repeatable) replaces NAME's values in it, e.g. to sweep a few only, or adds
an int constant of kernels/int4.py (the tl.dot variant's DOT_BM_MAX, DOT_TILE).

    python benchmarks/moe_4bit.py [--ep2] [--json benchmarks/results/moe_4bit_h200_<commit>.json]
    TRITON_INTERPRET=1 python benchmarks/moe_4bit.py --smoke   # CPU: tiny shapes, no timing
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from datetime import UTC, datetime

import torch
from bench_common import git_commit, kernel_profile

from glm53.kernels import int4, int4_gemv, moe
from glm53.kernels.ref import int4 as ref_int4
from glm53.kernels.ref import moe as ref_moe

BW = 4.3e12  # B/s
TOL = 2e-2  # relative error vs the format's fp32 reference (fp16/bf16 operands)
ROUTINGS = 4
CHECK_TOKENS = 8  # rows checked against the reference (the op is row-independent)
LIMIT, TOP_K, GROUP = 10.0, 8, 128


def _exl3():
    """(kernel module, reference module) of EXL3, or None when kernels/exl3.py is missing."""
    try:
        return (importlib.import_module("glm53.kernels.exl3"),
                importlib.import_module("glm53.kernels.ref.exl3"))
    except ImportError:
        return None


def _rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _bf16(n_local, d, inter, rnd, dtype, n_experts):
    w13 = (torch.randn(n_local, 2 * inter, d, **rnd) * 0.02).to(dtype)
    w2 = (torch.randn(n_local, d, inter, **rnd) * 0.02).to(dtype)
    return (lambda x, wts, ids, off: moe.fused_moe(x, w13, w2, wts, ids, LIMIT, off),
            lambda x, wts, ids, off: ref_moe.fused_moe(x.float(), w13.float(), w2.float(), wts,
                                                       ids, LIMIT, off),
            3 * d * inter * dtype.itemsize)


def _int4(n_local, d, inter, rnd, dtype, n_experts):
    def linear(n, kin):
        q = torch.randint(0, 256, (n_local, n, kin // 2), dtype=torch.uint8, **rnd)
        scale = (torch.rand(n_local, n, kin // min(GROUP, kin), **rnd) * 1e-3 + 2e-3).half()
        return q, scale, (-7.5 * scale.float()).half()
    w = (*linear(2 * inter, d), *linear(d, inter))

    def op(x, wts, ids, off):
        # the launch is sized for this rank's share of the pairs (EP2: half of them)
        return int4.moe_int4(x, *w, wts, ids, LIMIT, off, GROUP, n_experts)

    op.weights = w
    return (op, lambda x, wts, ids, off: ref_int4.moe_int4(x, *w, wts, ids, LIMIT, off, GROUP),
            sum(t.nbytes for t in w) // n_local)


def _exl3_format(n_local, d, inter, rnd, dtype, n_experts):
    mods = _exl3()
    if mods is None:
        raise SystemExit("exl3 requested but glm53.kernels.exl3 (or its reference) cannot be "
                         "imported; pass --formats bf16,int4 to leave it out")
    kernel, ref = mods
    bits = 4

    def signs(*shape):
        return (torch.randint(0, 2, shape, **rnd) * 2 - 1).half()
    w = (torch.randint(-2 ** 15, 2 ** 15, (n_local, d // 16, 2 * inter // 16, 16 * bits),
                       dtype=torch.int16, **rnd),
         signs(n_local, 2, d), signs(n_local, 2 * inter) * 0.02,
         torch.randint(-2 ** 15, 2 ** 15, (n_local, inter // 16, d // 16, 16 * bits),
                       dtype=torch.int16, **rnd),
         signs(n_local, inter), signs(n_local, d) * 0.02)
    return (lambda x, wts, ids, off: kernel.moe_exl3(x, *w, wts, ids, LIMIT, off, 1),
            lambda x, wts, ids, off: ref.moe_exl3(x, *w, wts, ids, LIMIT, off, 1),
            sum(t.nbytes for t in w) // n_local)


def _int4_tiled(n_local, d, inter, rnd, dtype, n_experts):
    """int4 with its codes in int4_gemv.tile_words' layout, run on the unsorted-pairs path at
    every token count (the layout only the dot-free kernels read so far)."""
    op, ref, nbytes = _int4(n_local, d, inter, rnd, dtype, n_experts)
    q13, s13, z13, q2, s2, z2 = op.weights
    w13, w2 = (int4_gemv.tile_words(q13), s13, z13), (int4_gemv.tile_words(q2), s2, z2)
    return (lambda x, wts, ids, off: int4_gemv.moe_decode_pairs(
                x, w13, w2, GROUP, GROUP, ids, wts, off, LIMIT, n_experts, tiled=True),
            ref, nbytes)


FORMATS = {"bf16": _bf16, "exl3": _exl3_format, "int4": _int4, "int4t": _int4_tiled}
# kernels/int4_gemv.py constants swept by --int4-sweep: each entry is one setting (the product
# of these lists, on top of the module's defaults); one token runs GEMV_WARPS_1 and
# GEMV_AHEAD_1 instead of GEMV_WARPS and GEMV_AHEAD (--sweep them by name)
INT4_SWEEP = {"GEMV_BN13": [32, 64, 128], "GEMV_BN2": [64, 128, 256], "GEMV_WARPS": [4, 8],
              "GEMV_PROGRAMS_PER_SM": [4, 8], "GEMV_AHEAD": [1, 2]}


def constant_owner(name: str):
    """The kernels module (int4_gemv, else int4) holding the constant NAME, an int or None
    (GEMV_W2_SPLIT: chosen by the kernel), or None."""
    return next((m for m in (int4_gemv, int4) if hasattr(m, name)
                 and (getattr(m, name) is None or isinstance(getattr(m, name), int))), None)


def sweep_grid(overrides: list[str]) -> dict[str, list[int]]:
    """INT4_SWEEP with each `NAME=V1,V2` of `overrides` replacing (or adding) NAME's values;
    NAME must be an int constant of int4_gemv or int4 (e.g. int4.DOT_BM_MAX)."""
    grid = dict(INT4_SWEEP)
    for item in overrides:
        name, _, values = item.partition("=")
        if constant_owner(name) is None or not values:
            raise SystemExit(f"--sweep {item!r}: expected NAME=V1,V2 with NAME an int constant "
                             f"of glm53.kernels.int4_gemv or glm53.kernels.int4")
        grid[name] = [int(v) for v in values.split(",")]
    return grid


def int4_sweep(op, routes, replays: int, repeats: int, grid: dict[str, list[int]]) -> list[dict]:
    """ms of int4's op on `routes` under every setting of `grid` (module constants set for
    the run, restored after)."""
    import itertools

    names = list(grid)
    owners = {n: constant_owner(n) for n in names}
    saved = {n: getattr(owners[n], n) for n in names}
    rows = []
    try:
        for values in itertools.product(*grid.values()):
            setting = dict(zip(names, values, strict=True))
            for n, v in setting.items():
                setattr(owners[n], n, v)
            calls = [lambda r=r: op(*r, 0) for r in routes]
            ms = statistics.median(graph_call_ms(calls, replays, repeats))
            rows.append(dict(setting=setting, ms=ms))
    finally:
        for n, v in saved.items():
            setattr(owners[n], n, v)
    return sorted(rows, key=lambda r: r["ms"])


def graph_call_ms(calls, replays: int, repeats: int) -> list[float]:
    """ms per call of `calls` (closures) captured in one CUDA graph: for each of `repeats`
    runs, the graph is replayed `replays` times between two CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays / len(calls))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep2", action="store_true", help="144 local experts of EP rank 0")
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--formats", default="bf16,exl3,int4")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    ap.add_argument("--profile", action="store_true", help="device time per kernel per row")
    ap.add_argument("--int4-sweep", action="store_true", help="int4 under every INT4_SWEEP")
    ap.add_argument("--sweep-tokens", default="1,8,16", help="token counts --int4-sweep runs")
    ap.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2",
                    help="--int4-sweep over these values of NAME instead (repeatable)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, correctness only (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    grid = sweep_grid(args.sweep)
    names = args.formats.split(",")
    if args.smoke:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        n_exp, d, inter, tokens = 12, 256, 128, (1, 5)  # EXL3: multiples of 128
        if "exl3" in names and _exl3() is None:
            print("smoke: glm53.kernels.exl3 is not importable yet; exl3 skipped")
            names.remove("exl3")
    else:
        dev = "cuda"
        n_exp, d, inter = 288, 4096, 2048
        tokens = tuple(int(t) for t in args.tokens.split(","))
    n_local = n_exp // 2 if args.ep2 else n_exp
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = dict(generator=gen, device=dev)
    # name -> (op(x, wts, ids, offset), its reference, bytes per expert); n_exp: all ranks'
    # experts (int4 sizes its decode launch by this rank's share of the pairs)
    formats = {name: FORMATS[name](n_local, d, inter, rnd, dtype, n_exp) for name in names}
    timed = dev == "cuda" and not args.smoke
    rows = []
    for t in tokens:
        routes = []
        for _ in range(ROUTINGS):
            x = torch.randn(t, d, generator=gen, device=dev).to(dtype)
            ids = torch.rand(t, n_exp, generator=gen, device=dev).argsort(1)[:, :TOP_K]
            wts = torch.rand(t, TOP_K, generator=gen, device=dev)
            routes.append((x, wts, ids))
        hit = statistics.mean(ids[ids < n_local].unique().numel() for _, _, ids in routes)
        for name, (op, ref, expert_bytes) in formats.items():
            x, wts, ids = routes[0]
            c = min(t, CHECK_TOKENS)
            err = _rel_err(op(x, wts, ids, 0)[:c].float(), ref(x[:c], wts[:c], ids[:c], 0).float())
            if err > TOL:
                raise SystemExit(f"{name} at {t} tokens: relative error {err:.3g} vs its "
                                 f"reference exceeds {TOL}")
            nbytes = hit * expert_bytes + 2 * t * d * 2
            row = dict(format=name, tokens=t, experts_touched=hit, gb_read=nbytes / 1e9,
                       rel_err=err)
            if timed:
                calls = [lambda r=r, op=op: op(*r, 0) for r in routes]
                times = graph_call_ms(calls, args.replays, args.repeats)
                ms = statistics.median(times)
                row.update(ms=ms, ms_min=min(times), pct_bandwidth=100 * nbytes / (ms * 1e-3) / BW)
                if args.profile:
                    row["profile"] = kernel_profile(lambda op=op, r=routes[0]: op(*r, 0))
                if args.int4_sweep and name == "int4" and str(t) in args.sweep_tokens.split(","):
                    row["sweep"] = int4_sweep(op, routes, args.replays, args.repeats, grid)
                    best = row["sweep"][0]
                    print(f"int4 {t} tokens: best {best['ms']:.4f} ms {best['setting']}, "
                          f"defaults {ms:.4f} ms")
            rows.append(row)
    by = {(r["format"], r["tokens"]): r.get("ms") for r in rows}
    speedups = {f"speedup_{key}_vs_bf16": {t: by[("bf16", t)] / by[(fmt, t)] for t in tokens}
                for key, fmt in (("4bit", "exl3"), ("int4", "int4"), ("int4_tiled", "int4t"))
                if timed and "bf16" in formats and fmt in formats}
    print(f"{'format':<6} {'tokens':>6} {'experts':>7} {'GB':>7} {'ms':>8} {'%bw':>6} {'err':>8}")
    for r in rows:
        ms, pct = r.get("ms"), r.get("pct_bandwidth")
        print(f"{r['format']:<6} {r['tokens']:>6} {r['experts_touched']:>7.1f} "
              f"{r['gb_read']:>7.3f} {'-' if ms is None else f'{ms:.4f}':>8} "
              f"{'-' if pct is None else f'{pct:.1f}':>6} {r['rel_err']:>8.2e}")
    for key, vals in speedups.items():
        print(key, {t: round(v, 2) for t, v in vals.items()})
    if args.json:
        out = dict(benchmark="moe_4bit", device=torch.cuda.get_device_name() if dev == "cuda"
                   else "cpu", commit=args.commit or git_commit(),
                   date=datetime.now(UTC).isoformat(timespec="seconds"), torch=torch.__version__,
                   ep2=args.ep2, local_experts=n_local, hidden=d, moe_intermediate=inter,
                   top_k=TOP_K, bandwidth_ceiling_Bps=BW, smoke=args.smoke, results=rows,
                   **speedups)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
