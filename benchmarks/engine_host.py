"""Host time of one engine step (schedule -> StepInput -> results -> outputs), no model.

The executor answers every step at once with a fixed token, so what is timed is the engine's
own Python: scheduling, building the StepInput (token ids, block tables, sampling rows) and
applying the results. Decode steps of B sequences of an L-token prompt, N steps after the last
prompt finished (earlier ones have more outputs), since work that grows with the context or
the output shows up only there.

    python benchmarks/engine_host.py [--cases 1x2000x50,64x2000x2000,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime

import numpy as np
from bench_common import git_commit

from glm53.actors.caches import CachePlan
from glm53.actors.config import ModelConfig
from glm53.actors.step import SamplingParams, StepInput, StepOutput
from glm53.actors.tiny import tiny_text_config
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

BLOCK = 64
BUDGET = 16384  # prefill tokens a step


class InstantExecutor:
    """Samples token 7 for every sample row, immediately."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.model_config = ModelConfig.from_hf(
            tiny_text_config(max_position_embeddings=202752, vocab_size=154880))
        self.cache_plan = CachePlan(num_blocks=num_blocks, block_size=BLOCK, num_slots=num_slots,
                                    bytes_per_block=1, bytes_per_slot=1)

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput(step.step_id, np.full(len(step.sample_rows), 7, np.int64))

    def shutdown(self) -> None:
        pass


def decode_step_us(batch: int, prompt: int, outputs: int, steps: int) -> float:
    """Median host time of a decode step (us), `outputs` steps after every prompt is in."""
    prefill_steps = -(-batch * prompt // BUDGET)
    max_tokens = prefill_steps + outputs + steps + 1
    blocks = batch * -(-(prompt + max_tokens) // BLOCK) + 1
    engine = LLMEngine(EngineConfig(model="unused", max_num_seqs=batch,
                                    max_num_batched_tokens=BUDGET),
                       InstantExecutor(blocks, batch + 1))
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, 1000, prompt).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          temperature=0.0))
    requests = list(engine.scheduler.requests.values())
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in requests):
        engine.step()
    for _ in range(outputs):
        engine.step()
    if len(engine.scheduler.requests) != batch:
        raise RuntimeError("requests finished before the timed steps: raise max_tokens")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases",
                        default="1x2000x50,64x2000x50,64x2000x2000,64x32000x50,64x128000x50",
                        help="BATCHxPROMPTxOUTPUTS, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        batch, prompt, outputs = (int(v) for v in case.split("x"))
        us = decode_step_us(batch, prompt, outputs, args.steps)
        results.append(dict(batch=batch, prompt=prompt, outputs=outputs, step_us=us))
        print(f"batch {batch} prompt {prompt} outputs {outputs}: {us:.0f} us a step",
              flush=True)
    if args.json:
        record = {"benchmark": "engine_host", "host": platform.node(), "commit": git_commit(),
                  "date": datetime.now(UTC).isoformat(timespec="seconds"), "steps": args.steps,
                  "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
