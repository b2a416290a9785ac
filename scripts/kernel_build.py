"""Build every Triton kernel for the project's GPUs on a machine without a GPU.

Targets: sm_90 (H100/H200) and sm_120 (RTX PRO 6000 Blackwell, the design's named GPU). Each op's
own wrapper is called on CPU tensors of the model's real shapes with the launch replaced by a
compile (Triton's warmup path, against a stand-in driver that reports the target, and with
`torch.cuda.get_device_capability` reporting it too, so a wrapper that keys its tiling on the
capability picks what that GPU would launch). Per kernel build it prints registers, spilled bytes
(local memory), shared memory, and the tensor-core instructions used (Hopper's wgmma, or mma.sync).
It fails on a kernel that does not compile (the interpreter accepts things the compiler rejects: a
constexpr reassigned in a loop, one variable typed differently in the two branches of an `if`), on
shared memory past the target's per-block limit, on an instruction the target lacks, and, with
--no-spills, on a kernel that spills.

    python scripts/kernel_build.py [--arch 90,120] [--json FILE] [--no-spills] [--cases TEXT]
                                   [--dump DIR]

--dump writes each build's TTGIR (the layouts Triton chose), PTX and SASS to DIR, to read what a
kernel does between its loads (barriers, shared-memory round trips) without a GPU.

Run it with TRITON_INTERPRET unset (the interpreter replaces the compiler). It leans on Triton
3.6 internals (JITFunction.run's warmup path, the driver registry's `_active` slot), which is
the version the project pins for the interpreter and the GPU image has.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
ROOT = Path(__file__).resolve().parents[1]

# Opt-in shared memory per block: the SM's capacity less the 1 KB the driver reserves per block
# (228 KB on sm_90, 100 KB on sm_120; CCCL's cuda/__device/arch_traits.h)
SHARED_PER_BLOCK = {90: 227 * 1024, 120: 99 * 1024}
# PTX that a target cannot run, by target (CCCL's cuda::ptx tables, PTX ISA): wgmma is sm_90a
# only; tcgen05 (tensor memory MMA) and TMA multicast are sm_90a / datacenter Blackwell
# (sm_100/103/110), not sm_120. Clusters, plain TMA and setmaxnreg do exist on sm_120a.
FOREIGN_PTX = {90: (), 120: ("wgmma.", "tcgen05.", ".multicast::cluster")}


# cases that override the attention's Hopper tiling constants (sweeps of sparse_mla.py)
HOPPER_SWEEPS = ("attention decode, 64 rows a step", "attention decode, unhalved latent 8 warps")
# attention over fp8 / nvfp4 latent rows does not fit SM120 yet (the fp8 build needs 107 KB of
# shared memory, 99 KB a block; `sparse_mla_attention` refuses it there): Hopper only
HOPPER_ONLY = ("attention decode 16 queries, fp8 cache", "attention decode 16 queries, nvfp4 cache")


class _StandInDriver:
    """What JITFunction asks the active driver for while binding and compiling."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        # JITFunction keeps its compiled kernels (and the target they were built for) per
        # device: one device per target, so a second target in the process compiles afresh
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass(frozen=True)
class Build:
    arch: int
    case: str
    kernel: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    wgmma: int
    mma_sync: int
    foreign: tuple[str, ...]  # instructions of FOREIGN_PTX[arch] in the PTX
    # the widest global load (bytes a thread reads in one instruction) per source line
    # ("file.py:line", the innermost frame of its PTX location): a vector load is only valid
    # where every lane's address is that many bytes aligned
    widest_loads: dict[str, int]


_LOC = re.compile(r"^\s*\.loc\s.*//\s*([\w.]+:\d+)")
_LOAD = re.compile(r"\bld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bsuf](\d+)\s")


def widest_loads(ptx: str) -> dict[str, int]:
    """{"file.py:line": bytes of the widest `ld.global` at that line} of a PTX listing."""
    widest: dict[str, int] = {}
    where = "?"
    for line in ptx.splitlines():
        if m := _LOC.match(line):
            where = m.group(1)
        elif m := _LOAD.search(line):
            width = int(m.group(1) or 1) * int(m.group(2)) // 8
            widest[where] = max(widest.get(where, 0), width)
    return widest


