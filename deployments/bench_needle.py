"""`glm53 bench needle`: needle-in-a-haystack cells (prompt length x needle depth) through the
engine in this process, a grid of outcomes and a JSON receipt. Prompts and scoring are in
needle.py."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .bench_report import record_header
from .engine_args import add_engine_args, engine_config
from .needle import (
    FILLER,
    NEEDLE,
    QUESTION,
    RAW_FORMAT,
    HaystackBuilder,
    NeedlePrompt,
    needle_codes,
    reasoning_tail,
    score_answer,
    split_reasoning,
)

DEFAULT_DEPTHS = [0.1, 0.5, 0.9]  # the reference runtime's needle depths


def _depths(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated floats: {text!r}") from exc
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"depths must be in [0, 1]: {text!r}")
    return values


def add_needle_parser(kinds, ints) -> None:
    """The `needle` subcommand of `glm53 bench` (`kinds`: bench's subparsers)."""
    nd = kinds.add_parser(
        "needle", help="needle-in-a-haystack recall at chosen prompt lengths and depths",
        description="For each LENGTH x DEPTH cell, a prompt of at most LENGTH tokens (the "
                    "model's tokenizer and chat template) hides an 8-digit code at DEPTH of the "
                    "filler text and asks for it; the engine answers greedily. A cell is a hit "
                    "when the reply (after the reasoning) holds the code; 'no reply' means "
                    "max tokens ran out inside the reasoning. Random-weight checkpoints test "
                    "the mechanics only; recall needs real weights.")
    nd.add_argument("--model", type=Path, default=None,
                    help="checkpoint directory (default: the embedded tiny model)")
    nd.add_argument("--lengths", type=ints, required=True, metavar="N[,N...]",
                    help="prompt tokens of each cell (a ceiling: whole filler sentences)")
    nd.add_argument("--depths", type=_depths, default=DEFAULT_DEPTHS, metavar="D[,D...]",
                    help="needle depths in [0, 1]: 0 before the filler, 1 right before the "
                         "question (default 0.1,0.5,0.9)")
    nd.add_argument("--max-tokens", type=int, default=256,
                    help="generated tokens per cell, reasoning included (default 256)")
    nd.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                    help="end the reasoning after N tokens (the engine forces </think>)")
    nd.add_argument("--no-thinking", dest="thinking", action="store_false",
                    help="render the chat template with thinking off")
    nd.add_argument("--raw", dest="chat", action="store_false",
                    help="no chat template: the raw prompt '{haystack}\\n\\n{question}\\n"
                         "Answer: '")
    nd.add_argument("--seed", type=int, default=0, help="draws the codes")
    nd.add_argument("--json", type=Path, default=None, help="write the receipt here")
    add_engine_args(nd, max_num_seqs=1,
                    max_num_seqs_help="cells run at once (default 1: one after another)",
                    max_model_len_help="default: the longest cell plus --max-tokens",
                    prefix_caching_help="cells of one length share their filler up to the needle")

@dataclass
class _Cell:
    prompt: NeedlePrompt
    request_id: str = ""
    output_ids: list[int] | None = None
    finish_reason: str | None = None
    seconds: float | None = None


def _context_limit(args: argparse.Namespace, model_dir: Path) -> int:
    """Refuse cells the model cannot hold before anything loads."""
    from glm53.raycluster.api import read_config

    context = read_config(model_dir).max_position_embeddings
    limit = min(context, args.max_model_len or context)
    need = max(args.lengths) + args.max_tokens
    if need > limit:
        what = ("--max-model-len" if args.max_model_len and args.max_model_len < context
                else "the model's context (max_position_embeddings)")
        raise SystemExit(f"error: the longest cell, {max(args.lengths)} prompt tokens + "
                         f"--max-tokens {args.max_tokens} = {need}, exceeds {what}: {limit} "
                         "tokens")
    return need


def build_prompts(args: argparse.Namespace, tokenizer) -> tuple[HaystackBuilder, list[_Cell]]:
    builder = HaystackBuilder(tokenizer, chat=args.chat, thinking=args.thinking)
    grid = [(n, d) for n in args.lengths for d in args.depths]
    codes = needle_codes(len(grid), args.seed)
    return builder, [_Cell(builder.build(n, d, code)) for (n, d), code in zip(grid, codes,
                                                                              strict=True)]


def _engine(args: argparse.Namespace, model_dir: Path, max_model_len: int, tokenizer):
    from glm53.raycluster.api import LLMEngine, OutputConstraints, make_executor

    from .chat import THINK_END

    config = engine_config(args, model_dir,
                           max_model_len=args.max_model_len or max_model_len)
    executor = make_executor(config)
    try:
        constraints = None
        if args.thinking_budget is not None:  # only then: it compiles the vocabulary
            mc = executor.model_config
            constraints = OutputConstraints.from_tokenizer(
                tokenizer, mc.vocab_size, mc.eos_token_ids,
                tokenizer.get_added_vocab().get(THINK_END))
        return LLMEngine(config, executor, constraints)
    except BaseException:
        executor.shutdown()
        raise


