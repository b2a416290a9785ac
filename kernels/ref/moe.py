"""Reference MoE ops: the fp32 router GEMM, sigmoid noaux_tc routing and the routed experts
(clamped SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router GEMM in fp32: x [T, D] (any float dtype) times weight [E, D] -> [T, E] fp32."""
    return F.linear(x.float(), weight.float())


def route_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores; the correction bias only affects which experts win.

    router_logits: [T, E] fp32; correction_bias: [E]. Returns (weights [T, k] fp32, ids [T, k]).
    """
    scores = torch.sigmoid(router_logits.float())
    ids = torch.topk(scores + correction_bias.float(), k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Sum over each token's routed experts of weight * expert(x).

    x: [T, D]; w13: [E_local, 2I, D] (gate rows, then up rows); w2: [E_local, D, I];
    topk_weights, topk_ids: [T, k] (global expert ids). Experts outside
    [expert_offset, expert_offset + E_local) belong to another rank and are skipped (EP).
    Returns [T, D] in x's dtype.
    """
    out = torch.zeros_like(x)
    local = topk_ids - expert_offset
    n_local = w13.shape[0]
    for e in torch.unique(local[(local >= 0) & (local < n_local)]).tolist():
        token_idx, slot = torch.where(local == e)
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, swiglu_limit), w2[e])
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(x.dtype))
    return out
