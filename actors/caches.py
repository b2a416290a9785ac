"""Per-layer inference state of GLM-5.3-Flash, allocated once per worker.

KDA layers keep fixed-size state per sequence in *state slots* (recurrent state + short-conv
window). DSA layers (and the MTP layer) keep per-token state in *paged blocks* (MLA latent rows
and pooled indexer keys, one pooled key per `index_kpool` tokens) plus the raw indexer rows of
the open pool in the sequence's state slot.

All sizes here are this rank's: KDA heads / tp, and under DCP a block of `block_size` logical
tokens keeps block_size / dcp latent rows per rank (pooled keys stay replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KDA, ModelConfig
from .parallel import ParallelState, split


@dataclass(frozen=True)
class KDAState:
    conv: torch.Tensor  # [slots, 3 * linear_dim, conv_kernel - 1], pre-conv q|k|v inputs
    recurrent: torch.Tensor  # [slots, heads, dk, dv] fp32


@dataclass(frozen=True)
class DSAState:
    latent: torch.Tensor  # [blocks, block_size, kv_lora_rank]
    pool_keys: torch.Tensor  # [blocks, block_size // kpool, index_head_dim]
    open_rows: torch.Tensor  # [slots, ring, 2 * index_head_dim] raw key | pooling logit


def open_ring_size(cfg: ModelConfig, num_spec: int) -> int:
    """Rows of the per-slot indexer ring: the open pool plus the drafts a step may reject."""
    return cfg.index_kpool * -(-(cfg.index_kpool + num_spec) // cfg.index_kpool)


def _dsa_state(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
               dtype: torch.dtype, device: torch.device | str, dcp: int,
               num_spec: int) -> DSAState:
    return DSAState(
        latent=torch.zeros(num_blocks, block_size // dcp, cfg.kv_lora_rank, dtype=dtype,
                           device=device),
        pool_keys=torch.zeros(num_blocks, block_size // cfg.index_kpool, cfg.index_head_dim,
                              dtype=dtype, device=device),
        open_rows=torch.zeros(num_slots, open_ring_size(cfg, num_spec), 2 * cfg.index_head_dim,
                              dtype=dtype, device=device),
    )


@dataclass(frozen=True)
class ModelCaches:
    """State for every trunk layer (index = layer id) and, optionally, the MTP layer."""

    layers: tuple[KDAState | DSAState, ...]
    mtp: DSAState | None
    block_size: int  # logical tokens per block

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        with_mtp: bool = False,
        ps: ParallelState | None = None,
        num_spec: int = 0,
    ) -> ModelCaches:
        """`block_size` counts logical tokens per block (a multiple of index_kpool and of the
        DCP size)."""
        ps = ps or ParallelState()
        _check_block_size(cfg, block_size, ps.dcp_size)
        heads = split(cfg.linear_num_heads, ps.tp_size, "linear_num_heads")
        layers: list[KDAState | DSAState] = []
        for kind in cfg.layer_types:
            if kind == KDA:
                layers.append(KDAState(
                    conv=torch.zeros(num_slots, 3 * heads * cfg.linear_head_dim,
                                     cfg.linear_conv_kernel - 1, dtype=dtype, device=device),
                    recurrent=torch.zeros(num_slots, heads, cfg.linear_head_dim,
                                          cfg.linear_head_dim, dtype=torch.float32,
                                          device=device),
                ))
            else:
                layers.append(_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device,
                                         ps.dcp_size, num_spec))
        mtp = (_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device, ps.dcp_size,
                          num_spec) if with_mtp else None)
        return cls(layers=tuple(layers), mtp=mtp, block_size=block_size)


def copy_state_slots(caches: ModelCaches, copies) -> None:
    """Copy the KDA state (recurrent state + conv windows) of slot src into slot dst for each
    (src, dst) row of `copies`, in order (a checkpoint is saved before its slot is reused).
    The DSA open-pool rows are not copied: checkpoints sit at block boundaries, which are pool
    boundaries, where the open pool is empty. Every rank copies its own shard."""
    for src, dst in copies.tolist():
        for state in caches.layers:
            if isinstance(state, KDAState):
                state.conv[dst].copy_(state.conv[src])
                state.recurrent[dst].copy_(state.recurrent[src])


def _check_block_size(cfg: ModelConfig, block_size: int, dcp: int) -> None:
    if block_size % cfg.index_kpool or block_size % dcp:
        raise ValueError(f"block_size {block_size} must be a multiple of index_kpool "
                         f"{cfg.index_kpool} and of the DCP size {dcp}")


@dataclass(frozen=True)
class CachePlan:
    """How many paged blocks and state slots a worker allocates, and what they cost."""

    num_blocks: int  # including the null block 0
    block_size: int  # logical tokens per block (latent rows per rank = block_size / dcp)
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    # where the rank's device memory goes (MemoryPlan.describe), when it was planned (CUDA)
    memory_plan: str | None = None
    # prefix-cache checkpoints of the KDA state: slots after the running ones and the graph
    # padding slot (num_slots + 1 + i), paid by the same per-slot price
    num_checkpoints: int = 0

    def checkpoint_slot(self, index: int) -> int:
        """State slot id of checkpoint `index` (0 <= index < num_checkpoints)."""
        if not 0 <= index < self.num_checkpoints:
            raise ValueError(f"checkpoint {index} out of range 0..{self.num_checkpoints - 1}")
        return self.num_slots + 1 + index

    @property
    def num_tokens(self) -> int:
        """Token capacity of the usable blocks (the null block holds nothing)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block
                + (self.num_slots + self.num_checkpoints) * self.bytes_per_slot)

    def describe(self, max_model_len: int) -> str:
        text = (f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({self.num_tokens // max_model_len} sequences of "
                f"max_model_len {max_model_len}); {self.num_slots} KDA state slots"
                + (f" + {self.num_checkpoints} prefix checkpoints" if self.num_checkpoints
                   else "") + f"; {self.total_bytes / 2**20:.1f} MiB")
        return f"{text}\n{self.memory_plan}" if self.memory_plan else text


def cache_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, with_mtp: bool,
                ps: ParallelState | None = None, num_spec: int = 0) -> tuple[int, int]:
    """(bytes per paged block, bytes per state slot) over all layers, on one rank."""
    ps = ps or ParallelState()
    item = torch.empty(0, dtype=dtype).element_size()
    n_dsa = len(cfg.dsa_layers) + int(with_mtp)
    per_block = n_dsa * item * (block_size // ps.dcp_size * cfg.kv_lora_rank
                                + block_size // cfg.index_kpool * cfg.index_head_dim)
    heads = cfg.linear_num_heads // ps.tp_size
    kda_slot = (3 * heads * cfg.linear_head_dim * (cfg.linear_conv_kernel - 1) * item
                + heads * cfg.linear_head_dim**2 * 4)
    open_pool = open_ring_size(cfg, num_spec) * 2 * cfg.index_head_dim * item
    per_slot = len(cfg.kda_layers) * kda_slot + n_dsa * open_pool
    return per_block, per_slot


def plan_cache(cfg: ModelConfig, block_size: int, num_slots: int, dtype: torch.dtype,
               with_mtp: bool, *, num_blocks: int | None = None,
               budget_bytes: int | None = None, ps: ParallelState | None = None,
               num_spec: int = 0) -> CachePlan:
    """Size one rank's caches from an explicit block count or a byte budget (slots are paid
    first). `block_size` counts logical tokens per block."""
    ps = ps or ParallelState()
    _check_block_size(cfg, block_size, ps.dcp_size)
    per_block, per_slot = cache_bytes(cfg, block_size, dtype, with_mtp, ps, num_spec)
    if (num_blocks is None) == (budget_bytes is None):
        raise ValueError("give exactly one of num_blocks or budget_bytes")
    if num_blocks is None:
        num_blocks = (budget_bytes - num_slots * per_slot) // per_block
    if num_blocks < 2:
        raise ValueError(f"cache budget too small: {num_blocks} blocks (need >= 2: one is the "
                         f"null block); a block costs {per_block} B, a state slot {per_slot} B")
    return CachePlan(num_blocks, block_size, num_slots, per_block, per_slot)
