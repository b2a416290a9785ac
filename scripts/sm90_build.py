"""Build every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

Each op's own wrapper is called on CPU tensors of the model's real shapes with the launch
replaced by a compile (Triton's warmup path, against a stand-in driver that reports an sm_90
target), so the configurations are exactly the ones a GPU run would launch. Per kernel build
it prints registers, spilled bytes (local memory), shared memory, and whether the tensor-core
loops use wgmma. It fails on a kernel that does not compile (the interpreter accepts things
the compiler rejects: a constexpr reassigned in a loop, one variable typed differently in the
two branches of an `if`) and, with --no-spills, on a kernel that spills.

    python scripts/sm90_build.py [--json FILE] [--no-spills]

Run it with TRITON_INTERPRET unset (the interpreter replaces the compiler). It leans on Triton
3.6 internals (JITFunction.run's warmup path, the driver registry's `_active` slot), which is
the version the project pins for the interpreter and the GPU image has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


class _Sm90Driver:
    """What JITFunction asks the active driver for while binding and compiling."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass(frozen=True)
class Build:
    case: str
    kernel: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    wgmma: int


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}


class _Recorder:
    """JITFunction.run replaced by a compile-only run that records each build."""

    def __init__(self) -> None:
        self.case = ""
        self.builds: list[Build] = []
        self._run = JITFunction.run
        self._driver = None

    def __enter__(self) -> _Recorder:
        recorder = self

        def compile_only(fn, *args, grid, warmup, **kwargs):
            kernel = recorder._run(fn, *args, grid=grid, warmup=True, **kwargs)
            res = _resources(kernel.asm["cubin"])
            recorder.builds.append(Build(
                recorder.case, fn.fn.__name__, res.get("REG", 0),
                max(res.get("LOCAL", 0), res.get("STACK", 0)), kernel.metadata.shared,
                kernel.metadata.num_warps, kernel.asm["ptx"].count("wgmma.mma_async")))
            return kernel

        self._driver = driver._active  # None here: no default driver exists without a GPU
        driver.set_active(_Sm90Driver())
        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc) -> None:
        JITFunction.run = self._run
        driver._active = self._driver


