"""The outputs of the decode CUDA graphs (cuda_graphs.py): one set, shared by every graph.

Each graph used to keep its own outputs alive in the graph pool, and with speculation those
include every KDA layer's replay (~2.2 MB per token row of the real model at TP2): with
384 slots and MTP3, ~15 GB of them and ~5 GB of fp32 logits over the buckets and widths.
Graphs are replayed one at a time and a run's outputs are valid only until the next run, so
one set sized by the largest graph serves them all: graph (b, w) writes rows [:b * w]. The
pool then holds only scratch, which each smaller graph reuses from the larger ones.

Per row: the final hidden state [D] and the DFlash tap states [n_taps * D] in the model dtype,
the logits [V] fp32, and with verify widths (w > 1) each KDA layer's replay (caches.KDAReplay).
The KDA replay and the logits are written where they are produced (the in_proj GEMM, the fused
mixer, the lm_head's fp32 conversion); hidden and taps cost one copy each per graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .caches import KDAReplay, ModelCaches
from .config import ModelConfig
from .parallel import ParallelState


@dataclass(frozen=True)
class GraphOutputs:
    hidden: torch.Tensor  # [R, D] model dtype
    taps: torch.Tensor | None  # [R, n_taps * D] model dtype, None without tap layers
    logits: torch.Tensor  # [R, V] fp32
    replay: dict[int, KDAReplay]  # KDA layer id -> its replay rows; empty without verify widths

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int, *, n_taps: int, verify: bool,
                 dtype: torch.dtype, device: torch.device | str,
                 ps: ParallelState | None = None) -> GraphOutputs:
        """`rows`: the largest graph's (max batch x max width); `verify`: whether any graph
        is of width > 1 (its KDA states deferred)."""
        d = cfg.hidden_size
        return cls(
            hidden=torch.empty(rows, d, dtype=dtype, device=device),
            taps=torch.empty(rows, n_taps * d, dtype=dtype, device=device) if n_taps else None,
            logits=torch.empty(rows, cfg.vocab_size, dtype=torch.float32, device=device),
            replay={i: KDAReplay.allocate(cfg, rows, dtype, device, ps)
                    for i in cfg.kda_layers} if verify else {})

    @staticmethod
    def bytes_per_row(cfg: ModelConfig, *, n_taps: int, verify: bool, dtype: torch.dtype,
                      tp_size: int = 1) -> int:
        """What `allocate` takes per row (the memory plan counts it)."""
        item = torch.empty(0, dtype=dtype).element_size()
        replay = len(cfg.kda_layers) * KDAReplay.bytes_per_row(cfg, dtype, tp_size)
        return ((1 + n_taps) * cfg.hidden_size * item + cfg.vocab_size * 4
                + (replay if verify else 0))

    @property
    def nbytes(self) -> int:
        tensors = [self.hidden, self.logits, *([self.taps] if self.taps is not None else []),
                   *(t for r in self.replay.values() for t in vars(r).values())]
        return sum(t.nbytes for t in tensors)

    def caches(self, caches: ModelCaches) -> ModelCaches:
        """`caches` as the graphs' forward sees them: each KDA layer's state names its
        replay rows here (the same state tensors)."""
        return dataclasses.replace(caches, layers=tuple(
            dataclasses.replace(state, replay=self.replay[i]) if i in self.replay else state
            for i, state in enumerate(caches.layers)))
