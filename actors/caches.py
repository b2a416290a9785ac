"""Per-layer inference state of GLM-5.3-Flash, allocated once per worker.

KDA layers keep fixed-size state per sequence in *state slots* (recurrent state + short-conv
window). DSA layers (and the MTP layer) keep per-token state in *paged blocks* (MLA latent rows
and pooled indexer keys, one pooled key per `index_kpool` tokens) plus the raw indexer rows of
the open pool in the sequence's state slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KDA, ModelConfig


@dataclass(frozen=True)
class KDAState:
    conv: torch.Tensor  # [slots, 3 * linear_dim, conv_kernel - 1], pre-conv q|k|v inputs
    recurrent: torch.Tensor  # [slots, heads, dk, dv] fp32


@dataclass(frozen=True)
class DSAState:
    latent: torch.Tensor  # [blocks, block_size, kv_lora_rank]
    pool_keys: torch.Tensor  # [blocks, block_size // kpool, index_head_dim]
    open_rows: torch.Tensor  # [slots, kpool, 2 * index_head_dim] raw key | pooling logit


def _dsa_state(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
               dtype: torch.dtype, device: torch.device | str) -> DSAState:
    return DSAState(
        latent=torch.zeros(num_blocks, block_size, cfg.kv_lora_rank, dtype=dtype, device=device),
        pool_keys=torch.zeros(num_blocks, block_size // cfg.index_kpool, cfg.index_head_dim,
                              dtype=dtype, device=device),
        open_rows=torch.zeros(num_slots, cfg.index_kpool, 2 * cfg.index_head_dim, dtype=dtype,
                              device=device),
    )


@dataclass(frozen=True)
class ModelCaches:
    """State for every trunk layer (index = layer id) and, optionally, the MTP layer."""

    layers: tuple[KDAState | DSAState, ...]
    mtp: DSAState | None
    block_size: int

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
    ) -> ModelCaches:
        if block_size % cfg.index_kpool:
            raise ValueError(
                f"block_size {block_size} must be a multiple of index_kpool {cfg.index_kpool}")
        layers: list[KDAState | DSAState] = []
        for kind in cfg.layer_types:
            if kind == KDA:
                layers.append(KDAState(
                    conv=torch.zeros(num_slots, 3 * cfg.linear_dim, cfg.linear_conv_kernel - 1,
                                     dtype=dtype, device=device),
                    recurrent=torch.zeros(num_slots, cfg.linear_num_heads, cfg.linear_head_dim,
                                          cfg.linear_head_dim, dtype=torch.float32,
                                          device=device),
                ))
            else:
                layers.append(_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device))
        mtp = (_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device)
               if with_mtp else None)
        return cls(layers=tuple(layers), mtp=mtp, block_size=block_size)