def run_cells(engine, cells: list[_Cell], args: argparse.Namespace) -> None:
    """Queue every cell (the engine runs --max-num-seqs at once), greedy, to completion."""
    from glm53.raycluster.api import EngineDeadError, FinishReason, SamplingParams

    by_id = {}
    for cell in cells:
        reasoning = cell.prompt.opens_reasoning
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                reasoning=reasoning,
                                thinking_budget=args.thinking_budget if reasoning else None)
        cell.request_id = engine.add_request(cell.prompt.ids, params)
        cell.output_ids = []
        by_id[cell.request_id] = cell
    while engine.has_unfinished:
        for out in engine.step():
            if out.finish_reason == FinishReason.ERROR:
                raise EngineDeadError(out.error)
            cell = by_id[out.request_id]
            cell.output_ids.extend(out.new_token_ids)
            if out.finished:
                cell.finish_reason = str(out.finish_reason)
                timing = out.timing
                if timing is not None and timing.first_scheduled is not None:
                    cell.seconds = round((timing.finished or time.monotonic())
                                         - timing.first_scheduled, 3)


def cell_record(cell: _Cell, tokenizer, eos_ids) -> dict:
    """One cell of the receipt: where the needle landed, the answer and its score."""
    from .chat import THINK_END, THINK_START
    from .tokenizer import decode

    vocab = tokenizer.get_added_vocab()
    out = [t for t in cell.output_ids if t not in eos_ids]
    reasoning_ids, reply_ids = split_reasoning(out, cell.prompt.opens_reasoning,
                                               vocab.get(THINK_START), vocab.get(THINK_END))
    reasoning = decode(tokenizer, reasoning_ids, skip_special=True)
    reply = decode(tokenizer, reply_ids, skip_special=True).strip()
    score = score_answer(reply, reasoning, cell.prompt.code, cell.finish_reason or "")
    p = cell.prompt
    return {"length": p.length, "depth": p.depth, "code": p.code,
            "prompt_tokens": len(p.ids), "filler_sentences": p.filler_sentences,
            "needle_tokens": list(p.needle), "needle_depth": round(p.needle_depth, 4),
            "prompt_sha256": hashlib.sha256(json.dumps(p.ids).encode()).hexdigest(),
            "outcome": score.outcome, "hit": score.hit, "reasoning_hit": score.reasoning_hit,
            "completion_tokens": len(cell.output_ids), "finish_reason": cell.finish_reason,
            "reply": reply, "reasoning_chars": len(reasoning),
            "reasoning_tail": reasoning_tail(reasoning),
            "output": decode(tokenizer, cell.output_ids), "seconds": cell.seconds}


def grid_table(rows: list[dict], lengths: list[int], depths: list[float]) -> str:
    """Lengths down, depths across; each cell HIT / miss / no reply."""
    cell = {(r["length"], r["depth"]): r for r in rows}
    lines = [["length \\ depth", *(f"{d:g}" for d in depths)]]
    for n in lengths:
        lines.append([str(n), *(_label(cell[n, d]) for d in depths)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(t.rjust(w) for t, w in zip(line, widths, strict=True))
                     for line in lines)


def _label(row: dict) -> str:
    return {"hit": "HIT", "miss": "miss", "unanswered": "no reply"}[row["outcome"]]


def _manifest_digest(model_dir: Path) -> str | None:
    from .provenance import ProvenanceError, read_manifest

    try:
        manifest = read_manifest(model_dir)
    except ProvenanceError:
        return None
    return manifest.digest if manifest is not None else None


def bench_needle(args: argparse.Namespace) -> int:
    from glm53.raycluster.api import (
        CheckpointError,
        EngineDeadError,
        RequestRejectedError,
        UnsupportedConfigError,
        WorkerError,
        describe_device,
    )

    from .tiny_model import embedded_tiny_model
    from .tokenizer import load_tokenizer

    if args.max_tokens < 1:
        raise SystemExit("error: --max-tokens must be >= 1")
    model_dir = args.model or embedded_tiny_model()
    try:
        max_model_len = _context_limit(args, model_dir)
        tokenizer = load_tokenizer(model_dir)
        builder, cells = build_prompts(args, tokenizer)
        engine = _engine(args, model_dir, max_model_len, tokenizer)
        try:
            run_cells(engine, cells, args)
            eos_ids = set(engine.eos_ids)
        finally:
            engine.shutdown()
    except (FileNotFoundError, CheckpointError, UnsupportedConfigError, RequestRejectedError,
            WorkerError, EngineDeadError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    rows = [cell_record(c, tokenizer, eos_ids) for c in cells]
    for r in rows:
        print(f"length {r['length']:>7} depth {r['depth']:<4g} prompt_tokens "
              f"{r['prompt_tokens']:>7} {_label(r):<8} ({r['seconds']}s) reply={r['reply']!r}",
              file=sys.stderr)
    passed = sum(r["hit"] for r in rows)
    print(grid_table(rows, args.lengths, args.depths))
    print(f"{passed}/{len(rows)} needles recovered ({builder.format} prompts)")
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                  if k not in ("command", "bench", "json", "model", "speculative")}
        config["speculative"] = args.speculative._asdict()
        record = record_header(
            "needle", device=describe_device(args.device), model=str(model_dir),
            model_manifest_digest=_manifest_digest(model_dir), config=config,
            prompt_format=builder.format, needle=NEEDLE, question=QUESTION,
            raw_format=RAW_FORMAT, filler_sha256=hashlib.sha256(
                "\n".join(FILLER).encode()).hexdigest(),
            passed=passed, total=len(rows), results=rows)
        args.json.write_text(json.dumps(record, indent=2))
    return 0
