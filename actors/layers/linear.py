"""Linear layers and the vocabulary embedding, replicated or tensor-parallel.

A sharded parameter records how it was cut from the checkpoint tensor (`shard_dim`,
`shard_rank`, `shard_size`: the checkpoint tensor is split into `shard_size` equal contiguous
parts along `shard_dim` and this rank keeps part `shard_rank`), so the weight loader reads only
that slice. Row-parallel layers return partial sums: the caller all-reduces, which lets a block
fold several partial sums into one collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels import ops

from ..parallel import ParallelState, split


def mark_shard(param: nn.Parameter, dim: int | None, rank: int, size: int) -> nn.Parameter:
    """Record that `param` holds part `rank` of `size` along checkpoint dim `dim`."""
    if dim is not None and size > 1:
        param.shard_dim, param.shard_rank, param.shard_size = dim, rank, size
    return param


class Linear(nn.Module):
    """y = x W^T with W: [out, in], replicated on every rank."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in] -> [..., out], plus `add` ([..., out]) if given; `out` (x 2-D): the
        GEMM writes there, no new tensor."""
        return ops.linear(x, self.weight, out, add)


class ColumnParallelLinear(Linear):
    """Output features split across TP ranks: W [out / tp, in]; returns this rank's slice."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState,
                 what: str = "output features") -> None:
        super().__init__(in_features, split(out_features, ps.tp_size, what))
        mark_shard(self.weight, 0, ps.tp_rank, ps.tp_size)


class RowParallelLinear(Linear):
    """Input features split across TP ranks: W [out, in / tp]; returns a partial sum."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState,
                 what: str = "input features") -> None:
        super().__init__(split(in_features, ps.tp_size, what), out_features)
        mark_shard(self.weight, 1, ps.tp_rank, ps.tp_size)


class MergedLinear(Linear):
    """Replicated projections of one input stacked into one weight (one GEMM): W [sum(parts),
    in]. The weight's `part_sizes` tell the loader where each checkpoint tensor goes
    (weights.FUSED); `split` cuts an output into the parts (strided views)."""

    def __init__(self, in_features: int, parts: tuple[int, ...]) -> None:
        super().__init__(in_features, sum(parts))
        self.weight.part_sizes = tuple(parts)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.weight.part_sizes, dim=-1)


class MergedColumnParallelLinear(MergedLinear):
    """Column-parallel projections of one input stacked into one weight: each part is split
    across TP ranks on its own, and this rank holds every part's slice, in order."""

    def __init__(self, in_features: int, parts: tuple[int, ...], ps: ParallelState,
                 what: str = "output features") -> None:
        super().__init__(in_features, tuple(split(n, ps.tp_size, what) for n in parts))
        mark_shard(self.weight, 0, ps.tp_rank, ps.tp_size)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks; lookup is masked locally, then all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState) -> None:
        super().__init__()
        local = split(vocab_size, ps.tp_size, "vocab_size")
        self.start = ps.tp_rank * local
        self.weight = mark_shard(nn.Parameter(torch.empty(local, hidden_size)), 0, ps.tp_rank,
                                 ps.tp_size)
        self.ps = ps

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.ps.tp_all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(ColumnParallelLinear):
    """Vocab-sharded head; logits are gathered so every rank (rank 0 samples) has all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, ps: ParallelState) -> None:
        super().__init__(hidden_size, vocab_size, ps, what="vocab_size")
        self.ps = ps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return self.ps.all_gather(logits, dim=-1) if self.ps.tp_size > 1 else logits
