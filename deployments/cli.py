"""The `glm53` command line: build tiny checkpoints, generate text through the engine, serve
the OpenAI-compatible API on Ray Serve, benchmark both (`glm53 bench`) and measure a
configuration's fidelity (`glm53 kld`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .bench_cli import add_bench_parser, run_bench
from .engine_args import (
    DRAFT_KV_CACHE_DTYPES,
    DRAFT_KV_HELP,
    NO_SPECULATION,
    QUANTIZE_HELP,
    add_engine_args,
    engine_config,
    parse_speculative,
)
from .kld_cli import add_kld_parser, run_kld
from .serve_cli import add_serve_parser, run_serve


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        msg = f"--prompt-ids expects comma-separated ints: {exc}"
        raise argparse.ArgumentTypeError(msg) from exc
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


class _AppendPrompt(argparse.Action):
    """--prompt and --prompt-ids append to one ordered list of (kind, value)."""

    def __call__(self, parser, namespace, values, option_string=None):
        prompts = getattr(namespace, self.dest, None) or []
        kind = "ids" if option_string == "--prompt-ids" else "text"
        setattr(namespace, self.dest, [*prompts, (kind, values)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm53", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (release layout)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=5)
    tiny.add_argument("--mtp", action="store_true", help="include the MTP layer")
    tiny.add_argument("--exl3", action="store_true",
                      help="routed experts as EXL3 K4 codes (MCG codebook), as in the seed "
                           "checkpoint (hidden and expert widths 128)")
    tiny.add_argument("--dflash", action="store_true",
                      help="write a tiny DFlash2 draft checkpoint instead (for --target)")
    tiny.add_argument("--target", type=Path, default=None,
                      help="with --dflash: the target checkpoint (default: the embedded tiny)")

    gen = sub.add_parser("generate", help="generate tokens for one or more prompts")
    gen.add_argument("--model", type=Path, default=None,
                     help="checkpoint directory (default: the embedded tiny model)")
    gen.add_argument("--prompt", dest="prompts", action=_AppendPrompt,
                     help="prompt text, encoded as is (repeatable)")
    gen.add_argument("--prompt-ids", dest="prompts", action=_AppendPrompt, type=_parse_ids,
                     help="comma-separated token ids (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each text prompt as one user message with the chat template")
    gen.add_argument("--max-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_engine_args(gen, max_num_seqs=16)
    add_serve_parser(sub)
    _plan_parser(sub)
    _verify_parser(sub)
    _calibrate_parser(sub)
    add_kld_parser(sub)
    add_bench_parser(sub)
    return parser


def _verify_parser(sub) -> None:
    ver = sub.add_parser(
        "verify", help="write or check a checkpoint folder's SHA-256 manifest",
        description="Checks each folder against its glm53-manifest.json (every file's size and "
                    "SHA-256); exits 1 on any difference. --write records the folder as it is.")
    ver.add_argument("folders", type=Path, nargs="+", metavar="DIR",
                     help="checkpoint folders (the model, a DFlash draft)")
    ver.add_argument("--write", action="store_true", help="write (replace) the manifest")
    ver.add_argument("--manifest", type=Path, default=None,
                     help="manifest path (one DIR only; default DIR/glm53-manifest.json)")


def _verify(args) -> int:
    from .provenance import ProvenanceError, verify, write_manifest

    if args.manifest is not None and len(args.folders) != 1:
        raise SystemExit("error: --manifest needs exactly one DIR")
    status = 0
    for folder in args.folders:
        try:
            if args.write:
                manifest = write_manifest(folder, args.manifest)
                print(f"wrote manifest of {folder}: {len(manifest.files)} files, "
                      f"{manifest.num_bytes} bytes, sha256 {manifest.digest}")
            else:
                manifest = verify(folder, args.manifest)
                print(f"{folder}: OK, {len(manifest.files)} files, sha256 {manifest.digest}")
        except ProvenanceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
    return status


def _plan_parser(sub) -> None:
    pm = sub.add_parser("plan-memory", help="plan one rank's GPU memory (no GPU needed)",
                        description="Builds the rank's shard on the meta device and prints "
                                    "where its memory goes; exits 1 when it does not fit.")
    src = pm.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint directory (its config.json)")
    src.add_argument("--release", choices=["fp8", "bf16", "exl3"],
                     help="the official release's config (FP8 or BF16) or the EXL3 K4 one")
    for flag in ("--tp", "--ep", "--dcp"):
        pm.add_argument(flag, type=int, default=1)
    pm.add_argument("--rank", type=int, default=0)
    pm.add_argument("--quantize-experts", choices=["int4"], default=None, help=QUANTIZE_HELP)
    pm.add_argument("--device-gib", type=float, default=139.0)
    pm.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pm.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    pm.add_argument("--speculative", type=parse_speculative, default=NO_SPECULATION,
                    metavar="mtp[:K]|dflash:PATH[:K]",  # (':auto' plans as K drafts)
                    help="dflash:PATH reads the draft's config.json; dflash:incoai/GLM-5.3-"
                         "Flash-DFlash2 plans the published DFlash2 drafter")
    pm.add_argument("--draft-kv-cache-dtype", choices=DRAFT_KV_CACHE_DTYPES, default="auto",
                    help=DRAFT_KV_HELP)
    pm.add_argument("--max-num-seqs", type=int, default=16)
    pm.add_argument("--max-num-batched-tokens", type=int, default=2048)
    pm.add_argument("--max-model-len", type=int, default=None)
    pm.add_argument("--block-size", type=int, default=16)
    pm.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8", "nvfp4"], default="auto",
                    help="latent cache rows (fp8 528 B, nvfp4 304 B per token and layer)")
    pm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None, help="plan the prefix cache's KDA state checkpoints (and "
                                       "DFlash rings): as serve, on by default")
    pm.add_argument("--prefix-checkpoints", type=int, default=None, metavar="N",
                    help="checkpoints planned with prefix caching (default max-num-seqs)")


def _draft_config(draft: str) -> dict:
    """A DFlash draft's config.json dict: the draft directory's, or the published DFlash2's
    for its name (release.DFLASH2_RELEASE), which needs no download."""
    from glm53.raycluster.api import DFLASH2_RELEASE, dflash2_release_config

    if draft == DFLASH2_RELEASE:
        return dflash2_release_config()
    path = Path(draft) / "config.json"
    if not path.exists():
        raise SystemExit(f"error: {path} not found: is {draft} a DFlash draft directory? "
                         f"({DFLASH2_RELEASE} plans the published DFlash2 drafter)")
    return json.loads(path.read_text())


def _plan_memory(args) -> int:
    from glm53.raycluster.api import (
        EngineConfig,
        GiB,
        MemoryPlanError,
        exl3_release_config,
        plan_for_config,
        release_config,
    )

    if args.model:
        path = args.model / "config.json"
        if not path.exists():
            raise SystemExit(f"error: {path} not found: is {args.model} a model directory?")
        config = json.loads(path.read_text())
    elif args.release == "exl3":
        config = exl3_release_config()
    else:
        config = release_config()
        if args.release == "bf16":
            del config["quantization_config"]
    method, k = args.speculative.method, args.speculative.k
    draft_config = _draft_config(args.speculative.draft) if method == "dflash" else None
    try:
        settings = EngineConfig(model="unplanned", block_size=args.block_size,
                                decode_context_parallel_size=args.dcp,
                                max_num_seqs=args.max_num_seqs,
                                enable_prefix_caching=args.enable_prefix_caching,
                                prefix_checkpoints=args.prefix_checkpoints)
        plan = plan_for_config(
            config, device_bytes=int(args.device_gib * GiB),
            utilization=args.gpu_memory_utilization, tp=args.tp, ep=args.ep, dcp=args.dcp,
            rank=args.rank, quantize_experts=args.quantize_experts, dtype=args.dtype,
            with_mtp=method == "mtp", num_spec=k, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
            draft_config=draft_config, num_checkpoints=settings.num_prefix_checkpoints,
            draft_kv_cache_dtype=args.draft_kv_cache_dtype if draft_config else "auto")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(plan.describe())
    try:
        plan.check()
    except MemoryPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _calibrate_parser(sub) -> None:
    cal = sub.add_parser(
        "calibrate-kv", help="build the nvfp4 KV-cache scale bank of a checkpoint from prompts",
        description="Runs the model over the prompts (plain cache) and writes one power-of-two "
                    "outer scale per DSA layer and the MTP layer. The same checkpoint and "
                    "prompts give the same file.")
    cal.add_argument("--model", type=Path, default=None,
                     help="checkpoint directory (default: the embedded tiny model)")
    cal.add_argument("--prompts", type=Path, required=True,
                     help="text file, one prompt per non-empty line")
    cal.add_argument("--max-prompt-tokens", type=int, default=4096,
                     help="each prompt is cut to this many tokens")
    cal.add_argument("--output", type=Path, default=None,
                     help="default: kv_scales_nvfp4.json in the checkpoint, where serve looks")
    cal.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    cal.add_argument("--device", default="cpu")


def _calibrate_kv(args) -> int:
    from glm53.raycluster.api import bank_path, calibrate_checkpoint, write_bank

    from .tiny_model import embedded_tiny_model
    from .tokenizer import load_tokenizer

    model_dir = args.model or embedded_tiny_model()
    lines = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"error: {args.prompts} holds no prompt")
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(line, add_special_tokens=False)[:args.max_prompt_tokens]
               for line in lines]
    bank = calibrate_checkpoint(model_dir, [p for p in prompts if p], args.dtype, args.device)
    path = write_bank(bank, args.output or bank_path(model_dir))
    print(f"wrote {len(bank['scales'])} layer scales from {bank['tokens']} tokens to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from glm53.raycluster.api import (
        CheckpointError,
        EngineDeadError,
        LLMEngine,
        RequestRejectedError,
        SamplingParams,
        UnsupportedConfigError,
        WorkerError,
        make_executor,
        read_config,
    )

    from .tiny_model import embedded_tiny_model
    from .tokenizer import apply_chat_template, decode, load_tokenizer

    if not args.prompts:
        raise SystemExit("give at least one --prompt or --prompt-ids")
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature must be >= 0 and --top-p in (0, 1]")
    model_dir = args.model or embedded_tiny_model()
    try:
        read_config(model_dir)  # before the tokenizer: a clear error for a non-model directory
        tokenizer = load_tokenizer(model_dir)
        prompts = []
        for kind, value in args.prompts:
            if kind == "ids":
                prompts.append(value)
            elif args.chat:
                prompts.append(apply_chat_template(tokenizer, [{"role": "user", "content": value}]))
            else:
                prompts.append(tokenizer.encode(value, add_special_tokens=False))
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
        config = engine_config(args, model_dir)
        engine = LLMEngine(config, make_executor(config, progress=not args.json))
        try:
            outputs = engine.generate(prompts, params)
        finally:
            engine.shutdown()
    except (FileNotFoundError, CheckpointError, UnsupportedConfigError, RequestRejectedError,
            WorkerError, EngineDeadError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    for prompt_ids, out in zip(prompts, outputs, strict=True):
        text = decode(tokenizer, out)
        if args.json:
            print(json.dumps({"token_ids": out, "text": text}))
        else:
            print(f"prompt ids: {prompt_ids}\ngenerated ids: {out}\ntext: {text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # progress and capacity lines go to stderr; stdout carries only the results
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command == "make-tiny":
        from .tiny_model import embedded_tiny_model, make_tiny

        if args.dflash:
            from glm53.raycluster.api import read_config, write_tiny_draft

            target = read_config(args.target or embedded_tiny_model())
            path = write_tiny_draft(args.out, target, seed=args.seed)
        else:
            path = make_tiny(args.out, seed=args.seed, layers=args.layers, mtp=args.mtp,
                             exl3=args.exl3)
        print(f"wrote tiny checkpoint to {path}")
        return 0
    if args.command == "serve":
        return run_serve(args)
    if args.command == "plan-memory":
        return _plan_memory(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "calibrate-kv":
        return _calibrate_kv(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "kld":
        return run_kld(args)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