def _cases() -> dict[str, Callable[[], object]]:
    """One call per op and regime (decode, verify, prefill) at the model's real widths."""
    from glm53.kernels import exl3, int4, kda, kda_mixer, mhc, moe, norm, sparse_mla

    bf, f32, i64 = torch.bfloat16, torch.float32, torch.long

    def z(*shape, dtype=bf):
        return torch.zeros(shape, dtype=dtype)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])

    heads, dk, latent, budget, kpool = 64, 128, 512, 512, 4

    def kda_call(lens, defer=False):
        t, n = sum(lens), len(lens)
        q, k, v = (z(t, heads, dk) for _ in range(3))
        return lambda: kda.kda_attention(q, k, v, z(t, heads, dk, dtype=f32),
                                         z(t, heads, dtype=f32), z(n, heads, dk, dk, dtype=f32),
                                         cu(lens), torch.arange(n), torch.ones(n, dtype=bool),
                                         torch.ones(n, dtype=bool) if defer else None,
                                         gate_lower_bound=-5.0)

    def mixer_call(lens):
        t, n, chans = sum(lens), len(lens), 3 * heads * dk
        return lambda: kda_mixer.kda_mixer(
            z(t, chans), z(chans, 4, dtype=f32), z(n, chans, 3), z(t, heads * dk),
            z(heads * dk, dtype=f32), z(heads, dtype=f32), -5.0, z(t, heads), z(t, heads, dk),
            z(dk), 1e-5, z(n, heads, dk, dk, dtype=f32), cu(lens), torch.arange(n),
            torch.ones(n, dtype=bool))

    def commit_call(lens):
        t, n, chans = sum(lens), len(lens), 3 * heads * dk
        q, k, v = (z(t, heads, dk) for _ in range(3))
        accepted = torch.ones(n, dtype=i64)

        def call():
            kda.kda_commit(q, k, v, z(t, heads, dk, dtype=f32), z(t, heads, dtype=f32),
                           z(n, heads, dk, dk, dtype=f32), cu(lens), torch.arange(n),
                           torch.ones(n, dtype=bool), accepted)
            kda.conv_commit(z(t, chans), z(n, chans, 3), cu(lens), torch.arange(n),
                            torch.ones(n, dtype=bool), accepted)
        return call

    def conv_call(lens):
        t, n, chans = sum(lens), len(lens), 3 * heads * dk
        return lambda: kda.causal_conv1d(z(t, chans), z(chans, 4, dtype=f32), z(n, chans, 3),
                                         cu(lens), torch.arange(n), torch.ones(n, dtype=bool),
                                         planes=3)

    def with_constants(call, **constants):
        """call() with module constants of kernels/sparse_mla.py overridden (if any)."""
        if not constants:
            return call

        def run():
            with mock.patch.multiple(sparse_mla, **constants):
                call()
        return run

    def topk_call(batch, ctx, **constants):
        blocks = ctx // 64
        table = torch.arange(batch * blocks).view(batch, blocks)
        return with_constants(lambda: sparse_mla.indexer_topk(
            z(batch, 32, 128), z(batch, 32, dtype=f32), z(batch * blocks, 64 // kpool, 128), table,
            torch.arange(batch), torch.full((batch,), ctx - 1), budget, kpool), **constants)

    def attention_call(queries, width, dcp=1, **constants):
        table = torch.arange(64).view(1, 64)
        return with_constants(lambda: sparse_mla.sparse_mla_attention(
            z(queries, heads, latent), z(64, 64 // dcp, latent), table,
            torch.zeros(queries, dtype=i64), z(queries, width, dtype=i64), 1 / 16, dcp - 1, dcp),
            **constants)

    def moe_call(tokens):
        e, d, inter = 288, 4096, 2048
        ids = torch.arange(tokens * 8).view(tokens, 8) % e
        return lambda: moe.fused_moe(z(tokens, d), z(e, 2 * inter, d), z(e, d, inter),
                                     z(tokens, 8, dtype=f32), ids, 10.0)

    def exl3_call(tokens, decode, e=8, bits=4):
        """EXL3 experts at real widths (fewer experts: the builds do not depend on E)."""
        d, inter, i16, f16, w = 4096, 2048, torch.int16, torch.float16, 16 * bits
        ids = torch.arange(tokens * 8).view(tokens, 8) % e
        return lambda: exl3.moe_exl3_on_path(
            z(tokens, d), z(e, d // 16, 2 * inter // 16, w, dtype=i16), z(e, 2, d, dtype=f16),
            z(e, 2 * inter, dtype=f16), z(e, inter // 16, d // 16, w, dtype=i16),
            z(e, inter, dtype=f16), z(e, d, dtype=f16), z(tokens, 8, dtype=f32), ids, 10.0, 0,
            1, decode=decode)

    def int4_call(tokens, path, e=8):
        """int4 experts at real widths, group 128 (fewer experts, as for EXL3)."""
        d, inter, g, u8, f16 = 4096, 2048, 128, torch.uint8, torch.float16
        ids = torch.arange(tokens * 8).view(tokens, 8) % e
        return lambda: int4.moe_int4_on_path(
            z(tokens, d), z(e, 2 * inter, d // 2, dtype=u8), z(e, 2 * inter, d // g, dtype=f16),
            z(e, 2 * inter, d // g, dtype=f16), z(e, d, inter // 2, dtype=u8),
            z(e, d, inter // g, dtype=f16), z(e, d, inter // g, dtype=f16),
            z(tokens, 8, dtype=f32), ids, 10.0, 0, g, path=path)

    streams = z(16, 4, 4096)
    return {
        "kda decode 64x1": kda_call([1] * 64),
        "kda prefill 4 seqs": kda_call([700, 1, 2048, 77]),
        "kda verify 16x4 deferred": kda_call([4] * 16, defer=True),
        "kda mixer decode 64x1": mixer_call([1] * 64),
        "kda mixer verify 4x4": mixer_call([4] * 4),
        "conv prefill planes": conv_call([3, 1000, 17]),
        "verify commit 16x4": commit_call([4] * 16),
        "gate": lambda: kda.kda_gate(z(16, heads * dk), z(heads * dk, dtype=f32),
                                     z(heads, dtype=f32), -5.0),
        "gated rms norm": lambda: kda.gated_rms_norm(z(16, heads, dk), z(16, heads, dk), z(dk),
                                                     1e-5),
        "indexer update": lambda: sparse_mla.indexer_update(
            z(16, 128), z(16, 128), z(kpool, 128, dtype=f32), z(16, 8, 256), z(64, 16, 128),
            torch.arange(16), torch.arange(16), cu([16]), torch.zeros(1, dtype=i64)),
        "topk 16x32K": topk_call(16, 32768),
        "topk 16x32K, histograms folded": topk_call(16, 32768, SELECT_FOLD_PROGRAMS=0),
        "attention decode 1 query": attention_call(1, budget * kpool + kpool - 1),
        "attention decode 64 queries": attention_call(64, budget * kpool + kpool - 1),
        "attention decode, DCP rank 1 of 2": attention_call(16, budget * kpool + kpool - 1, dcp=2),
        "attention decode, 64 rows a step": attention_call(
            16, budget * kpool + kpool - 1, ATTENTION_ROWS=64),
        "attention decode, unhalved latent 8 warps": attention_call(
            16, budget * kpool + kpool - 1, COL_TILE=512, ATTENTION_WARPS=8),
        "moe 16 tokens": moe_call(16),
        "exl3 dequant": lambda: exl3.exl3_dequant(z(2, 256, 128, 64, dtype=torch.int16), 1),
        "exl3 moe decode 1 token": exl3_call(1, True),
        "exl3 moe decode 64 tokens": exl3_call(64, True),
        "exl3 moe prefill 8 tokens": exl3_call(8, False, e=2),
        "exl3 moe decode 8 tokens, K3": exl3_call(8, True, bits=3),
        "exl3 codebook (test hook)": lambda: exl3._codebook(z(4096, dtype=torch.int32), 1),
        "int4 moe decode 200 tokens (tl.dot)": int4_call(200, "decode"),
        "int4 moe decode 1 token": int4_call(1, "decode"),
        "int4 moe decode 64 tokens": int4_call(64, "decode"),
        "int4 moe prefill 8 tokens": int4_call(8, "prefill", e=2),
        "router 64 tokens": lambda: moe.route_topk(z(64, 288, dtype=f32), z(288, dtype=f32), 8,
                                                   True, 2.5),
        "rms norm": lambda: norm.rms_norm(z(64, 4096), z(4096), 1e-5),
        "mhc pre": lambda: mhc.hc_pre(streams, z(24, 4 * 4096, dtype=f32), z(24, dtype=f32),
                                      z(3, dtype=f32), 1e-5, 1e-6, 20),
        "mhc post": lambda: mhc.hc_post(streams, z(16, 4096), z(16, 4, dtype=f32),
                                        z(16, 4, 4, dtype=f32)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the builds here")
    ap.add_argument("--no-spills", action="store_true", help="fail on a kernel that spills")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sm90_build: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
    failed: list[str] = []
    with _Recorder() as rec:
        for case, call in _cases().items():
            rec.case = case
            try:
                call()
            except Exception as exc:  # every case is tried; the failures are listed at the end
                failed.append(f"{case}: {type(exc).__name__}: {str(exc)[:2000]}")
    print(f"{'case':44} {'kernel':28} {'regs':>5} {'spill':>6} {'smem':>7} {'warps':>5} "
          f"{'wgmma':>5}")
    for b in rec.builds:
        print(f"{b.case:44} {b.kernel:28} {b.registers:5d} {b.spill_bytes:6d} "
              f"{b.shared_bytes:7d} {b.num_warps:5d} {b.wgmma:5d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(b) for b in rec.builds], f, indent=1)
    spills = [f"{b.case}: {b.kernel} spills {b.spill_bytes} B" for b in rec.builds
              if b.spill_bytes]
    for line in failed + (spills if args.no_spills else []):
        print("FAIL", line, file=sys.stderr)
    return 1 if failed or (args.no_spills and spills) else 0


if __name__ == "__main__":
    sys.exit(main())