def _cuobjdump(cubin: bytes, option: str) -> str:
    """cuobjdump's text for a cubin (`option`: -res-usage, -sass)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, option, f.name], capture_output=True, text=True,
                              check=True).stdout


def _resources(cubin: bytes) -> dict[str, int]:
    text = _cuobjdump(cubin, "-res-usage")
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}


class _Recorder:
    """JITFunction.run replaced by a compile-only run that records each build for `arch`."""

    def __init__(self, arch: int, dump: Path | None = None) -> None:
        self.arch = arch
        self.dump = dump
        self.case = ""
        self.builds: list[Build] = []
        self._run = JITFunction.run
        self._driver = None
        self._capability = mock.patch("torch.cuda.get_device_capability",
                                      return_value=divmod(arch, 10))

    def __enter__(self) -> _Recorder:
        from glm53.kernels.utils import device_capability

        recorder = self

        def compile_only(fn, *args, grid, warmup, **kwargs):
            kernel = recorder._run(fn, *args, grid=grid, warmup=True, **kwargs)
            res = _resources(kernel.asm["cubin"])
            ptx = kernel.asm["ptx"]
            recorder.builds.append(Build(
                recorder.arch, recorder.case, fn.fn.__name__, res.get("REG", 0),
                max(res.get("LOCAL", 0), res.get("STACK", 0)), kernel.metadata.shared,
                kernel.metadata.num_warps, ptx.count("wgmma.mma_async"), ptx.count("mma.sync"),
                tuple(i for i in FOREIGN_PTX[recorder.arch] if i in ptx), widest_loads(ptx)))
            if recorder.dump is not None:
                recorder.write_asm(fn.fn.__name__, kernel.asm)
            return kernel

        self._driver = driver._active  # None here: no default driver exists without a GPU
        driver.set_active(_StandInDriver(self.arch))
        self._capability.start()
        device_capability.cache_clear()  # a capability cached for another target
        JITFunction.run = compile_only
        return self

    def write_asm(self, kernel: str, asm: dict) -> None:
        """DIR/sm_<arch>_<case>_<kernel>.{ttgir,ptx,sass}: case names made file-safe."""
        stem = self.dump / re.sub(r"\W+", "_", f"sm_{self.arch}_{self.case}_{kernel}")
        stem.with_suffix(".ttgir").write_text(asm["ttgir"])
        stem.with_suffix(".ptx").write_text(asm["ptx"])
        stem.with_suffix(".sass").write_text(_cuobjdump(asm["cubin"], "-sass"))

    def __exit__(self, *exc) -> None:
        from glm53.kernels.utils import device_capability

        JITFunction.run = self._run
        driver._active = self._driver
        self._capability.stop()
        device_capability.cache_clear()


def _cases(arch: int) -> dict[str, Callable[[], object]]:
    """One call per op and regime (decode, verify, prefill) at the model's real widths; the
    swept Hopper tilings of the attention only for sm_90 (their constants are Hopper's)."""
    from glm53.kernels import (
        exl3,
        int4,
        int4_gemv,
        kda,
        kda_mixer,
        latent_quant,
        linear,
        mhc,
        moe,
        norm,
        radix_select,
        sparse_mla,
    )

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

    def with_constants(module, call, **constants):
        """call() with constants of a kernels `module` overridden (if any)."""
        if not constants:
            return call

        def run():
            with mock.patch.multiple(module, **constants):
                call()
        return run

    def pool_cache(blocks, fmt="plain"):
        if fmt == "plain":
            return z(blocks, 64 // kpool, 128)
        return z(blocks, 64 // kpool, latent_quant.row_bytes(fmt, 128), dtype=torch.uint8)

    def topk_call(batch, ctx, fmt="plain", **constants):
        # a table wider than the context, of an odd width, as a serving table is
        blocks = ctx // 64 + 3
        table = torch.arange(batch * blocks).view(batch, blocks)
        return with_constants(radix_select, lambda: sparse_mla.indexer_topk(
            z(batch, 32, 128), z(batch, 32, dtype=f32), pool_cache(batch * blocks, fmt), table,
            torch.arange(batch), torch.full((batch,), ctx - 1), budget, kpool, fmt), **constants)

    def update_call(fmt="plain"):
        return lambda: sparse_mla.indexer_update(
            z(16, 128), z(16, 128), z(kpool, 128, dtype=f32), z(16, 8, 256), pool_cache(64, fmt),
            torch.arange(16), torch.arange(16), cu([16]), torch.zeros(1, dtype=i64), fmt)

    def latent_cache(dcp=1, fmt="plain"):
        if fmt == "plain":
            return z(64, 64 // dcp, latent)
        return z(64, 64 // dcp, latent_quant.row_bytes(fmt, latent), dtype=torch.uint8)

    def attention_call(queries, width, dcp=1, fmt="plain", **constants):
        table = torch.arange(64).view(1, 64)
        return with_constants(sparse_mla, lambda: sparse_mla.sparse_mla_attention(
            z(queries, heads, latent), latent_cache(dcp, fmt), table,
            torch.zeros(queries, dtype=i64), z(queries, width, dtype=i64), 1 / 16, dcp - 1, dcp,
            fmt), **constants)

    def store_call(fmt):
        return lambda: latent_quant.store_latent(z(16, latent), latent_cache(1, fmt),
                                                 torch.arange(16), latent_format=fmt)

    def moe_call(tokens):
        """bf16 experts at real widths, fewer of them (as for EXL3): the one Triton build here is
        the SwiGLU over [T * 8, I], and torch fills every zero weight, 14 GB at 288 experts."""
        e, d, inter = 8, 4096, 2048
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

    def int4_tiled_call(tokens, e=8):
        """The dot-free pairs path on codes in `int4_gemv.tile_words`' layout (moe_4bit.py's
        int4t format)."""
        d, inter, g, u8, f16 = 4096, 2048, 128, torch.uint8, torch.float16
        ids = torch.arange(tokens * 8).view(tokens, 8) % e
        w13 = (z(e, 2 * inter, d // 2, dtype=u8), z(e, 2 * inter, d // g, dtype=f16),
               z(e, 2 * inter, d // g, dtype=f16))
        w2 = (z(e, d, inter // 2, dtype=u8), z(e, d, inter // g, dtype=f16),
              z(e, d, inter // g, dtype=f16))
        return lambda: int4_gemv.moe_decode_pairs(z(tokens, d), w13, w2, g, g, ids,
                                                  z(tokens, 8, dtype=f32), 0, 10.0, e,
                                                  tiled=True)

    def shared_down_pairs_call(e=8):
        """The shared expert's down projection at one token summing the routed experts' pairs
        in its epilogue (`int4_gemv.PairRows` from the int4 pairs path: ADD 2)."""
        d, inter, g, u8, f16 = 4096, 2048, 128, torch.uint8, torch.float16
        ids = torch.arange(8).view(1, 8) % e
        w13 = (z(e, 2 * inter, d // 2, dtype=u8), z(e, 2 * inter, d // g, dtype=f16),
               z(e, 2 * inter, d // g, dtype=f16))
        w2 = (z(e, d, inter // 2, dtype=u8), z(e, d, inter // g, dtype=f16),
              z(e, d, inter // g, dtype=f16))

        def run():
            rows = int4_gemv.moe_decode_pairs(z(1, d), w13, w2, g, g, ids, z(1, 8, dtype=f32), 0,
                                              10.0, e, defer_reduce=True)
            return linear.linear(z(1, 1024), z(d, 1024), add=rows)
        return run

    streams = z(16, 4, 4096)
    cases = {
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
        "indexer update": update_call(),
        "indexer update, fp8 pool keys": update_call("fp8"),
        "topk 16x32K": topk_call(16, 32768),
        "topk 16x32K, fp8 pool keys": topk_call(16, 32768, "fp8"),
        "topk 16x32K, histograms folded": topk_call(16, 32768, SELECT_FOLD_PROGRAMS=0),
        "attention decode 1 query": attention_call(1, budget * kpool + kpool - 1),
        "attention decode 64 queries": attention_call(64, budget * kpool + kpool - 1),
        "attention decode, DCP rank 1 of 2": attention_call(16, budget * kpool + kpool - 1, dcp=2),
        "attention decode 16 queries, fp8 cache": attention_call(
            16, budget * kpool + kpool - 1, fmt="fp8"),
        "attention decode 16 queries, nvfp4 cache": attention_call(
            16, budget * kpool + kpool - 1, fmt="nvfp4"),
        "latent store fp8": store_call("fp8"),
        "latent store nvfp4": store_call("nvfp4"),
        "latent store plain": store_call("plain"),
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
        "int4 moe decode 200 tokens (tl.dot)": with_constants(
            int4, int4_call(200, "decode"), DOT_BM_MAX=16),
        "int4 moe decode 2048 tokens (tl.dot, 64 rows a block)": int4_call(2048, "decode"),
        "int4 moe decode 1 token": int4_call(1, "decode"),
        "int4 moe decode 1 token, 4 steps ahead": with_constants(
            int4_gemv, int4_call(1, "decode"), GEMV_AHEAD_1=4),
        "int4 moe decode 64 tokens": int4_call(64, "decode"),
        "int4 moe prefill 8 tokens": int4_call(8, "prefill", e=2),
        "int4 moe decode 1 token, tiled codes": int4_tiled_call(1),
        "router 64 tokens": lambda: moe.route_topk(z(64, 288, dtype=f32), z(288, dtype=f32), 8,
                                                   True, 2.5),
        "router logits 4 tokens": lambda: moe.router_logits(z(4, 4096), z(288, 4096, dtype=f32)),
        "dense gemv 1 token": lambda: linear.linear(z(1, 4096), z(12320, 4096)),
        # GEMV_MAX_TOKENS (1) rows: more run on cuBLAS, no Triton build
        "dense gemv 1 token, K tail": lambda: linear.linear(z(1, 1000), z(4096, 1000)),
        "dense gemv swiglu 1 token": lambda: linear.linear_swiglu(z(1, 4096), z(2048, 4096),
                                                                  10.0),
        "dense gemv add 1 token": lambda: linear.linear(z(1, 1024), z(4096, 1024),
                                                        add=z(1, 4096)),
        "dense gemv add routed pairs 1 token": shared_down_pairs_call(),
        "rms norm": lambda: norm.rms_norm(z(64, 4096), z(4096), 1e-5),
        "mhc pre": lambda: mhc.hc_pre(streams, z(24, 4 * 4096, dtype=f32), z(24, dtype=f32),
                                      z(3, dtype=f32), 1e-5, 1e-6, 20, z(4096), 1e-5),
        "mhc pre 600 tokens": lambda: mhc.hc_pre(z(600, 4, 4096), z(24, 4 * 4096, dtype=f32),
                                                 z(24, dtype=f32), z(3, dtype=f32), 1e-5, 1e-6,
                                                 20, z(4096), 1e-5),
        "mhc pre 1 token": lambda: mhc.hc_pre(streams[:1], z(24, 4 * 4096, dtype=f32),
                                              z(24, dtype=f32), z(3, dtype=f32), 1e-5, 1e-6,
                                              20, z(4096), 1e-5),
        "mhc post": lambda: mhc.hc_post(streams, z(16, 4096), z(16, 4, dtype=f32),
                                        z(16, 4, 4, dtype=f32)),
        "mhc post and next pre 1 token": lambda: mhc.hc_post_pre(
            streams[:1], z(1, 4096), z(1, 4, dtype=f32), z(1, 4, 4, dtype=f32),
            z(24, 4 * 4096, dtype=f32), z(24, dtype=f32), z(3, dtype=f32), 1e-5, 1e-6, 20,
            z(4096), 1e-5),
    }
    if arch != 90:
        for case in (*HOPPER_SWEEPS, *HOPPER_ONLY):
            del cases[case]
    return cases


def _build(arch: int, failed: list[str], only: str | None = None,
           dump: Path | None = None) -> list[Build]:
    """Every case built for `arch` (those whose name contains `only`, if given); a case that
    raises is listed in `failed`."""
    with _Recorder(arch, dump) as rec:
        for case, call in _cases(arch).items():
            if only is not None and only not in case:
                continue
            rec.case = case
            try:
                call()
            except Exception as exc:  # every case is tried; the failures are listed at the end
                failed.append(f"sm_{arch} {case}: {type(exc).__name__}: {str(exc)[:2000]}")
    return rec.builds


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90,120",
                    help="comma-separated targets, of " + ", ".join(map(str, SHARED_PER_BLOCK)))
    ap.add_argument("--json", help="write the builds here (with commit, date and Triton version)")
    ap.add_argument("--no-spills", action="store_true", help="fail on a kernel that spills")
    ap.add_argument("--cases", help="only the cases whose name contains this text")
    ap.add_argument("--dump", type=Path, help="write each build's TTGIR, PTX and SASS here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_build: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
    archs = [int(a) for a in args.arch.split(",")]
    if unknown := set(archs) - set(SHARED_PER_BLOCK):
        sys.exit(f"kernel_build: no limits known for sm_{sorted(unknown)}")
    failed: list[str] = []
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
    builds = [b for arch in archs for b in _build(arch, failed, args.cases, args.dump)]
    print(f"{'arch':>6} {'case':44} {'kernel':28} {'regs':>5} {'spill':>6} {'smem':>7} "
          f"{'warps':>5} {'wgmma':>5} {'mma':>5}")
    for b in builds:
        print(f"sm_{b.arch:<3} {b.case:44} {b.kernel:28} {b.registers:5d} {b.spill_bytes:6d} "
              f"{b.shared_bytes:7d} {b.num_warps:5d} {b.wgmma:5d} {b.mma_sync:5d}")
    if args.json:
        record = dict(commit=_commit(), date=datetime.date.today().isoformat(),
                      triton=triton.__version__, archs=archs,
                      shared_per_block={a: SHARED_PER_BLOCK[a] for a in archs},
                      builds=[asdict(b) for b in builds])
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    over = [f"sm_{b.arch} {b.case}: {b.kernel} needs {b.shared_bytes} B of shared memory, "
            f"{SHARED_PER_BLOCK[b.arch]} B a block" for b in builds
            if b.shared_bytes > SHARED_PER_BLOCK[b.arch]]
    foreign = [f"sm_{b.arch} {b.case}: {b.kernel} uses {', '.join(b.foreign)}" for b in builds
               if b.foreign]
    spills = [f"sm_{b.arch} {b.case}: {b.kernel} spills {b.spill_bytes} B" for b in builds
              if b.spill_bytes]
    errors = failed + over + foreign + (spills if args.no_spills else [])
    for line in errors:
        print("FAIL", line, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
