"""Executors run a StepInput on the workers and return rank 0's StepOutput.

`InProcessExecutor` runs one model runner in this process (CPU, tests, single-GPU
benchmarks); the Ray executor (one actor per GPU) implements the same interface.
"""

from __future__ import annotations

from typing import Protocol

from glm53.actors.caches import CachePlan
from glm53.actors.config import ModelConfig
from glm53.actors.model_runner import ModelRunner
from glm53.actors.step import StepInput, StepOutput

from .config import EngineConfig


class Executor(Protocol):
    model_config: ModelConfig
    cache_plan: CachePlan

    def execute(self, step: StepInput) -> StepOutput: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.runner = ModelRunner(
            config.model, device=config.device, dtype=config.dtype,
            block_size=config.block_size, num_slots=config.max_num_seqs,
            num_blocks=config.num_blocks, cache_bytes=config.cache_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization, with_mtp=config.with_mtp,
            progress=progress)
        self.model_config = self.runner.config
        self.cache_plan = self.runner.plan

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        del self.runner
