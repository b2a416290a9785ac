"""Rank-0 emulation (performance.md §5.1): one rank's exact shard of the full model on one GPU.

The model is the serving model, built by the same code as for a checkpoint (`build_model` on
the meta device, then `materialize`), with rank 0's shapes under a TP/EP/DCP plan, but:
- collectives do no communication (`ParallelState.emulated`; they are timed separately),
- weights are random, in their real storage formats (EXL3 codes, int4 codes, bf16), drawn on
  the GPU by `tiny.randomize`,
- routing is forced uniform (`Router.uniform_routing`, selection bias zeroed): random weights
  would route by accident. One launch draws a forward's random logits for every router.
So the kernel sequence, the bytes each step reads and the memory left for the KV pool are the
real rank's, and one GPU measures the per-GPU step of a pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import ModelConfig
from .layers.moe import Router, UniformRouting
from .loader import build_model, materialize
from .models.glm5_next import Glm5NextForCausalLM
from .parallel import ParallelConfig, ParallelState
from .tiny import randomize


def build_rank0(cfg: ModelConfig, parallel: ParallelConfig, *, with_mtp: bool = True,
                dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                seed: int = 0,
                check_memory: Callable[[Glm5NextForCausalLM], None] | None = None,
                ) -> Glm5NextForCausalLM:
    """Rank 0 of `parallel` for `cfg`, random weights on `device`, uniform routing.
    `check_memory` sees the meta-built model before anything is allocated."""
    ps = ParallelState(parallel, rank=0, emulated=True)
    model = build_model(cfg, with_mtp=with_mtp, dtype=dtype, device="meta", ps=ps)
    if check_memory is not None:
        check_memory(model)
    model = materialize(model, device)
    randomize(model, seed)
    # the trunk's routers run in layer order in a forward, the MTP layer's in passes of its own
    for modules in (model.layers, [model.mtp] if model.mtp is not None else []):
        routers = [m for module in modules for m in module.modules() if isinstance(m, Router)]
        draws = UniformRouting(len(routers))
        for i, router in enumerate(routers):
            router.uniform_routing = (draws, i)
            # a random selection bias would favour some experts over the uniform draw
            router.e_score_correction_bias.data.zero_()
    return model
