"""The routed experts of one MoE layer, in the storage format the config names.

- `DenseExperts`: stacked model-dtype weights, w13 [E, 2I, D] (gate rows, then up) and
  w2 [E, D, I] (`ops.fused_moe`).
- `Exl3Experts`: the checkpoint's EXL3 trellis codes and scale vectors, never dequantised to a
  full copy (`ops.moe_exl3`); exllamav3's convention W (in, out), y = x @ W.
- `Int4Experts`: dense or FP8 checkpoint weights quantised while loading to 4-bit codes with a
  scale and zero per group of `group_size` input columns (`ops.moe_int4`).

Every rank holds `n_local` experts starting at `expert_offset` (EP) or, without EP, every expert
with its intermediate TP-sharded (gate/up output features, down input features). Parameters
record how they were cut from the checkpoint tensor (`mark_shard`, checkpoint coordinates
without the expert index) and, where gate and up share one parameter, along which dim the two
parts are stacked (`part_dim`), so the weight loader fills them without knowing the format.
"""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..config import EXPERT_FORMATS, ModelConfig
from ..parallel import ParallelState, split
from .linear import mark_shard

HADAMARD_BLOCK = 128  # EXL3 rotates features in 128-blocks: shards never cut inside one
INT4_GROUP = 128


def _check_width(what: str, name: str, size: int, multiple: int, why: str) -> None:
    if size % multiple or size == 0:
        raise ValueError(f"{what} need {name} ({size}) to be a multiple of {multiple} {why}")


def _param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _expert_param(p: nn.Parameter, offset: int, shard_dim: int | None, rank: int, size: int,
                  part_dim: int = 0) -> nn.Parameter:
    p.expert_offset, p.part_dim = offset, part_dim
    return mark_shard(p, shard_dim, rank, size)


class RoutedExperts(nn.Module):
    """Base: which experts this rank holds and how their intermediate is split."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.n_local = split(cfg.n_routed_experts, ps.ep_size, "n_routed_experts")
        self.num_experts = cfg.n_routed_experts
        self.expert_offset = ps.ep_rank * self.n_local
        # without EP, the experts' intermediate is TP-sharded (gate and up rows, down columns)
        self.tp = ps.tp_size if ps.ep_size == 1 else 1
        self.tp_rank = ps.tp_rank if ps.ep_size == 1 else 0
        self.inter = split(cfg.moe_intermediate_size, self.tp, "moe_intermediate_size")
        self.hidden = cfg.hidden_size
        self.limit = cfg.swiglu_limit
        # forward returns a partial sum that the ranks add up
        self.partial = ps.ep_size > 1 or self.tp > 1

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                defer_reduce: bool = False) -> torch.Tensor:
        """x: [T, D]; weights, ids: [T, k] (global ids). Returns this rank's share [T, D], or
        with `defer_reduce` possibly its last sum not yet taken (for `ops.linear`'s `add`
        only: the int4 kernels' `PairRows`)."""
        raise NotImplementedError


class DenseExperts(RoutedExperts):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps)
        e, d, i = self.n_local, self.hidden, self.inter
        self.w13 = _expert_param(_param((e, 2 * i, d)), self.expert_offset, 0, self.tp_rank,
                                 self.tp)
        self.w2 = _expert_param(_param((e, d, i)), self.expert_offset, 1, self.tp_rank, self.tp)

    def forward(self, x, weights, ids, defer_reduce=False):
        return ops.fused_moe(x, self.w13, self.w2, weights, ids, self.limit, self.expert_offset)


