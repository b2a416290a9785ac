"""Parallel layout of one engine's workers and the collectives the model needs.

One process group spans the W ranks of an engine (NCCL on GPU, gloo on CPU). Each of
TP / EP / DCP is either off (size 1: that part is replicated on every rank) or spans all W
ranks: TP shards heads and intermediate/vocab dims, EP partitions the routed experts, DCP
interleaves the latent cache rows (token t lives on rank t mod W). Every parallel dimension
that is on spans the same W ranks, so all collectives use the one group; the `tp_` variants
are no-ops when TP is off (outputs are then already complete on every rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        world = self.world_size
        for name, size in (("tensor", self.tp), ("expert", self.ep), ("decode-context", self.dcp)):
            if size not in (1, world):
                raise ValueError(f"{name}-parallel size {size} must be 1 or the world size "
                                 f"{world}: every parallel dimension spans the same GPUs")

    @property
    def world_size(self) -> int:
        return max(self.tp, self.ep, self.dcp)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the layout (rank 0 of world 1 when nothing is parallel).

    `emulated`: this rank's shapes with no other rank present (the rank-0 emulation of
    performance.md §5.1): collectives do no communication; an all-gather still writes its
    full-size output (world copies of the local part) so the memory traffic stays real."""

    config: ParallelConfig = ParallelConfig()
    rank: int = 0
    emulated: bool = False

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tp_rank(self) -> int:
        return self.rank if self.config.tp > 1 else 0

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def ep_rank(self) -> int:
        return self.rank if self.config.ep > 1 else 0

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def dcp_rank(self) -> int:
        return self.rank if self.config.dcp > 1 else 0

    @property
    def dcp_size(self) -> int:
        return self.config.dcp

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks (in place where possible); identity for one rank."""
        if self.world_size > 1 and not self.emulated:
            dist.all_reduce(x)
        return x

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial outputs of a TP-sharded layer (identity without TP)."""
        return self.all_reduce(x) if self.tp_size > 1 else x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (rank order); identity for one rank."""
        if self.world_size == 1:
            return x
        if self.emulated:
            return torch.cat([x] * self.world_size, dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


def init_process_group(rank: int, world_size: int, address: str, device: torch.device) -> None:
    """Join the engine's process group (`address`: tcp://host:port of rank 0)."""
    if world_size == 1 or dist.is_initialized():
        return
    # NVLink multicast (NVLS) off: on shared hosts it can take GPUs out of service; NCCL reads
    # it when the communicator is created, in this process
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size)


def split(size: int, parts: int, what: str) -> int:
    """size / parts, or a clear error when it does not divide."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by the parallel size {parts}")
    return size // parts
