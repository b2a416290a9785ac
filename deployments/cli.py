"""The `glm53` command line: build tiny checkpoints and generate text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        msg = f"--prompt-ids expects comma-separated ints: {exc}"
        raise argparse.ArgumentTypeError(msg) from exc
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm53", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (release layout)")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=5)
    tiny.add_argument("--mtp", action="store_true", help="include the MTP layer")

    gen = sub.add_parser("generate", help="generate tokens from a checkpoint")
    gen.add_argument("--model", type=Path, default=None,
                     help="checkpoint directory (default: the embedded tiny model)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (encoded as is)")
    prompt.add_argument("--prompt-ids", type=_parse_ids, help="comma-separated token ids")
    gen.add_argument("--chat", action="store_true",
                     help="wrap --prompt as one user message with the chat template")
    gen.add_argument("--max-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _generate(args: argparse.Namespace) -> int:
    import torch

    from glm53.actors.config import UnsupportedConfigError
    from glm53.actors.loader import DTYPES, load_model, read_config
    from glm53.actors.sequence_runner import generate
    from glm53.actors.weights import CheckpointError

    from .tiny_model import embedded_tiny_model
    from .tokenizer import apply_chat_template, decode, load_tokenizer

    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature must be >= 0 and --top-p in (0, 1]")
    model_dir = args.model or embedded_tiny_model()
    try:
        read_config(model_dir)  # before the tokenizer: a clear error for a non-model directory
        tokenizer = load_tokenizer(model_dir)
        if args.prompt_ids is not None:
            prompt_ids = args.prompt_ids
        elif args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            prompt_ids = apply_chat_template(tokenizer, messages)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
        dtype = DTYPES[args.dtype] if args.dtype else None
        model = load_model(model_dir, dtype=dtype, progress=not args.json)
    except (FileNotFoundError, CheckpointError, UnsupportedConfigError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    vocab = model.config.vocab_size
    if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
        raise SystemExit(f"prompt ids must be non-empty and in [0, {vocab})")
    with torch.inference_mode():
        out = generate(model, prompt_ids, args.max_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, stop_ids=model.config.eos_token_ids)
    text = decode(tokenizer, out)
    if args.json:
        print(json.dumps({"token_ids": out, "text": text}))
    else:
        print(f"prompt ids: {prompt_ids}\ngenerated ids: {out}\ntext: {text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-tiny":
        from .tiny_model import make_tiny

        path = make_tiny(args.out, seed=args.seed, layers=args.layers, mtp=args.mtp)
        print(f"wrote tiny checkpoint to {path}")
        return 0
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
