"""Time to first token of each turn of a long chat replayed turn by turn, with and without the
prefix cache, on one engine in this process (the tiny model on CPU by default).

Turn t's prompt is the whole conversation so far (a long system prompt, then each turn's user
message and the model's answer) plus a new user message, so without the cache every turn
prefills everything again. Reports per turn the TTFT and the prompt tokens served from the
cache, and the KDA checkpoint memory per cached prefix (one state slot on each rank).
`--slice` serves the full-width slice with random weights (slice.py: a config-only checkpoint,
weights drawn on the device) instead, on `--device cuda`.

    python benchmarks/prefix_cache.py [--model DIR | --slice [--experts N]] [--device cuda]
        [--turns 10] [--system 2048] [--message 128] [--answer 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
import torch
from bench_common import git_commit
from slice import random_weights, slice_checkpoint, slice_label

from glm53.actors.step import SamplingParams
from glm53.deployments.tiny_model import make_tiny
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.latency import describe_device


def chat(engine: LLMEngine, turns: int, system: int, message: int, answer: int,
         seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    history = rng.integers(0, vocab, system).tolist()
    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in range(1, turns + 1):
        history += rng.integers(0, vocab, message).tolist()
        start = time.perf_counter()
        rid = engine.add_request(list(history), params)
        request = engine.scheduler.requests[rid]
        ttft = None
        while engine.has_unfinished:
            for out in engine.step():
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - start
                history += out.new_token_ids
        rows.append({"turn": turn, "prompt_tokens": len(request.prompt_ids),
                     "cached_tokens": request.num_cached_tokens, "ttft_ms": 1e3 * ttft})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: a fresh tiny one)")
    ap.add_argument("--slice", action="store_true",
                    help="the full-width slice + MTP, random weights (for --device cuda)")
    ap.add_argument("--experts", type=int, default=288, help="--slice: routed experts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=2048, help="system prompt tokens")
    ap.add_argument("--message", type=int, default=128, help="user tokens per turn")
    ap.add_argument("--answer", type=int, default=32, help="generated tokens per turn")
    ap.add_argument("--interval", type=int, default=512, help="prefix_checkpoint_interval")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--commit", default=None, help="recorded commit (default: git's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="prefix-bench-")
    if args.slice:
        model, label = slice_checkpoint(tmp, args.experts), slice_label(args.experts, mtp=False)
    else:
        model = args.model or str(make_tiny(tmp, seed=3, mtp=True))
        label = "tiny" if args.model is None else args.model
    result = {"commit": args.commit or git_commit(), "device": describe_device(args.device),
              "host": platform.node(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": label, "args": vars(args), "runs": {}}
    for on in (False, True):
        with random_weights() if args.slice else contextlib.nullcontext():
            engine = LLMEngine(EngineConfig(
                model=model, device=args.device, cache_bytes=2**30, block_size=16,
                max_num_seqs=4, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=on, prefix_checkpoint_interval=args.interval))
        rows = chat(engine, args.turns, args.system, args.message, args.answer, seed=0)
        plan = engine.executor.cache_plan
        result["runs"]["on" if on else "off"] = {
            "turns": rows, "last_turn_ttft_ms": rows[-1]["ttft_ms"],
            "checkpoint_bytes_per_prefix": plan.bytes_per_slot if on else None,
            "stats": {k: v for k, v in vars(engine.stats()).items() if k.startswith("prefix")}}
        engine.shutdown()
        del engine
        gc.collect()  # the next engine's weights need this one's memory
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(json.dumps({"prefix_caching": on, "turns": rows}), flush=True)
    off, on = (result["runs"][k]["last_turn_ttft_ms"] for k in ("off", "on"))
    result["last_turn_speedup"] = off / on
    print(json.dumps({"last_turn_ttft_ms": {"off": off, "on": on}, "speedup": off / on}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
