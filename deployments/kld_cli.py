"""`glm53 kld capture|score|run`: the fidelity of a runtime configuration as KL divergence
from a teacher's next-token distributions over a text corpus (the core: actors/kld.py and
actors/kld_run.py, reached through glm53.raycluster.api).

This module tokenises the corpus (the checkpoint's tokenizer, each file on its own, the token
streams concatenated), cuts fixed non-overlapping windows and names the inputs by SHA-256:
the corpus (`corpus_sha256`: SHA-256 of each file's `sha256  bytes` line, in order) and the
model (the digest of its provenance manifest, recorded or computed, without the nvfp4 scale
bank, which the configuration names on its own; `glm53 verify --write` records it once, so a
large checkpoint is not hashed again on every run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

CACHE_DTYPES = ["auto", "bf16", "fp8", "nvfp4"]


def _runtime_args(p: argparse.ArgumentParser, kv_default: str, prefix: str = "") -> None:
    """The flags of one configuration (`prefix` "teacher-" for `run`'s teacher)."""
    p.add_argument(f"--{prefix}kv-cache-dtype", choices=CACHE_DTYPES, default=kv_default,
                   help=f"latent cache rows (default {kv_default}; nvfp4 needs a scale bank)")
    p.add_argument(f"--{prefix}kv-scale-bank", type=Path, default=None, metavar="PATH",
                   help="nvfp4 outer scales (default: kv_scales_nvfp4.json in the checkpoint)")
    p.add_argument(f"--{prefix}quantize-experts", choices=["int4"], default=None,
                   help="quantise the routed experts at load time")


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prefill each window in steps of this many tokens (default: one step)")


def _corpus_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--corpus", type=Path, nargs="+", required=required, metavar="FILE",
                   help="UTF-8 text file(s)" + ("" if required else
                                                 ": check the teacher was captured from them"))


def _capture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, default=None, help="at most this many windows")
    p.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="stored teacher logits (bfloat16: half the bytes, itself rounded)")


def _score_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk", type=int, default=64, help="positions per float64 KL chunk")
    p.add_argument("--breakdown", action="store_true",
                   help="also the KLD of the student's cache on each DSA layer and each cached "
                        "part alone (one more pass over the windows each)")
    p.add_argument("--json", type=Path, default=None, help="write the receipt here")


def add_kld_parser(sub) -> None:
    kld = sub.add_parser("kld", help="KL divergence of a configuration from a teacher's logits")
    modes = kld.add_subparsers(dest="kld", required=True)
    cap = modes.add_parser(
        "capture", help="write the teacher's logits over the corpus windows",
        description="Tokenises the corpus, cuts non-overlapping windows and writes each "
                    "window's tokens and teacher logits (W - 1 scored rows) into OUT, with a "
                    "manifest of SHA-256s.")
    _common_args(cap)
    _runtime_args(cap, "bf16")
    _corpus_args(cap, required=True)
    _capture_args(cap)
    cap.add_argument("--out", type=Path, required=True, help="the teacher directory")
    sco = modes.add_parser(
        "score", help="score a configuration against a captured teacher",
        description="Runs the student over the teacher's windows; reports mean KL(teacher || "
                    "student) (float64), top-1 agreement, NLL, per-position buckets; "
                    "--json writes the receipt.")
    _common_args(sco)
    _runtime_args(sco, "bf16")
    sco.add_argument("--teacher", type=Path, required=True)
    _corpus_args(sco, required=False)
    sco.add_argument("--other-model", action="store_true",
                     help="the student is another checkpoint than the teacher's")
    _score_args(sco)
    run = modes.add_parser("run", help="capture and score in one process (same checkpoint)")
    _common_args(run)
    _runtime_args(run, "bf16", prefix="teacher-")
    _runtime_args(run, "bf16")
    _corpus_args(run, required=True)
    _capture_args(run)
    run.add_argument("--teacher-out", type=Path, default=None,
                     help="keep the teacher directory here (default: a temporary one)")
    _score_args(run)


