"""Reference KDA token mixer: everything between a KDA layer's projections and its o_proj.

The composition of the ops in `kernels/ref/kda.py` (conv + SiLU, decay gate, sigmoid beta, the
gated delta rule over state slots, gated RMSNorm). Its Triton twin runs decode and
verification steps in three launches instead of six (the fused conv/gate/beta/norm/recurrence
kernel, the window write, the gated RMSNorm), where the separate launches dominate the time.
"""

from __future__ import annotations

import torch

from .kda import causal_conv1d, gated_rms_norm, kda_attention, kda_gate, kda_gated_attention


def kda_mixer(
    pre: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    gate_logits: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    lower_bound: float | None,
    beta_logits: torch.Tensor,
    out_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    defer: torch.Tensor | None = None,
    cu_seqlens_host: torch.Tensor | None = None,
    replay_out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """One KDA layer's mixer over the flat varlen batch, updating its state slots.

    pre: [T, H*(2dk+dv)] pre-conv q|k|v projections; conv_weight: [H*(2dk+dv), W+1];
    conv_state: [S, H*(2dk+dv), W]; gate_logits: [T, H*dk] (f_b(f_a(x)), before dt_bias);
    beta_logits: [T, H]; out_gate: [T, H, dv]; norm_weight: [dv]; state: [S, H, dk, dv] fp32.
    Slots of sequences with `defer[i]` are left unwritten (see `conv_commit` / `kda_commit`).
    cu_seqlens_host: as in `kda_attention`. replay_out (with `defer`): tensors shaped as the
    replay, written instead of new ones (a CUDA graph's outputs, kept after its run).
    Returns (o [T, H, dv] normed and gated, in pre's dtype; replay), replay being what a
    deferred commit replays when `defer` is given, else None: (q, k [T, H, dk] and v [T, H, dv]
    after the conv, in pre's dtype; g [T, H, dk] fp32; beta [T, H] fp32).
    """
    n_tok = pre.shape[0]
    heads, dv = out_gate.shape[1], out_gate.shape[2]
    dk = gate_logits.shape[1] // heads
    mixed = causal_conv1d(pre, conv_weight, conv_state, cu_seqlens, state_ids,
                          has_initial_state, defer)
    q, k, v = mixed.split([heads * dk, heads * dk, heads * dv], dim=-1)
    q, k = q.reshape(n_tok, heads, dk), k.reshape(n_tok, heads, dk)
    v = v.reshape(n_tok, heads, dv)
    beta = torch.sigmoid(beta_logits.float())
    if defer is None:
        o = kda_gated_attention(q, k, v, gate_logits, dt_bias, a_log, lower_bound, beta, state,
                                cu_seqlens, state_ids, has_initial_state, cu_seqlens_host)
        return gated_rms_norm(o, out_gate, norm_weight, eps), None
    g = kda_gate(gate_logits, dt_bias, a_log, lower_bound)
    o = kda_attention(q, k, v, g, beta, state, cu_seqlens, state_ids, has_initial_state, defer,
                      gate_lower_bound=lower_bound)
    replay = (q, k, v, g, beta)
    if replay_out is not None:
        replay = tuple(out.copy_(t) for out, t in zip(replay_out, replay, strict=True))
    return gated_rms_norm(o, out_gate, norm_weight, eps), replay
