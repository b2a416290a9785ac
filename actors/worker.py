"""Worker: one per GPU (one per fake GPU on CPU). Joins the engine's process group, loads only
its shard, allocates its caches, and executes steps -- called directly, or in a loop that
serves the shared-memory step channel. The executor wraps it as a Ray actor."""

from __future__ import annotations

import logging
import socket
import traceback

import torch

from .caches import CachePlan
from .channel import ChannelClosed, StepChannel
from .config import ModelConfig
from .model_runner import ModelRunner
from .parallel import ParallelConfig, ParallelState, init_process_group
from .step import StepInput, StepOutput

logger = logging.getLogger(__name__)


class WorkerStartupError(RuntimeError):
    """A rank failed to start: the message names the rank and the cause."""


def free_address() -> str:
    """tcp://<this host>:<free port>, for rank 0 to host the process-group rendezvous."""
    host = socket.gethostbyname(socket.gethostname()) if torch.cuda.is_available() else (
        "127.0.0.1")
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class Worker:
    def __init__(self, rank: int, parallel: ParallelConfig) -> None:
        self.rank, self.parallel = rank, parallel
        self.runner: ModelRunner | None = None

    def rendezvous_address(self) -> str:
        return free_address()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, address: str, model_dir: str, runner_kwargs: dict) -> tuple[ModelConfig,
                                                                                CachePlan]:
        """Join the group, load this rank's shard, and return (config, what it could hold)."""
        try:
            device = runner_kwargs.get("device", "cpu")
            if str(device).startswith("cuda"):
                torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
                runner_kwargs = {**runner_kwargs, "device": "cuda:0"}
            init_process_group(self.rank, self.parallel.world_size, address,
                               torch.device(runner_kwargs.get("device", "cpu")))
            ps = ParallelState(self.parallel, self.rank)
            self.runner = ModelRunner(model_dir, ps=ps, **runner_kwargs)
            return self.runner.config, self.runner.plan
        except Exception as exc:
            raise WorkerStartupError(f"rank {self.rank} failed to start: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def allocate_caches(self, num_blocks: int) -> CachePlan:
        try:
            return self.runner.allocate_caches(num_blocks)
        except Exception as exc:
            raise WorkerStartupError(f"rank {self.rank} failed to allocate its caches: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def execute(self, step: StepInput) -> StepOutput | None:
        return self.runner.execute(step)

    def serve_channel(self, name: str, ranks: int) -> str:
        """Execute steps from the shared-memory channel (of `ranks` workers) until the engine
        closes it. A step is launched as soon as it arrives, before the step in flight is
        finished (ModelRunner.launch / finish), unless it continues a speculative step of it;
        rank 0 answers each step in order. Returns "closed"; a failing step is reported to the
        engine (rank 0) and re-raised."""
        channel = StepChannel(name, create=False, ranks=ranks, rank=self.rank)
        pending = None  # the launched step not yet finished
        try:
            while True:
                # the next step arrives, or the one in flight ends first: answer it now
                if pending is not None and not channel.wait_request(or_until=pending.done):
                    self._answer(channel, self.runner.finish(pending))
                    pending = None
                try:
                    step = channel.receive_request()
                except ChannelClosed:
                    return "closed"
                try:
                    if pending is not None and step.previous_seqs is not None:
                        self._answer(channel, self.runner.finish(pending))
                        pending = None
                    launched = self.runner.launch(step)
                    if pending is not None:
                        self._answer(channel, self.runner.finish(pending))
                    pending = launched
                except Exception as exc:
                    if self.rank == 0:
                        channel.respond(RuntimeError(
                            f"rank {self.rank} failed a step: {type(exc).__name__}: {exc}\n"
                            f"{traceback.format_exc()}"))
                    raise
        finally:
            channel.close()

    def _answer(self, channel: StepChannel, out: StepOutput | None) -> None:
        if self.rank == 0:
            channel.respond(out)

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of each parameter on this rank (tests check the sharding)."""
        return {n: p.numel() * p.element_size()
                for n, p in self.runner.model.named_parameters()}