def corpus_digest(files: list[Path]) -> str:
    lines = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.stat().st_size}\n"
                    for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def model_digest(model_dir: Path) -> str:
    from glm53.raycluster.api import BANK_FILE

    from .provenance import Manifest, hash_folder, read_manifest

    manifest = read_manifest(model_dir) or hash_folder(model_dir)
    return Manifest({p: e for p, e in manifest.files.items() if p != BANK_FILE}).digest


def _tokens(model_dir: Path, files: list[Path]) -> list[int]:
    from .tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    out: list[int] = []
    for f in files:
        out += tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
    return out


def _config(args, model_dir: Path, digest: str, prefix: str = ""):
    """The RunConfig of the flags (`prefix` "teacher_": `run`'s teacher)."""
    from glm53.raycluster.api import RunConfig

    bank = getattr(args, f"{prefix}kv_scale_bank")
    return RunConfig(model=str(model_dir), model_digest=digest,
                     kv_cache_dtype=getattr(args, f"{prefix}kv_cache_dtype"),
                     kv_scale_bank=str(bank) if bank else None,
                     quantize_experts=getattr(args, f"{prefix}quantize_experts"),
                     dtype=args.dtype, device=args.device, block_size=args.block_size,
                     prefill_chunk=args.prefill_chunk)


def _report(receipt: dict, path: Path | None) -> None:
    k = receipt["kld"]
    print(f"kld mean {k['mean']:.6g} (p95 {k['p95']:.4g}, max {k['max']:.4g}), top-1 "
          f"{receipt['top1_agreement']:.4f}, nll {receipt['nll']['student']:.4f} vs teacher "
          f"{receipt['nll']['teacher']:.4f}, over {receipt['positions']} positions "
          f"({receipt['windows']} windows of {receipt['window']})")
    for name, value in receipt.get("breakdown", {}).items():
        print(f"  {name}: {value}")
    if path is not None:
        path.write_text(json.dumps(receipt, indent=1, sort_keys=True) + "\n")
        print(f"wrote the receipt to {path}")


def _capture(args, model_dir: Path, digest: str, out: Path, prefix: str = "") -> None:
    from glm53.raycluster.api import capture, check_window, cut_windows

    check_window(model_dir, args.window)
    windows = cut_windows(_tokens(model_dir, args.corpus), args.window, args.windows)
    inputs = {"corpus_sha256": corpus_digest(args.corpus),
              "corpus_files": [f.name for f in args.corpus]}
    capture(_config(args, model_dir, digest, prefix), windows, out, inputs, args.logits_dtype)
    print(f"wrote {len(windows)} teacher windows of {args.window} tokens to {out}")


def _score(args, model_dir: Path, digest: str, teacher: Path) -> None:
    from glm53.raycluster.api import cut_windows, read_manifest, score, tokens_sha256

    inputs = {}
    if args.corpus:
        manifest = read_manifest(teacher)
        inputs["corpus_sha256"] = corpus_digest(args.corpus)
        windows = cut_windows(_tokens(model_dir, args.corpus), manifest["window"],
                              manifest["windows"])
        inputs["tokens_sha256"] = tokens_sha256(windows)
    receipt = score(teacher, _config(args, model_dir, digest), args.chunk, args.breakdown,
                    getattr(args, "other_model", False), inputs)
    _report(receipt, args.json)


def run_kld(args: argparse.Namespace) -> int:
    from glm53.raycluster.api import CheckpointError, KLDInputError

    from .provenance import ProvenanceError
    from .tiny_model import embedded_tiny_model

    model_dir = args.model or embedded_tiny_model()
    try:
        for f in args.corpus or []:
            if not f.is_file():
                raise FileNotFoundError(f"corpus file {f} not found")
        digest = model_digest(model_dir)
        if args.kld == "capture":
            _capture(args, model_dir, digest, args.out)
        elif args.kld == "score":
            _score(args, model_dir, digest, args.teacher)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                teacher = args.teacher_out or Path(tmp) / "teacher"
                _capture(args, model_dir, digest, teacher, prefix="teacher_")
                _score(args, model_dir, digest, teacher)
    except (KLDInputError, FileNotFoundError, CheckpointError, ProvenanceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
