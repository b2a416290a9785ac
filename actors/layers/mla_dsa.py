"""KPool-DSA layer: NoPE MLA whose queries attend a sparse token set chosen by the KPool indexer.

Only the 512-wide latent `c` is cached per token; attention runs in the absorbed form
(q_h W_UK[h] against c, then W_UV[h]), i.e. multi-head attention over one shared key=value.

Under TP each rank owns heads / tp (q_b, kv_b, o_proj input); the latent and the indexer are
replicated (the indexer is small, and computing it identically everywhere keeps the top-k
selection bit-identical to TP1 with no collective). Under DCP each rank stores and attends only
its interleaved latent rows for all heads; partial outputs are merged by log-sum-exp.
"""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..caches import DSAState
from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from ..parallel import ParallelState, split
from .linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from .norm import RMSNorm


class KPoolIndexer(nn.Module):
    """Scores 4-token pools of softmax-pooled keys and returns each query's attended tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.index_head_dim
        self.n_heads, self.head_dim = cfg.index_n_heads, hd
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * hd)
        # the key projection wk and the pool gate are parts of DSAttention.x_proj
        self.k_norm = nn.LayerNorm(hd, eps=1e-6)
        # fp32 head weights: bf16 error can flip near-tie pool rankings (vLLM does the same);
        # held in fp32 so that no step converts them
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=torch.float32)
        self.index_kpool_compress_ape = nn.Parameter(
            torch.empty(cfg.index_kpool, hd, dtype=torch.float32))
        self.pool_budget, self.kpool = cfg.index_pool_budget, cfg.index_kpool

    def store(self, k: torch.Tensor, pool_logits: torch.Tensor, batch: ForwardBatch,
              state: DSAState) -> None:
        """Write the pool keys of the batch's positions. k, pool_logits: [T, index_head_dim],
        the block input's key projection (before its norm) and pool-gate logits."""
        ops.indexer_update(self.k_norm(k), pool_logits, self.index_kpool_compress_ape,
                           state.open_rows, state.pool_keys, batch.positions, batch.slot_mapping,
                           batch.cu_seqlens, batch.state_ids, state.pool_format)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch,
                state: DSAState) -> torch.Tensor:
        """x: [T, D]; q_resid: [T, q_lora_rank]; the batch's pool keys already stored
        (`store`). Returns token positions [T, W] (-1 = unused)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        # the head weights' n_heads^-0.5 is applied where they are read (no launch of its own)
        return ops.indexer_topk(q, self.weights_proj(x), state.pool_keys, batch.block_tables,
                                batch.query_seq, batch.positions, self.pool_budget, self.kpool,
                                state.pool_format, head_scale=self.n_heads**-0.5)


class DSAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.ps = ps
        self.num_heads = split(h, ps.tp_size, "num_attention_heads")
        self.qk_dim, self.v_dim = cfg.qk_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        # the projections of the block input as one GEMM (checkpoint: q_a_proj,
        # kv_a_proj_with_mqa, indexer.wk, indexer.index_kpool_compress_gate)
        hd = cfg.index_head_dim
        self.x_proj = MergedLinear(d, (cfg.q_lora_rank, cfg.kv_lora_rank, hd, hd))
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, h * self.qk_dim, ps)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, h * (self.qk_dim + self.v_dim), ps)
        self.o_proj = RowParallelLinear(h * self.v_dim, d, ps)
        self.indexer = KPoolIndexer(cfg)
        self.scale = cfg.softmax_scale

    def write_cache(self, x: torch.Tensor, batch: ForwardBatch, state: DSAState) -> None:
        """Only the cache rows of the batch's positions (latent and pool keys), as `forward`
        writes them, without attending: x [T, D] (normed block input)."""
        self._store(self.x_proj.split(self.x_proj(x)), batch, state)

    def _store(self, projections: tuple[torch.Tensor, ...], batch: ForwardBatch,
               state: DSAState) -> None:
        _, kv_a, index_k, pool_logits = projections
        ps = self.ps
        ops.store_latent(self.kv_a_layernorm(kv_a), state.latent, batch.slot_mapping,
                         ps.dcp_rank, ps.dcp_size, state.latent_format, state.outer_scale)
        self.indexer.store(index_k, pool_logits, batch, state)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: DSAState) -> torch.Tensor:
        """x: [T, D] (normed block input) -> [T, D]."""
        ps = self.ps
        projections = self.x_proj.split(self.x_proj(x))
        q_resid = self.q_a_layernorm(projections[0])
        q = self.q_b_proj(q_resid).view(-1, self.num_heads, self.qk_dim)
        self._store(projections, batch, state)
        tokens = self.indexer(x, q_resid, batch, state)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv[:, : self.qk_dim], w_kv[:, self.qk_dim:]
        q_latent = torch.einsum("thd,hdc->thc", q, w_uk)
        if ps.dcp_size > 1:
            # this rank's rows for every head, then a log-sum-exp merge across ranks
            q_all = ps.all_gather(q_latent, dim=1) if ps.tp_size > 1 else q_latent
            out, lse = ops.sparse_mla_attention(q_all, state.latent, batch.block_tables,
                                                batch.query_seq, tokens, self.scale,
                                                ps.dcp_rank, ps.dcp_size, state.latent_format)
            outs = ps.all_gather(out.unsqueeze(0), dim=0)
            lses = ps.all_gather(lse.unsqueeze(0), dim=0)
            u = ops.merge_attention_states(outs, lses)
            if ps.tp_size > 1:
                u = u[:, ps.tp_rank * self.num_heads:(ps.tp_rank + 1) * self.num_heads]
        else:
            u, _ = ops.sparse_mla_attention(q_latent, state.latent, batch.block_tables,
                                            batch.query_seq, tokens, self.scale,
                                            latent_format=state.latent_format)
        out = torch.einsum("thc,hvc->thv", u, w_uv)
        return ps.tp_all_reduce(self.o_proj(out.reshape(out.shape[0], -1)))
