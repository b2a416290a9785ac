"""Feed-forward blocks: the clamped-SwiGLU MLP (dense layers, shared expert) and the routed MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels import ops

from ..config import ModelConfig
from .linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """fp32 router GEMM + sigmoid scores; `e_score_correction_bias` only steers selection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return ops.route_topk(logits, self.e_score_correction_bias, self.top_k,
                              self.renormalize, self.scaling)


class MoE(nn.Module):
    """Routed experts (stacked: w13 [E, 2I, D] gate|up, w2 [E, D, I]) plus one shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))
        self.shared_experts = MLP(d, i * cfg.n_shared_experts, cfg.swiglu_limit)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = ops.fused_moe(x, self.w13, self.w2, weights, ids, self.limit)
        return routed + self.shared_experts(x)
