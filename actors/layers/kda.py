"""KDA (Kimi Delta Attention) layer with separate q/k/v short convs and the bounded decay gate.

Owns only the projections; the conv, gate, recurrence and gated norm are one mixer op over the
flat varlen batch (fused into one kernel for decode on GPU), reading and writing this layer's
state slots. Under TP each rank owns
heads / tp of everything per-head (q/k/v, convs, gate and beta, o_proj input); the 128-wide
low-rank gate inputs (f_a, g_a) and the per-head norm weight are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..caches import KDAState
from ..config import ModelConfig
from ..forward_batch import DeferredStates, ForwardBatch
from ..parallel import ParallelState, split
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    MergedLinear,
    RowParallelLinear,
    mark_shard,
)
from .norm import RMSNorm


class KDAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        d, rank = cfg.hidden_size, cfg.linear_head_dim
        self.ps = ps
        self.num_heads = split(cfg.linear_num_heads, ps.tp_size, "linear_num_heads")
        self.head_dim = cfg.linear_head_dim
        width = cfg.linear_dim
        local = self.num_heads * self.head_dim
        # q|k|v|beta as one GEMM (checkpoint: q/k/v_proj and b_proj, each sharded by heads):
        # each rank holds its q, k and v rows stacked (the conv's channel order), then its
        # heads' beta rows
        self.in_proj = MergedColumnParallelLinear(
            d, (width, width, width, cfg.linear_num_heads), ps)
        # q|k|v depthwise conv taps stacked along channels (checkpoint: q/k/v_conv1d [C, 1, K],
        # each sharded by heads); fp32 like the reference implementation.
        self.conv_weight = mark_shard(nn.Parameter(
            torch.empty(3 * local, cfg.linear_conv_kernel, dtype=torch.float32)), 0, ps.tp_rank,
            ps.tp_size)
        # the two low-rank gate inputs (checkpoint: f_a_proj, g_a_proj) as one GEMM
        self.fg_a_proj = MergedLinear(d, (rank, rank))
        self.f_b_proj = ColumnParallelLinear(rank, width, ps)
        self.dt_bias = mark_shard(nn.Parameter(torch.empty(local, dtype=torch.float32)), 0,
                                  ps.tp_rank, ps.tp_size)
        self.A_log = mark_shard(nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)),
                                0, ps.tp_rank, ps.tp_size)
        self.g_b_proj = ColumnParallelLinear(rank, width, ps)
        self.o_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # weight only: gated norm below
        self.o_proj = RowParallelLinear(width, d, ps)
        self.lower_bound = cfg.linear_lower_bound
        self.pending: tuple[torch.Tensor, ...] | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: KDAState) -> torch.Tensor:
        """x: [T, D] (normed block input) -> [T, D]."""
        n_tok = x.shape[0]
        heads = (n_tok, self.num_heads, self.head_dim)
        # a deferring graph step writes its replay where the graphs keep their outputs
        into = (state.replay.rows(n_tok) if state.replay is not None
                and batch.defer_state is not None else None)
        # pre-conv q|k|v [T, 3 H dk] and beta logits [T, H]: strided views of one output
        proj = self.in_proj(x, out=None if into is None else into.proj)
        pre, beta = proj.split((3 * self.num_heads * self.head_dim, self.num_heads), dim=-1)
        f_a, g_a = self.fg_a_proj.split(self.fg_a_proj(x))
        gate = self.g_b_proj(g_a).reshape(heads)
        o, replay = ops.kda_mixer(
            pre, self.conv_weight, state.conv, self.f_b_proj(f_a), self.dt_bias,
            self.A_log, self.lower_bound, beta, gate, self.o_norm.weight,
            self.o_norm.eps, state.recurrent, batch.cu_seqlens, batch.state_ids,
            batch.has_initial_state, batch.defer_state, batch.cu_seqlens_host,
            None if into is None else (into.q, into.k, into.v, into.g, into.beta))
        # what `commit` replays once the accepted lengths are known
        self.pending = None if replay is None else (pre, *replay)
        return self.ps.tp_all_reduce(self.o_proj(o.reshape(n_tok, -1)))

    def commit(self, deferred: DeferredStates, state: KDAState,
               num_accepted: torch.Tensor) -> None:
        """After verification: advance the deferred sequences' conv windows and recurrent
        states past their first num_accepted[i] tokens ([M], one per deferred sequence; other
        sequences were written already). Reads nothing back from the device, so a CUDA graph
        can replay it."""
        pre, q, k, v, g, beta = self.pending
        self.pending = None
        if deferred.rows is not None:
            pre, q, k, v, g, beta = (t[deferred.rows] for t in (pre, q, k, v, g, beta))
        cu, ids, init = deferred.cu_seqlens, deferred.state_ids, deferred.has_initial_state
        ops.conv_commit(pre, state.conv, cu, ids, init, num_accepted)
        ops.kda_commit(q, k, v, g.contiguous(), beta.contiguous(), state.recurrent, cu, ids,
                       init, num_accepted)
