"""The ops the model calls. Today every op is the pure-torch reference (`kernels/ref`); the
Triton kernels bind here under the same names and signatures when they land."""

from __future__ import annotations

from .ref.kda import (
    causal_conv1d,
    conv_commit,
    gated_rms_norm,
    kda_attention,
    kda_commit,
    kda_gate,
)
from .ref.mhc import hc_post, hc_pre
from .ref.moe import fused_moe, route_topk, swiglu
from .ref.norm import rms_norm
from .ref.sampling import apply_penalties, process_logits, sample
from .ref.sparse_mla import (
    indexer_topk,
    indexer_update,
    merge_attention_states,
    sparse_mla_attention,
    store_rows,
)

__all__ = [
    "apply_penalties",
    "causal_conv1d",
    "conv_commit",
    "fused_moe",
    "gated_rms_norm",
    "hc_post",
    "hc_pre",
    "indexer_topk",
    "indexer_update",
    "kda_attention",
    "kda_commit",
    "kda_gate",
    "merge_attention_states",
    "process_logits",
    "rms_norm",
    "route_topk",
    "sample",
    "sparse_mla_attention",
    "store_rows",
    "swiglu",
]
