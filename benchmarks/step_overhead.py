"""Per-step host overhead of the executor: engine -> all ranks -> engine, with an empty model.

Compares plain Ray actor calls with the shared-memory step channel for TP1 and TP2 (fake GPUs
on CPU, real ones on a GPU host) using a decode-sized StepInput, and prints (and optionally
records) the median / p90 round trip.

    python benchmarks/step_overhead.py [--steps 2000] [--seqs 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from datetime import UTC, datetime

import numpy as np
import ray
from bench_common import git_commit

from glm53.actors.caches import CachePlan
from glm53.actors.sampler import build_sampling_inputs
from glm53.actors.step import SamplingParams, StepInput, StepOutput
from glm53.actors.worker import Worker
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.executor import RayExecutor


class EmptyWorker(Worker):
    """A worker whose 'model' does nothing: only the channel and the call path are timed."""

    def setup(self, address, model_dir, runner_kwargs):
        return None, CachePlan(num_blocks=1024, block_size=16, num_slots=64, bytes_per_block=1,
                               bytes_per_slot=1)

    def allocate_caches(self, num_blocks):
        return CachePlan(num_blocks, 16, 64, 1, 1)

    def execute(self, step):
        return self._answer(step)

    def _answer(self, step: StepInput) -> StepOutput | None:
        return StepOutput(step.step_id, np.zeros(len(step.sample_rows), np.int64)) if (
            self.rank == 0) else None

    def serve_channel(self, name):
        self.runner = self  # the channel loop calls runner.execute
        return super().serve_channel(name)


def decode_step(n_seqs: int, blocks_per_seq: int = 16) -> StepInput:
    """A decode step of n_seqs sequences (one token each), like the engine builds."""
    rows = [(SamplingParams(temperature=0.7, top_p=0.9), i, 5, (), (), ()) for i in range(n_seqs)]
    return StepInput(
        step_id=0, request_ids=[f"req-{i}" for i in range(n_seqs)],
        token_ids=np.arange(n_seqs, dtype=np.int64),
        positions=np.full(n_seqs, 200, np.int64),
        cu_seqlens=np.arange(n_seqs + 1, dtype=np.int64),
        block_tables=np.arange(n_seqs * blocks_per_seq, dtype=np.int32).reshape(n_seqs, -1),
        slot_mapping=np.arange(n_seqs, dtype=np.int64), state_ids=np.arange(n_seqs),
        sample_rows=np.arange(n_seqs), sample_seqs=np.arange(n_seqs),
        sampling=build_sampling_inputs(rows))


def measure(executor: RayExecutor, step: StepInput, steps: int) -> dict[str, float]:
    for _ in range(50):
        executor.execute(step)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        executor.execute(step)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "mean_ms": float(ms.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    ray.init(num_gpus=None if on_gpu else 2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    step = decode_step(args.seqs)
    payload = len(__import__("pickle").dumps(step))
    results = []
    for tp in (1, 2):
        for channel in ("ray", "shm"):
            config = EngineConfig(model="unused", device=args.device, tensor_parallel_size=tp)
            executor = RayExecutor(config, channel=channel, worker_cls=EmptyWorker)
            try:
                stats = measure(executor, step, args.steps)
            finally:
                executor.shutdown()
            results.append({"tp": tp, "channel": channel, **stats})
            print(f"TP{tp} {channel:>3}: median {stats['median_ms']:.3f} ms  "
                  f"p90 {stats['p90_ms']:.3f} ms  ({payload} B StepInput)", flush=True)
    if args.json:
        commit = git_commit()
        record = {"benchmark": "step_overhead", "device": args.device,
                  "host": platform.node(), "commit": commit,
                  "date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "payload_bytes": payload, "steps": args.steps, "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
