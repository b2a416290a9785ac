"""Reference KDA (Kimi Delta Attention) ops over a flat varlen batch with state slots.

Sequences are concatenated along the token axis and delimited by `cu_seqlens`; sequence i reads
and writes its recurrent state and conv window in slot `state_ids[i]`. A sequence whose
`has_initial_state[i]` is False starts from zeros (a new request), so slots need no clearing.
Speculative verification defers the state write of its sequences (`defer[i]`): the step runs
over all draft tokens from the committed state, and `*_commit` later writes the state after the
accepted prefix (a replay of the cheap recurrence), so a slot never holds more than one state.
All math is fp32; the recurrence is the token-by-token definition (chunked kernels must equal it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _seq_spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    defer: torch.Tensor | None = None,
    planes: int = 1,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU per sequence, continuing from (and updating) its window.

    x: [T, C]; weight: [C, K] (tap K-1 multiplies the current token); conv_state: [S, C, K-1]
    holds the last K-1 pre-conv inputs of each slot (oldest first), not updated for sequences
    with `defer[i]` (see `conv_commit`). Returns [T, C] in x's dtype, or with planes > 1 the
    same values as [T, planes, C / planes] (the Triton twin lays each plane out contiguously).
    """
    if x.shape[1] % planes:
        raise ValueError(f"{x.shape[1]} channels do not split into {planes} planes")
    width = weight.shape[1] - 1
    out = torch.empty_like(x)
    w = weight.float().unsqueeze(1)  # [C, 1, K]
    for i, (start, end) in enumerate(_seq_spans(cu_seqlens)):
        slot = int(state_ids[i])
        history = conv_state[slot] if bool(has_initial_state[i]) else torch.zeros_like(
            conv_state[slot])
        seq = torch.cat([history.to(x.dtype), x[start:end].t()], dim=-1)  # [C, K-1+L]
        y = F.conv1d(seq.float().unsqueeze(0), w, groups=seq.shape[0])[0]  # [C, L]
        out[start:end] = F.silu(y).t().to(x.dtype)
        if defer is None or not bool(defer[i]):
            conv_state[slot] = seq[:, seq.shape[1] - width:].to(conv_state.dtype)
    return out if planes == 1 else out.view(x.shape[0], planes, -1)


def conv_commit(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Advance deferred conv windows past the first `num_accepted[i]` rows of x ([T, C], the
    pre-conv inputs the step ran on)."""
    width = conv_state.shape[-1]
    for i, (start, _) in enumerate(_seq_spans(cu_seqlens)):
        slot, n = int(state_ids[i]), int(num_accepted[i])
        history = conv_state[slot] if bool(has_initial_state[i]) else torch.zeros_like(
            conv_state[slot])
        seq = torch.cat([history.to(x.dtype), x[start:start + n].t()], dim=-1)
        conv_state[slot] = seq[:, seq.shape[1] - width:].to(conv_state.dtype)


def kda_gate(
    gate_logits: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log-decay g (<= 0) from the raw low-rank gate projection.

    gate_logits: [T, H*dk]; dt_bias: [H*dk]; a_log: [H]. Returns g: [T, H, dk] fp32.
    Bounded ("safe") gate: g = lb * sigmoid(exp(A_log) * (a + dt_bias)) -- a multiplicative
    bound, not a clamp. Without a bound: g = -exp(A_log) * softplus(a + dt_bias).
    """
    heads = a_log.shape[0]
    a = (gate_logits.float() + dt_bias.float()).view(gate_logits.shape[0], heads, -1)
    rate = torch.exp(a_log.float()).view(1, heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * a)
    return -rate * torch.where(a > 20.0, a, torch.log1p(torch.exp(a)))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    defer: torch.Tensor | None = None,
    gate_lower_bound: float | None = None,
    cu_seqlens_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule with per-channel decay; q and k are L2-normalised here (fp32).

    q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H, dk] log-decay; beta: [T, H] in (0, 1);
    state: [S, H, dk, dv] fp32, updated in place for the slots used (except sequences with
    `defer[i]`, see `kda_commit`). Returns o: [T, H, dv] in v's dtype. Per token:
    S = diag(e^g) S; S += k (beta (v - S^T k))^T; o = S^T (q / sqrt(dk)).
    gate_lower_bound: the caller's promise that g >= it (the bounded sigmoid gate), which lets
    the Triton twin's chunked path use fla's bounded-gate kernels; checked here.
    cu_seqlens_host: cu_seqlens on the host, if the caller has it (the Triton twin's chunked path
    plans its chunks from it instead of reading the device copy back); unused here.
    """
    if gate_lower_bound is not None and g.numel() and float(g.min()) < gate_lower_bound:
        raise ValueError(f"gate below its promised lower bound {gate_lower_bound}: "
                         f"{float(g.min())}")
    spans = _seq_spans(cu_seqlens)
    scale = q.shape[-1] ** -0.5
    qf = l2norm(q.float()) * scale
    kf = l2norm(k.float())
    vf, gf, bf = v.float(), g.float().exp(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    slots = state_ids.long()
    cur = state[slots].float()
    cur[~has_initial_state.bool()] = 0.0
    lengths = torch.tensor([e - s for s, e in spans])
    starts = torch.tensor([s for s, _ in spans])
    # Step t advances every sequence that still has a token t (vectorised across sequences).
    for t in range(int(lengths.max()) if len(spans) else 0):
        live = (lengths > t).nonzero().squeeze(1)
        rows = starts[live] + t
        s = cur[live] * gf[rows].unsqueeze(-1)
        kt = kf[rows]
        pred = (s * kt.unsqueeze(-1)).sum(dim=-2)
        delta = (vf[rows] - pred) * bf[rows].unsqueeze(-1)
        s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        out[rows] = (s * qf[rows].unsqueeze(-1)).sum(dim=-2)
        cur[live] = s
    keep = slice(None) if defer is None else ~defer.bool()
    state[slots[keep]] = cur[keep].to(state.dtype)
    return out.to(v.dtype)


def kda_gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    lower_bound: float | None,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    cu_seqlens_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kda_gate` then `kda_attention` (no deferred slots: prefill and plain decode), for
    callers that do not need g itself: the Triton twin's chunked prefill computes the gate
    inside fla's chunk kernels and never materialises g. Shapes as in those two ops."""
    g = kda_gate(gate_logits, dt_bias, a_log, lower_bound)
    return kda_attention(q, k, v, g, beta, state, cu_seqlens, state_ids, has_initial_state,
                         gate_lower_bound=lower_bound, cu_seqlens_host=cu_seqlens_host)


def kda_commit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Write the state after the first `num_accepted[i]` tokens of each (deferred) sequence:
    the recurrence replayed from the committed state over the step's own inputs."""
    bounds = cu_seqlens[:-1]
    n = num_accepted.long()
    dev = q.device
    kept = torch.cat([torch.arange(int(s), int(s) + int(c), device=dev)
                      for s, c in zip(bounds, n, strict=True)])
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), n.cumsum(0).to(dev)])
    kda_attention(q[kept], k[kept], v[kept], g[kept], beta[kept], state, cu, state_ids,
                  has_initial_state)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """KDA output norm: per-head RMSNorm (fp32, weight applied in fp32) times sigmoid(gate).

    x, gate: [T, H, dv]; weight: [dv]. Returns x's dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)