class Exl3Experts(RoutedExperts):
    """EXL3 codes at `cfg.exl3_bits` bits: trellis [in/16, out/16, 16 K] int16 per projection,
    suh [in] and svh [out] fp16. Gate and up are stacked along the output tiles of w13_trellis
    and along w13_suh / w13_svh (gate first)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps)
        if not 1 <= cfg.exl3_bits <= 8:
            raise ValueError(f"EXL3 experts need 1..8 bits per weight, got {cfg.exl3_bits}")
        e, d, i, words = self.n_local, self.hidden, self.inter, 16 * cfg.exl3_bits
        _check_width("EXL3 experts", "hidden_size", d, HADAMARD_BLOCK, "(the Hadamard block)")
        _check_width("EXL3 experts", "moe_intermediate_size / TP", i, HADAMARD_BLOCK,
                     "(the Hadamard block); shard experts with EP instead of TP")
        off, r, n = self.expert_offset, self.tp_rank, self.tp
        half = torch.float16
        # gate/up are column-parallel: trellis cut along its output tiles, svh with it
        self.w13_trellis = _expert_param(_param((e, d // 16, 2 * i // 16, words), torch.int16),
                                         off, 1, r, n, part_dim=1)
        self.w13_suh = _expert_param(_param((e, 2 * d), half), off, None, r, n)
        self.w13_svh = _expert_param(_param((e, 2 * i), half), off, 0, r, n)
        # down is row-parallel: trellis cut along its input tiles, suh with it
        self.w2_trellis = _expert_param(_param((e, i // 16, d // 16, words), torch.int16), off,
                                        0, r, n)
        self.w2_suh = _expert_param(_param((e, i), half), off, 0, r, n)
        self.w2_svh = _expert_param(_param((e, d), half), off, None, r, n)
        self.codebook = cfg.exl3_codebook

    def forward(self, x, weights, ids, defer_reduce=False):
        return ops.moe_exl3(x, self.w13_trellis, self.w13_suh.view(self.n_local, 2, self.hidden),
                            self.w13_svh, self.w2_trellis, self.w2_suh, self.w2_svh, weights,
                            ids, self.limit, self.expert_offset, self.codebook)


class Int4Experts(RoutedExperts):
    """4-bit codes [out, in / 2] uint8 (two per byte along the input) with fp16 scale and zero
    per `group_size` input columns; filled by `load_dense` from the checkpoint's weights."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg, ps)
        e, d, i = self.n_local, self.hidden, self.inter
        # one group size for both projections, from the full (unsharded) widths, so every
        # parallel layout quantises identically
        self.group_size = min(INT4_GROUP, d, cfg.moe_intermediate_size)
        g = self.group_size
        _check_width("int4 experts", "hidden_size", d, g, "(the group size)")
        _check_width("int4 experts", "moe_intermediate_size / TP", i, g,
                     "(the group size); shard experts with EP instead of TP")
        off, r, n, u8, half = self.expert_offset, self.tp_rank, self.tp, torch.uint8, torch.float16
        self.w13_q = _expert_param(_param((e, 2 * i, d // 2), u8), off, 0, r, n)
        self.w13_scale = _expert_param(_param((e, 2 * i, d // g), half), off, 0, r, n)
        self.w13_zero = _expert_param(_param((e, 2 * i, d // g), half), off, 0, r, n)
        self.w2_q = _expert_param(_param((e, d, i // 2), u8), off, 1, r, n)
        self.w2_scale = _expert_param(_param((e, d, i // g), half), off, 1, r, n)
        self.w2_zero = _expert_param(_param((e, d, i // g), half), off, 1, r, n)

    @torch.no_grad()
    def load_dense(self, kind: str, local_expert: int, weight: torch.Tensor) -> None:
        """Quantise this rank's slice of one expert's `kind` ("gate", "up" or "down")
        projection, weight [out, in] in nn.Linear layout, into the codes."""
        weight = weight.to(self.w13_q.device, torch.float32)
        q, scale, zero = ops.quantize_int4(weight, self.group_size)
        if kind == "down":
            dests = (self.w2_q, self.w2_scale, self.w2_zero)
            rows = slice(None)
        else:
            dests = (self.w13_q, self.w13_scale, self.w13_zero)
            start = 0 if kind == "gate" else self.inter
            rows = slice(start, start + self.inter)
        for dest, src in zip(dests, (q, scale, zero), strict=True):
            dest.data[local_expert, rows].copy_(src)

    def forward(self, x, weights, ids, defer_reduce=False):
        return ops.moe_int4(x, self.w13_q, self.w13_scale, self.w13_zero, self.w2_q,
                            self.w2_scale, self.w2_zero, weights, ids, self.limit,
                            self.expert_offset, self.group_size, self.num_experts, defer_reduce)


def routed_experts(cfg: ModelConfig, ps: ParallelState) -> RoutedExperts:
    """This rank's routed experts in `cfg.expert_format`."""
    kinds = dict(zip(EXPERT_FORMATS, (DenseExperts, Exl3Experts, Int4Experts), strict=True))
    if cfg.expert_format not in kinds:
        raise ValueError(f"unknown expert format {cfg.expert_format!r}; one of {EXPERT_FORMATS}")
    return kinds[cfg.expert_format](cfg, ps)
