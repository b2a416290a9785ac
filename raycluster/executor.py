"""Executors run a StepInput on the workers and return rank 0's StepOutput.

`InProcessExecutor` runs one model runner in this process (CPU, tests, single-GPU
benchmarks); `RayExecutor` places one worker actor per GPU and talks to them through a
shared-memory step channel. Ray places, starts and supervises the workers; it is not on the
per-step path.

`execute` runs a step and waits for it; `submit` hands it to a StepPipeline that runs the steps
in submission order and returns at once, so the engine can schedule and build the next step
while this one runs (overlapped scheduling). The runner launches a step on the device before
the one before it is finished: in process through the pipeline's two threads, through the
step channel because the pipeline sends the next step while the workers run this one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from glm53.actors.caches import CachePlan
from glm53.actors.channel import STOP, StepChannel
from glm53.actors.config import ModelConfig
from glm53.actors.model_runner import ModelRunner
from glm53.actors.parallel import ParallelConfig
from glm53.actors.step import StepInput, StepOutput
from glm53.actors.worker import Worker

from .config import EngineConfig

logger = logging.getLogger(__name__)


class Executor(Protocol):
    model_config: ModelConfig
    cache_plan: CachePlan

    def execute(self, step: StepInput) -> StepOutput: ...

    def submit(self, step: StepInput) -> Future[StepOutput]: ...

    def shutdown(self) -> None: ...


class StepPipeline:
    """Runs submitted steps in submission order on two threads: one launches each step
    (`launch`: queue its device work), the other finishes them in order (`finish`: wait for its
    result), so step N+1 is launched while step N still runs and the device does not wait for
    the host work between them. At most two steps are in flight (the runner's input mirrors
    are two), and a step that continues a speculative one (`previous_seqs`) is launched only
    once that one is finished (its tokens are settled from its output). `launch` defaults to
    passing the step through, for executors whose `finish` runs the whole step. Threads start
    on the first submit, so engines that never overlap have none."""

    def __init__(self, finish: Callable, launch: Callable | None = None) -> None:
        self._launch = launch or (lambda step: step)
        self._finish = finish
        self._steps: queue.SimpleQueue | None = None
        self._launched: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, step: StepInput) -> Future[StepOutput]:
        if self._steps is None:
            self._steps = queue.SimpleQueue()
            self._threads = [threading.Thread(target=loop, name=f"glm53-step-{loop.__name__}",
                                              daemon=True)
                             for loop in (self._launch_loop, self._finish_loop)]
            for t in self._threads:
                t.start()
        future: Future[StepOutput] = Future()
        self._steps.put((step, future))
        return future

    def _launch_loop(self) -> None:
        before = last = None  # finish events of the last two steps launched
        while (item := self._steps.get()) is not None:
            step, future = item
            if before is not None:
                before.wait()
            if last is not None and step.previous_seqs is not None:
                last.wait()
            done = threading.Event()
            try:
                launched = self._launch(step)
            except BaseException as exc:  # noqa: BLE001 - the engine reads it from the future
                future.set_exception(exc)
                done.set()
            else:
                self._launched.put((launched, future, done))
            before, last = last, done
        self._launched.put(None)

    def _finish_loop(self) -> None:
        while (item := self._launched.get()) is not None:
            launched, future, done = item
            try:
                future.set_result(self._finish(launched))
            except BaseException as exc:  # noqa: BLE001 - the engine reads it from the future
                future.set_exception(exc)
            finally:
                done.set()

    def shutdown(self) -> None:
        """Finish every submitted step, then stop the threads."""
        if self._steps is not None:
            self._steps.put(None)
            for t in self._threads:
                t.join()
            self._steps = None


def runner_kwargs(config: EngineConfig) -> dict:
    """ModelRunner arguments of one rank (the logical block spans the DCP ranks' rows)."""
    return dict(device=config.device, dtype=config.dtype,
                block_size=config.block_size * config.decode_context_parallel_size,
                num_slots=config.max_num_seqs, num_blocks=config.num_blocks,
                cache_bytes=config.cache_bytes,
                gpu_memory_utilization=config.gpu_memory_utilization,
                quantize_experts=config.quantize_experts,
                kv_cache_dtype=config.kv_cache_dtype, kv_scale_bank=config.kv_scale_bank,
                max_num_batched_tokens=config.max_num_batched_tokens,
                with_mtp=config.with_mtp or config.speculative_method == "mtp",
                with_vision=config.vision,
                num_spec=config.num_speculative_tokens, draft_model=config.draft_model,
                draft_sampling=config.draft_sampling, enforce_eager=config.enforce_eager,
                draft_kv_cache_dtype=config.draft_kv_cache_dtype,
                adaptive_drafts=config.adaptive_drafts,
                cuda_graph_batch_sizes=config.cuda_graph_batch_sizes,
                cuda_graph_context_sizes=config.cuda_graph_context_sizes,
                cuda_graph_max_tokens=config.cuda_graph_max_tokens,
                max_model_len=config.max_model_len,
                num_checkpoints=config.num_prefix_checkpoints)


class InProcessExecutor:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        if config.world_size > 1:
            raise ValueError("the in-process executor runs one rank; use RayExecutor for "
                             "tensor/expert/decode-context parallel sizes > 1")
        self.runner = ModelRunner(config.model, progress=progress, **runner_kwargs(config))
        self.model_config = self.runner.config
        self.cache_plan = self.runner.allocate_caches(self.runner.plan.num_blocks)
        self._thread = StepPipeline(self.runner.finish, self.runner.launch)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def submit(self, step: StepInput) -> Future[StepOutput]:
        return self._thread.submit(step)

    def shutdown(self) -> None:
        self._thread.shutdown()
        del self.runner


class WorkerError(RuntimeError):
    """A worker died, failed a step, or could not start (the message names the rank)."""


class RayExecutor:
    """One Ray actor per GPU in a STRICT_PACK placement group; steps go through the
    shared-memory StepChannel (`channel="shm"`) or plain actor calls (`channel="ray"`, kept
    for the overhead benchmark)."""

    def __init__(self, config: EngineConfig, channel: str = "shm", progress: bool = False,
                 worker_cls: type = Worker) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if channel not in ("shm", "ray"):
            raise ValueError(f"channel must be 'shm' or 'ray', got {channel!r}")
        self.world = config.world_size
        on_gpu = config.device.startswith("cuda")
        if not ray.is_initialized():
            # on CPU the GPUs are fake resources, so the same placement code runs in CI
            ray.init(num_gpus=None if on_gpu else self.world, include_dashboard=False,
                     log_to_driver=progress)
        self._ray = ray
        # the shared-memory channel needs the workers on this (the engine's) node
        here = ray.get_runtime_context().get_node_id()
        self.pg, bundles, self._own_pg = self._placement(ray, here)
        parallel = ParallelConfig(config.tensor_parallel_size, config.expert_parallel_size,
                                  config.decode_context_parallel_size)
        remote = ray.remote(num_cpus=0, num_gpus=1)(worker_cls)
        self.workers = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle)).remote(rank, parallel)
            for rank, bundle in enumerate(bundles)]
        self.channel: StepChannel | None = None
        self._loops: list = []
        # plain actor calls: submitted steps go through execute one at a time, in order
        self._thread = StepPipeline(self.execute)
        try:
            address = ray.get(self.workers[0].rendezvous_address.remote())
            kwargs = runner_kwargs(config)
            setups = self._gather([w.setup.remote(address, config.model, kwargs)
                                   for w in self.workers])
            num_blocks = min(plan.num_blocks for _, plan in setups)
            plans = self._gather([w.allocate_caches.remote(num_blocks) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        self.model_config, self.cache_plan = setups[0][0], plans[0]
        nodes = set(self._gather([w.node_id.remote() for w in self.workers]))
        if channel == "shm" and nodes != {here}:
            logger.warning("workers were placed on another node than the engine; steps go "
                           "through Ray calls (~1 ms more per step) instead of shared memory")
            channel = "ray"
        if channel == "shm":
            self.channel = StepChannel(ranks=self.world)
            self._loops = [w.serve_channel.remote(self.channel.name, self.world)
                           for w in self.workers]
            # the workers launch a step while the one before it runs: submitted steps are
            # sent as soon as the pipeline allows (two unanswered), answers read in order
            self._thread = StepPipeline(self._answer, self._send)

    def _placement(self, ray, node: str) -> tuple[object, list[int], bool]:
        """(placement group, bundle index per rank, whether we created it). A caller that runs
        inside a STRICT_PACK group with enough GPU bundles (a Serve replica that reserved its
        pair) lends its own; otherwise one GPU bundle per rank is reserved near `node`."""
        from ray.util.placement_group import get_current_placement_group, placement_group

        current = get_current_placement_group()
        if current is not None:
            gpu_bundles = [i for i, b in enumerate(current.bundle_specs) if b.get("GPU", 0) >= 1]
            if len(gpu_bundles) >= self.world:
                return current, gpu_bundles[: self.world], False
        pg = placement_group([{"GPU": 1}] * self.world, strategy="STRICT_PACK",
                             _soft_target_node_id=node)
        try:
            ray.get(pg.ready(), timeout=120)
        except Exception as exc:
            ray.util.remove_placement_group(pg)
            raise WorkerError(f"could not place {self.world} GPUs on one node: {exc}") from exc
        return pg, list(range(self.world)), True

    def _gather(self, refs: list) -> list:
        """ray.get that reports the first failing rank's own message."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayTaskError as exc:
            raise WorkerError(str(exc.cause) if exc.cause else str(exc)) from None
        except self._ray.exceptions.RayActorError as exc:
            raise WorkerError(f"a worker died during start-up: {exc}") from None

    def _check_alive(self) -> None:
        ready, _ = self._ray.wait(self._loops, num_returns=1, timeout=0)
        if ready:
            try:
                self._ray.get(ready[0])
            except Exception as exc:
                raise WorkerError(f"rank {self._loops.index(ready[0])} died: "
                                  f"{type(exc).__name__}: {exc}") from None
            raise WorkerError("a worker stopped serving steps")

    def execute(self, step: StepInput) -> StepOutput:
        if self.channel is None:
            return self._gather([w.execute.remote(step) for w in self.workers])[0]
        return self._answer(self._send(step))

    def _send(self, step: StepInput) -> StepInput:
        self.channel.send(step)
        return step

    def _answer(self, step: StepInput) -> StepOutput:
        """Rank 0's answer to the oldest step sent and not answered (`step`)."""
        out = self.channel.receive_response(alive=self._check_alive)
        if isinstance(out, Exception):
            # a peer that died makes rank 0's collective fail: name the dead rank if it is one
            self._ray.wait(self._loops, num_returns=1, timeout=1.0)
            self._check_alive()
            raise WorkerError(str(out))
        return out

    def submit(self, step: StepInput) -> Future[StepOutput]:
        return self._thread.submit(step)

    def parameter_bytes(self) -> list[dict[str, int]]:
        """Per rank: bytes of each parameter (only valid with channel="ray")."""
        return self._gather([w.parameter_bytes.remote() for w in self.workers])

    def shutdown(self) -> None:
        ray = self._ray
        self._thread.shutdown()
        if self.channel is not None:
            self.channel.send(STOP)
            try:
                ray.wait(self._loops, num_returns=len(self._loops), timeout=5)
            finally:
                self.channel.close()
                self.channel = None
        for w in self.workers:
            ray.kill(w)
        if self._own_pg:
            ray.util.remove_placement_group(self.pg)
        self.workers = []


def make_executor(config: EngineConfig, progress: bool = False) -> Executor:
    """The executor for `config`: one rank runs in this process; parallel layouts get one Ray
    actor per GPU. progress: show weight-loading progress."""
    if config.world_size > 1:
        return RayExecutor(config, progress=progress)
    return InProcessExecutor(config, progress=progress)
