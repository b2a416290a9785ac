"""Engine options shared by the commands that run an engine in this process (`glm53 generate`,
`glm53 bench needle`; `glm53 bench latency` and `glm53 serve` take the parsers): the argument
types, the option group, and the EngineConfig those options describe."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import NamedTuple

from .config import CPU_CACHE_BYTES  # default KV/state budget on CPU when no size is given

ASYNC_SCHEDULING_HELP = ("schedule step N+1 while step N runs (overlapped host work; off by "
                         "default until measured on a GPU; steps after speculative, grammar "
                         "or penalised sampling still wait)")
PREFIX_CACHING_HELP = ("reuse cached prompt blocks and KDA state checkpoints across requests "
                       "(default on, unless the other settings cannot have it: then off, with "
                       "a warning)")
# the choices of --draft-kv-cache-dtype (actors' dflash.DRAFT_KV_CACHE_DTYPES; written out so
# that parsing flags imports no engine)
DRAFT_KV_CACHE_DTYPES = ("auto", "fp8")
DRAFT_KV_HELP = ("the DFlash draft's K/V ring (a sliding window per sequence): auto = the "
                 "draft's dtype; fp8 = e4m3 with one fp32 scale per head and position, about "
                 "half the bytes (GLM's DFlash2 at TP2: 10.3 MiB a sequence, not 20.0), "
                 "drafts from slightly rounded context (verification stays exact)")
QUANTIZE_HELP = ("quantise the routed experts of a BF16/FP8 checkpoint while loading: int4 = "
                 "4-bit codes with an fp16 scale and zero per 128 input columns (about 4.25 "
                 "bits per weight; lets the release fit a GPU pair)")


class SpeculativeArg(NamedTuple):
    method: str | None  # None, "mtp" or "dflash"
    k: int  # drafts per step (adaptive: at most)
    draft: str | None  # DFlash draft checkpoint
    adaptive: bool = False  # each step verifies 0..k drafts (raycluster/draft_policy.py)


NO_SPECULATION = SpeculativeArg(None, 0, None)


def parse_speculative(text: str) -> SpeculativeArg:
    """'mtp[:K][:auto]' (K default 3), 'dflash:PATH[:K][:auto]' (K default 7) or 'none';
    `auto` makes K the most drafts a step verifies, the draft length being chosen per step."""
    method, _, rest = text.partition(":")
    if method == "dflash" and rest:
        draft, _, rest = rest.partition(":")
    else:
        draft = None
    parts = rest.split(":") if rest else []
    adaptive = "auto" in parts
    parts = [p for p in parts if p != "auto"]
    try:
        if method == "none" and not rest:
            return NO_SPECULATION
        if method in ("mtp", "dflash") and len(parts) <= 1 and (draft or method == "mtp"):
            k = int(parts[0]) if parts else {"mtp": 3, "dflash": 7}[method]
            return SpeculativeArg(method, k, draft, adaptive)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--speculative {text!r}: K must be an int") from exc
    raise argparse.ArgumentTypeError(
        f"--speculative {text!r}: expected none, mtp[:K][:auto] or dflash:PATH[:K][:auto]")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)(i?B)?", text.strip(), flags=re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 2G, 1048576)")
    return int(m.group(1)) * 1024 ** ("_KMGT".index(m.group(2).upper() or "_"))


def add_engine_args(parser: argparse.ArgumentParser, *, max_num_seqs: int,
                    max_num_seqs_help: str | None = None,
                    max_model_len_help: str | None = None,
                    prefix_caching_help: str | None = None) -> None:
    """The engine, cache, parallelism and speculation options of an in-process engine."""
    eng = parser.add_argument_group("engine limits")
    eng.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    eng.add_argument("--device", default="cpu")
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help=max_num_seqs_help)
    eng.add_argument("--max-model-len", type=int, default=None, help=max_model_len_help)
    eng.add_argument("--block-size", type=int, default=16)
    size = eng.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
    size.add_argument("--cache-bytes", type=parse_bytes, default=None,
                      help="KV cache + state budget, e.g. 512M (CPU default 256M; GPU: "
                           "--gpu-memory-utilization)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--quantize-experts", choices=["int4"], default=None, help=QUANTIZE_HELP)
    eng.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8", "nvfp4"],
                     default="auto", help="latent cache rows (nvfp4 needs a scale bank)")
    eng.add_argument("--kv-scale-bank", default=None, metavar="PATH",
                     help="nvfp4 outer scales (default: kv_scales_nvfp4.json in the checkpoint)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=None, help=PREFIX_CACHING_HELP + (
                         f"; {prefix_caching_help}" if prefix_caching_help else ""))
    eng.add_argument("--enforce-eager", action="store_true",
                     help="no CUDA graphs for decode steps (every step runs eagerly)")
    eng.add_argument("--async-scheduling", action="store_true", help=ASYNC_SCHEDULING_HELP)
    par = parser.add_argument_group("parallelism (one Ray actor per GPU; fake GPUs on CPU)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    par.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    par.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size")
    parser.add_argument("--speculative", type=parse_speculative, default=NO_SPECULATION,
                        metavar="none|mtp[:K][:auto]|dflash:PATH[:K][:auto]",
                        help="speculative decoding: the MTP layer or a DFlash2 draft, K drafts")
    parser.add_argument("--draft-kv-cache-dtype", choices=DRAFT_KV_CACHE_DTYPES, default="auto",
                        help=DRAFT_KV_HELP)


def engine_config(args: argparse.Namespace, model_dir: str | Path, **overrides):
    """The EngineConfig of `add_engine_args`' options (on CPU without a size: CPU_CACHE_BYTES);
    `overrides` replace fields."""
    from glm53.raycluster.api import EngineConfig

    cache_bytes = args.cache_bytes
    if cache_bytes is None and args.num_blocks is None and not args.device.startswith("cuda"):
        cache_bytes = CPU_CACHE_BYTES
    spec = args.speculative
    fields = dict(
        model=str(model_dir), dtype=args.dtype, device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_blocks=args.num_blocks, cache_bytes=cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantize_experts=args.quantize_experts, kv_cache_dtype=args.kv_cache_dtype,
        kv_scale_bank=args.kv_scale_bank, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tp, expert_parallel_size=args.ep,
        decode_context_parallel_size=args.dcp, speculative_method=spec.method,
        num_speculative_tokens=spec.k, draft_model=spec.draft, adaptive_drafts=spec.adaptive,
        draft_kv_cache_dtype=args.draft_kv_cache_dtype,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    return EngineConfig(**{**fields, **overrides})
