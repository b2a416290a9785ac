"""The dense projections of a rank-0 decode step: cuBLAS (`kernels.ref.linear`) against the
Triton GEMV (`kernels.linear`) at 1-8 token rows, per weight shape and summed over the step.

The shapes and their counts are rank 0's under TP2/EP2/DCP2 (the release config, every
`Linear` of the model built on the meta device, MTP included), so `step_ms` is what one decode
step spends in dense projections. Each shape is timed over enough distinct copies of its
weight (>= 256 MB) that L2 holds none of them, captured in one CUDA graph per row.
`--sweep NAME=V1,V2` times the step sum at one token for every setting of the GEMV's
constants (module attributes of glm53.kernels.linear). `--smoke` runs the tiny shapes'
correctness only (CPU under TRITON_INTERPRET=1).

  python benchmarks/dense_gemv.py --tokens 1,2,4,8 --json dense_gemv_<dev>_<commit>.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
from datetime import UTC, datetime
from unittest import mock

import torch
from bench_common import git_commit
from moe_4bit import graph_call_ms
from rank0 import PLAN, emulation_config

from glm53.actors.layers.linear import Linear
from glm53.actors.loader import build_model
from glm53.actors.parallel import ParallelState
from glm53.kernels import linear, moe
from glm53.kernels.ref import linear as ref_linear

BW = 4.3e12  # B/s: the H200 copy bandwidth of benchmarks/kernels.py, as moe_4bit.py
L2_FREE_BYTES = 256 << 20
TOL = 1e-2  # bf16 output vs cuBLAS, relative (both sum in fp32, in other orders)
SWIGLU_LIMIT = 10.0


def rank0_shapes() -> dict[tuple[int, int, bool], int]:
    """(N, K, swiglu) of every dense projection weight of rank 0 -> how many a step reads;
    swiglu: an MLP's gate_up projection, which the model runs with its swiglu
    (`ops.linear_swiglu`). kv_b_proj is left out: decode reads it by the attention's
    absorbed einsums, not as a projection."""
    ps = ParallelState(PLAN, rank=0, emulated=True)
    model = build_model(emulation_config("int4"), with_mtp=True, dtype=torch.bfloat16,
                        device="meta", ps=ps)
    counts = collections.Counter((*m.weight.shape, name.endswith("gate_up_proj"))
                                 for name, m in model.named_modules() if isinstance(m, Linear)
                                 and not name.endswith("kv_b_proj"))
    return dict(sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]))


def ops_for(swiglu: bool) -> dict:
    """name -> op(x, w, out) of the two paths: cuBLAS (with `moe.swiglu` after it for a
    gate_up projection, as the model's fallback runs) and the GEMV."""
    if swiglu:
        return {"cublas": lambda x, w, o: moe.swiglu(*ref_linear.linear(x, w).chunk(2, -1),
                                                     SWIGLU_LIMIT),
                "gemv": lambda x, w, o: linear.linear_swiglu(x, w, SWIGLU_LIMIT)}
    return {"cublas": ref_linear.linear, "gemv": lambda x, w, o: linear.linear(x, w, o)}


def gemv_rows_up_to(tokens: int):
    """The GEMV taking up to `tokens` rows (the model takes one; past it linear.linear would
    run cuBLAS, and a comparison would measure cuBLAS against itself)."""
    return mock.patch.object(linear, "GEMV_MAX_TOKENS", max(tokens, linear.GEMV_MAX_TOKENS))


def l2_free_copies(n: int, k: int) -> int:
    """Weight copies of [n, k] bf16 that together outgrow L2 (2 to 64)."""
    return max(2, min(64, L2_FREE_BYTES // (2 * n * k)))


def time_shape(n, k, t, ops, replays, repeats, gen) -> dict[str, float]:
    """ms per call of each op over l2_free_copies(n, k) weights of [n, k] and one x [t, k]."""
    copies = l2_free_copies(n, k)
    ws = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
          for _ in range(copies)]
    x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
    outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    got = {}
    for name, op in ops.items():
        calls = [lambda w=w, o=o, op=op: op(x, w, o) for w, o in zip(ws, outs, strict=True)]
        got[name] = statistics.median(graph_call_ms(calls, replays, repeats))
    return got


def check(shapes, tokens, dev) -> float:
    """Largest relative error of the GEMV against the reference over shapes x tokens (the
    GEMV taking every token count given)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0
    with gemv_rows_up_to(max(tokens)):
        for (n, k, *_), t in itertools.product(shapes, tokens):
            worst = max(worst, _check_one(n, k, t, dev, gen))
    return worst


def _check_one(n, k, t, dev, gen) -> float:
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    w = torch.randn(n, k, device=dev, generator=gen).to(dtype)
    x = torch.randn(t, k, device=dev, generator=gen).to(dtype)
    ref = ref_linear.linear(x, w).double()
    err = float((linear.linear(x, w).double() - ref).norm() / ref.norm())
    if err > TOL:
        raise SystemExit(f"GEMV [{n}, {k}] at {t} rows: relative error {err:.3g} > {TOL}")
    return err


def sweep_step(shapes, grid, replays, repeats, gen) -> list[dict]:
    """The GEMV's step sum at one row under every setting of `grid` (constants of
    glm53.kernels.linear, restored after), fastest first."""
    names, sweep = list(grid), []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(names, values, strict=True))
        with mock.patch.multiple(linear, **setting):
            total = sum(count * time_shape(n, k, 1, {"gemv": ops_for(swiglu)["gemv"]}, replays,
                                           repeats, gen)["gemv"]
                        for (n, k, swiglu), count in shapes.items())
        sweep.append(dict(setting=setting, step_ms=total))
    return sorted(sweep, key=lambda r: r["step_ms"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2",
                    help="step sum at 1 token under these values of glm53.kernels.linear.NAME")
    ap.add_argument("--json")
    ap.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    grid = {}
    for item in args.sweep:
        name, _, values = item.partition("=")
        if not isinstance(getattr(linear, name, None), int) or not values:
            raise SystemExit(f"--sweep {item!r}: expected NAME=V1,V2 with NAME an int constant "
                             "of glm53.kernels.linear")
        grid[name] = [int(v) for v in values.split(",")]
    if args.smoke:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"smoke: worst relative error {check([(37, 72), (70, 264)], tokens, dev):.2e}")
        return
    shapes = rank0_shapes()
    err = check(list(shapes)[:3], tokens, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows, step = [], collections.defaultdict(float)
    with gemv_rows_up_to(max(tokens)):  # how far the GEMV would go
        for (n, k, swiglu), count in shapes.items():
            for t in tokens:
                ms = time_shape(n, k, t, ops_for(swiglu), args.replays, args.repeats, gen)
                nbytes = 2 * n * k + 2 * t * (n + k)
                row = dict(n=n, k=k, swiglu=swiglu, count=count, tokens=t,
                           copies=l2_free_copies(n, k),
                           tile=linear.gemv_tile(t, n, k, torch.device("cuda")))
                for name, v in ms.items():
                    row[f"{name}_ms"] = v
                    row[f"{name}_pct_bandwidth"] = 100 * nbytes / (v * 1e-3) / BW
                    step[(name, t)] += count * v
                rows.append(row)
                tag = "s" if swiglu else " "
                print(f"[{n:>6}, {k:>5}]{tag} x{count:<3} t={t}: "
                      f"cuBLAS {ms['cublas'] * 1e3:7.1f} us "
                      f"({row['cublas_pct_bandwidth']:4.0f}%)  GEMV {ms['gemv'] * 1e3:7.1f} us "
                      f"({row['gemv_pct_bandwidth']:4.0f}%)")
    sweep = sweep_step(shapes, grid, args.replays, args.repeats, gen) if grid else []
    for r in sweep[:8]:
        print(f"sweep 1 token: {r['step_ms']:.4f} ms {r['setting']}")
    step_ms = {f"{name}_{t}": v for (name, t), v in step.items()}
    print("dense projections per rank-0 step (ms):",
          {key: round(v, 4) for key, v in step_ms.items()})
    if args.json:
        out = dict(benchmark="dense_gemv", device=torch.cuda.get_device_name(),
                   commit=args.commit or git_commit(),
                   date=datetime.now(UTC).isoformat(timespec="seconds"), torch=torch.__version__,
                   bandwidth_ceiling_Bps=BW, check_rel_err=err,
                   constants={nm: getattr(linear, nm) for nm in dir(linear)
                              if nm.startswith("GEMV_")},
                   step_ms=step_ms, sweep=sweep, results=rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
