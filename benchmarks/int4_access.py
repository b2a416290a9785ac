"""How fast HBM serves the int4 GEMV's access pattern: bandwidth of streaming expert weights
with no arithmetic, in the decode kernel's order and in others, on one GPU.

The dot-free int4 decode (kernels/int4_gemv.py) reads, per program and K step, R = 64 rows x
16 int32 words: 64 bytes from each of 64 rows 2 KB apart, the next 64 bytes of each a step
later. At 1 token it reaches ~35% of the bandwidth on an H100 and on an H200 alike, and fewer
instructions per step did not change that (moe_4bit_h100_a4b1ae6.json). This separates the
access pattern from the arithmetic: each program XORs its tiles (one instruction a word) and
stores one tile, over the w13 weights of 8 experts (8 x 4096 rows x 512 words, 64 MiB), a
different 8 of POOL experts each call so that L2 (50-60 MB) holds none of them.

Orders (R rows x BKW words a step, R * BKW = 1024 words = 4 KiB, 32 steps a program):
  rows R x BKW   row-major weights [rows, 512 words], the kernel's order at R = 64
  tiles 64 x 16  the same tiles, each stored contiguously (a load-time repack)
Then the prefill path's dequantisation (int4._dequant_into: 32 experts' w13, group 128, into
bf16), whose bytes are the codes and scales read plus the bf16 written.

    python benchmarks/int4_access.py [--json benchmarks/results/int4_access_<dev>_<commit>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import UTC, datetime

import torch
import triton
import triton.language as tl
from bench_common import git_commit

from glm53.kernels import int4

ROWS, WORDS, EXPERTS, POOL = 4096, 512, 8, 64  # w13 of D = 4096, I = 2048; experts a call
TILE_WORDS = 1024


@triton.jit
def stream_kernel(q, out, BN: tl.constexpr, BKW: tl.constexpr, WORDS: tl.constexpr,
                  TILED: tl.constexpr):
    """Program p XORs rows p*BN.. of q [rows, WORDS] int32, BKW words a step, into one tile it
    stores; TILED: q holds each program's steps as contiguous [BN, BKW] tiles instead."""
    p = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BN)[:, None]
    o_c = tl.arange(0, BKW)[None, :]
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    for t in range(WORDS // BKW):
        if TILED:
            ptr = q + (p * (WORDS // BKW) + t) * (BN * BKW) + o_r * BKW + o_c
        else:
            ptr = q + (p * BN + o_r) * WORDS + t * BKW + o_c
        acc ^= tl.load(ptr)
    tl.store(out + p * (BN * BKW) + o_r * BKW + o_c, acc)


def stream_ms(pool: torch.Tensor, bn: int, tiled: bool, reps: int) -> float:
    """Median ms of one call over 8 experts' rows, each call on the next 8 experts of pool."""
    per_call = EXPERTS * ROWS * WORDS
    calls = pool.numel() // per_call
    programs = EXPERTS * ROWS // bn
    out = torch.empty(programs * TILE_WORDS, dtype=torch.int32, device=pool.device)
    views = [pool[i * per_call:(i + 1) * per_call] for i in range(calls)]

    def run(i):
        stream_kernel[(programs,)](views[i % calls], out, BN=bn, BKW=TILE_WORDS // bn,
                                   WORDS=WORDS, TILED=tiled)

    for i in range(calls):  # compile, and touch every view once
        run(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            run(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def dequant_row(reps: int, peak: float) -> dict:
    """ms and bandwidth of int4._dequant_into over 32 w13 experts (D 4096, I 2048, group 128),
    each call on the next 32 of 64 (L2 holds none of them)."""
    n, per, dev = 64, 32, "cuda"
    q = torch.randint(0, 256, (n, 2 * 2048, 2048), dtype=torch.uint8, device=dev)
    scale = torch.rand(n, 2 * 2048, 32, device=dev).half()
    zero = -7.5 * scale
    out = torch.empty((per, 2 * 2048, 4096), dtype=torch.bfloat16, device=dev)
    id_sets = [torch.arange(i * per, (i + 1) * per, dtype=torch.int32, device=dev)
               for i in range(n // per)]
    for ids in id_sets:
        int4._dequant_into(q, scale, zero, 128, ids, out)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for ids in id_sets:
            int4._dequant_into(q, scale, zero, 128, ids, out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(id_sets))
    ms = statistics.median(times)
    nbytes = per * (q[0].numel() + 2 * scale[0].numel() * 2 + out[0].numel() * 2)
    return dict(order="dequant bf16", experts=per, bytes=nbytes, ms=ms,
                gb_s=nbytes / ms / 1e6, pct_peak=100 * nbytes / (ms * 1e-3) / peak)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="peak B/s for the %% column (default: 3.35e12 on an H100, 4.8e12 else)")
    ap.add_argument("--json")
    ap.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    peak = args.bandwidth or (3.35e12 if "H100" in name else 4.8e12)
    pool = torch.randint(-2**31, 2**31 - 1, (POOL * ROWS * WORDS,), dtype=torch.int32,
                         device="cuda")
    nbytes = EXPERTS * ROWS * WORDS * 4
    rows = []
    for label, bn, tiled in (("rows", 64, False), ("rows", 16, False), ("rows", 4, False),
                             ("tiles", 64, True)):
        ms = stream_ms(pool, bn, tiled, args.reps)
        rows.append(dict(order=label, rows_per_step=bn, words_per_step=TILE_WORDS // bn, ms=ms,
                         gb_s=nbytes / ms / 1e6, pct_peak=100 * nbytes / (ms * 1e-3) / peak))
        r = rows[-1]
        print(f"{label:5} {bn:3d} x {TILE_WORDS // bn:4d} words: {ms:.4f} ms  "
              f"{r['gb_s']:7.0f} GB/s  {r['pct_peak']:5.1f}% of {peak / 1e12:.2f} TB/s")
    rows.append(dequant_row(args.reps, peak))
    r = rows[-1]
    print(f"dequant {r['experts']} experts: {r['ms']:.3f} ms  {r['gb_s']:7.0f} GB/s  "
          f"{r['pct_peak']:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="int4_access", device=name, commit=args.commit or
                           git_commit(), date=datetime.now(UTC).isoformat(timespec="seconds"),
                           torch=torch.__version__, bytes_per_call=nbytes, peak_Bps=peak,
                           results=rows), f, indent=1)


if __name__ == "__main__":
    main()
