"""Feed-forward blocks: the clamped-SwiGLU MLP (dense layers, shared expert) and the routed MoE.

Parallel layout: the MLP's intermediate is TP-sharded (partial sums out). Routed experts
(`experts.py`) are EP-partitioned (each rank computes its experts for all tokens) or, without
EP, TP-sharded on their intermediate like the MLP; the router is replicated so every rank routes
identically. Partial sums of the routed and shared parts meet in one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..config import ModelConfig
from ..parallel import ParallelState
from .experts import routed_experts
from .linear import MergedColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """swiglu MLP; returns a partial sum when TP-sharded (`partial`), else the full output."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float,
                 ps: ParallelState) -> None:
        super().__init__()
        # gate | up as one GEMM (checkpoint: gate_proj, up_proj)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (intermediate, intermediate), ps)
        self.down_proj = RowParallelLinear(intermediate, hidden, ps)
        self.limit = swiglu_limit
        self.partial = ps.tp_size > 1

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], plus `add` if given (summed by the down projection)."""
        # gate_up_proj's weight is [gate; up] (equal parts): the projection and the swiglu
        # in one op
        return self.down_proj(ops.linear_swiglu(x, self.gate_up_proj.weight, self.limit),
                              add=add)


class DenseFFN(MLP):
    """A dense layer's FFN: the MLP plus its all-reduce."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, ps)
        self.ps = ps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ps.tp_all_reduce(super().forward(x))


class UniformRouting:
    """Random router logits for the rank-0 emulation (random weights route by accident, so
    each token's experts are drawn uniformly at random instead), for `n` routers that run in
    order in one forward: the first draws all n [T, E] in one launch, so the emulated step
    launches one kernel more than the real one, not one more a MoE layer."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool: torch.Tensor | None = None

    def logits(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Router `index`'s random logits, shaped and typed as `like` [T, E]."""
        if index == 0:
            self.pool = torch.rand((self.n, *like.shape), dtype=like.dtype, device=like.device)
        if self.pool is None or self.pool.shape[1:] != like.shape:
            raise RuntimeError(f"router {index} of {self.n} ran before router 0 of its forward")
        return self.pool[index]


class Router(nn.Module):
    """fp32 router GEMM + sigmoid scores; `e_score_correction_bias` only steers selection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        # rank-0 emulation: (the draws, this router's index among them); the router GEMM
        # still runs
        self.uniform_routing: tuple[UniformRouting, int] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = ops.router_logits(x, self.weight)
        if self.uniform_routing is not None:
            draws, index = self.uniform_routing
            logits = draws.logits(index, logits)
        return ops.route_topk(logits, self.e_score_correction_bias, self.top_k,
                              self.renormalize, self.scaling)


class MoE(nn.Module):
    """Routed experts (`experts.py`, in the config's storage format) plus one shared expert."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        # registered before the router: `tiny.randomize` draws in parameter order, and this
        # keeps the tiny checkpoints identical to those written before experts had a module
        self.experts = routed_experts(cfg, ps)
        self.gate = Router(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  cfg.swiglu_limit, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        # the routed sum goes straight into the shared expert's down projection when both or
        # neither are partial: then the experts may leave their last sum to that GEMV
        direct = self.shared_experts.partial == self.experts.partial
        routed = self.experts(x, weights, ids, defer_reduce=direct)
        if self.shared_experts.partial and not self.experts.partial:
            return routed + self.ps.all_reduce(self.shared_experts(x))
        if self.experts.partial and not self.shared_experts.partial:
            routed = self.ps.all_reduce(routed)
        # the shared expert's down projection adds the routed sum (no separate add launch);
        # both partial: one all-reduce of the two
        out = self.shared_experts(x, add=routed)
        return self.ps.all_reduce(out) if self.shared_experts.partial else out
