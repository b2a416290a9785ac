"""Triton KDA token mixer (twin of `kernels/ref/kda_mixer.py`).

Decode and verification steps (a few tokens per sequence) take three launches instead of six
(conv, window write, gate, beta, recurrence, norm): one fused kernel, a program per (V block,
head, sequence), computes the short convs of its head's q/k/v channels from the slot's window
and the step's rows, the decay gate, sigmoid beta and the q/k L2 norms, and walks the gated
delta rule with its [dk, BV] state tile in registers (the recurrence kernel's layout: many small
programs keep the state reads in flight); then the window write, which must wait until every
program has read the old window, and the gated RMSNorm, which needs whole dv rows. (One program
per head owning all dv columns could fuse those too, but measured 1.5-7x slower than the six
launches on an H200: the [dk, dv] tile does not fit the registers. Handing both to the head's
last program to finish, found by an arrival counter, measured no faster at batch 1 and 10-15%
slower at batch 64: one warp's serial tail costs what the two launches did,
benchmarks/results/kernels_kda_decode_h200_6fb5422.json.)
Prefill (many tokens per sequence) runs the separate kernels of `kernels/kda.py`, whose
recurrence is chunked there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kda
from .utils import INTERPRET, next_pow2, pdl, pdl_start, pdl_wait

__all__ = ["kda_mixer"]

# Steps averaging more tokens per sequence than this take the separate (chunked) kernels.
FUSED_MAX_TOKENS_PER_SEQ = 16
CONV_BLOCK = 128 if INTERPRET else 256


@triton.jit
def _conv_silu(pre, conv_state, conv_weight, c, m_c, i_t, bos, i_s, init, stride_pre, C,
               W: tl.constexpr):
    """Causal conv + SiLU at token i_t for channels c: taps before the sequence's first row of
    this step come from the slot's window (zeros for a new sequence)."""
    b_y = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(W + 1):
        src = i_t - W + j
        b_x = tl.load(pre + src * stride_pre + c, mask=m_c & (src >= bos), other=0.0)
        b_h = tl.load(conv_state + i_s * C * W + c * W + (W + src - bos),
                      mask=m_c & (src < bos) & init, other=0.0)
        b_w = tl.load(conv_weight + c * (W + 1) + j, mask=m_c, other=0.0)
        b_y += (b_x.to(tl.float32) + b_h.to(tl.float32)) * b_w.to(tl.float32)
    return b_y * tl.sigmoid(b_y)


@triton.jit
def kda_mixer_kernel(pre, conv_weight, conv_state, gate_logits, dt_bias, a_log, beta_logits,
                     state, o, q_out, k_out, v_out, g_out, beta_out, cu_seqlens, state_ids,
                     has_initial_state, defer, lower_bound, scale, stride_pre, stride_gl,
                     stride_bl, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_BOUND: tl.constexpr, HAS_DEFER: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    pdl_wait(PDL)  # (`utils.pdl`) the inputs, state and windows may be the kernel before's
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    i_s = tl.load(state_ids + i_n).to(tl.int64)
    init = tl.load(has_initial_state + i_n) != 0
    C = H * (2 * K + V)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    first = i_v == 0  # the V block that stores the per-head (not per-column) outputs
    c_q, c_k, c_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_h * V + o_v
    m_h = m_k[:, None] & m_v[None, :]
    p_h = state + i_s * H * K * V + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_h & init, other=0.0).to(tl.float32)
    b_rate = tl.exp(tl.load(a_log + i_h).to(tl.float32))
    b_dt = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    for i_t in range(bos, eos):
        # every V block recomputes its head's q/k convs (a few loads): no cross-program sync
        b_q = _conv_silu(pre, conv_state, conv_weight, c_q, m_k, i_t, bos, i_s, init,
                         stride_pre, C, W)
        b_k = _conv_silu(pre, conv_state, conv_weight, c_k, m_k, i_t, bos, i_s, init,
                         stride_pre, C, W)
        b_v = _conv_silu(pre, conv_state, conv_weight, c_v, m_v, i_t, bos, i_s, init,
                         stride_pre, C, W)
        # rounded as the unfused path rounds them; a deferred commit replays from these
        b_q = b_q.to(q_out.dtype.element_ty)
        b_k = b_k.to(k_out.dtype.element_ty)
        b_v = b_v.to(v_out.dtype.element_ty)
        if HAS_DEFER:
            tl.store(q_out + (i_t * H + i_h) * K + o_k, b_q, mask=m_k & first)
            tl.store(k_out + (i_t * H + i_h) * K + o_k, b_k, mask=m_k & first)
            tl.store(v_out + (i_t * H + i_h) * V + o_v, b_v, mask=m_v)
        b_a = tl.load(gate_logits + i_t * stride_gl + i_h * K + o_k, mask=m_k,
                      other=0.0).to(tl.float32) + b_dt
        if HAS_BOUND:
            b_g = lower_bound * tl.sigmoid(b_rate * b_a)
        else:
            b_g = -b_rate * tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(tl.minimum(b_a, 20.0))))
        b_beta = tl.sigmoid(tl.load(beta_logits + i_t * stride_bl + i_h).to(tl.float32))
        if HAS_DEFER:
            tl.store(g_out + (i_t * H + i_h) * K + o_k, b_g, mask=m_k & first)
            tl.store(beta_out + i_t * H + i_h, b_beta, mask=first)
        b_q, b_k, b_v = b_q.to(tl.float32), b_k.to(tl.float32), b_v.to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h = b_h * tl.exp(b_g)[:, None]
        b_u = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (i_t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if HAS_DEFER:  # verification: the commit writes the state once acceptance is known
        m_h = m_h & (tl.load(defer + i_n) == 0)
    tl.store(p_h, b_h.to(state.dtype.element_ty), mask=m_h)


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
    """Shapes as in the reference: pre [T, H*(2dk+dv)]; gate_logits [T, H*dk]; beta_logits
    [T, H]; out_gate [T, H, dv] (rows may be strided); state [S, H, dk, dv] fp32. Returns
    (o, replay): replay = (q, k, v, g, beta) when `defer` is given, else None. replay_out
    (contiguous, shaped as the replay): where the fused kernel stores the replay instead of new
    tensors (a CUDA graph's outputs, kept after its run: no copy launch)."""
    n_tok = pre.shape[0]
    heads, dv = out_gate.shape[1], out_gate.shape[2]
    dk = gate_logits.shape[1] // heads
    n_seq = cu_seqlens.shape[0] - 1
    if n_tok > FUSED_MAX_TOKENS_PER_SEQ * max(n_seq, 1):
        return _unfused(pre, conv_weight, conv_state, gate_logits, dt_bias, a_log, lower_bound,
                        beta_logits, out_gate, norm_weight, eps, state, cu_seqlens, state_ids,
                        has_initial_state, defer, cu_seqlens_host, replay_out)
    width = conv_weight.shape[1] - 1
    assert pre.shape[1] == heads * (2 * dk + dv) and conv_state.shape[1:] == (pre.shape[1], width)
    assert conv_weight.is_contiguous() and conv_state.is_contiguous() and state.is_contiguous()
    pre, gate_logits, beta_logits = (t if t.stride(-1) == 1 else t.contiguous()
                                     for t in (pre, gate_logits, beta_logits))
    dev, dt = pre.device, pre.dtype
    o = torch.empty((n_tok, heads, dv), dtype=dt, device=dev)
    if replay_out is not None:
        assert defer is not None and all(t.is_contiguous() for t in replay_out)
        q, k, v, g, beta = replay_out
    elif defer is not None:
        q = torch.empty((n_tok, heads, dk), dtype=dt, device=dev)
        k = torch.empty((n_tok, heads, dk), dtype=dt, device=dev)
        v = torch.empty((n_tok, heads, dv), dtype=dt, device=dev)
        g = torch.empty((n_tok, heads, dk), dtype=torch.float32, device=dev)
        beta = torch.empty((n_tok, heads), dtype=torch.float32, device=dev)
    else:  # nothing to replay: the kernel stores none of them (o stands in, same dtype)
        q = k = v = g = beta = o
    if n_seq:
        on = pdl(pre.device, "kda")
        bk, bv = next_pow2(dk), min(next_pow2(dv), 8 if INTERPRET else 16)
        kda_mixer_kernel[(triton.cdiv(dv, bv), heads, n_seq)](
            pre, conv_weight, conv_state, gate_logits, dt_bias, a_log, beta_logits, state, o,
            q, k, v, g, beta, cu_seqlens, state_ids, has_initial_state, defer,
            0.0 if lower_bound is None else float(lower_bound), dk ** -0.5, pre.stride(0),
            gate_logits.stride(0), beta_logits.stride(0), H=heads, K=dk, V=dv, W=width,
            BK=bk, BV=bv, HAS_BOUND=lower_bound is not None, HAS_DEFER=defer is not None,
            PDL=on, launch_pdl=on, num_warps=1 if bk * bv <= 2048 else 4)
        # the windows move only now: every program above read the old ones (launched
        # dependent, it waits for them all to finish before it writes)
        kda.causal_conv1d_state_kernel[(n_seq, triton.cdiv(pre.shape[1], CONV_BLOCK))](
            pre, conv_state, cu_seqlens, state_ids, has_initial_state, defer, None,
            pre.shape[1], pre.stride(0), W=width, BW=next_pow2(width), BC=CONV_BLOCK,
            HAS_DEFER=defer is not None, HAS_ACC=False, PDL=on, launch_pdl=on)
    o = kda.gated_rms_norm(o, out_gate, norm_weight, eps)
    return o, None if defer is None else (q, k, v, g, beta)


def _unfused(pre, conv_weight, conv_state, gate_logits, dt_bias, a_log, lower_bound,
             beta_logits, out_gate, norm_weight, eps, state, cu_seqlens, state_ids,
             has_initial_state, defer, cu_seqlens_host, replay_out):
    """Prefill: the separate kernels (the recurrence runs chunked there). A replay_out is
    copied into: no graph step is this long per sequence."""
    n_tok = pre.shape[0]
    heads, dv = out_gate.shape[1], out_gate.shape[2]
    dk = gate_logits.shape[1] // heads
    if dk == dv:  # q, k and v as three dense planes (fla's chunked kernels copy strided ones)
        mixed = kda.causal_conv1d(pre, conv_weight, conv_state, cu_seqlens, state_ids,
                                  has_initial_state, defer, planes=3)
        q, k, v = (mixed[:, i].view(n_tok, heads, dk) for i in range(3))
    else:
        mixed = kda.causal_conv1d(pre, conv_weight, conv_state, cu_seqlens, state_ids,
                                  has_initial_state, defer)
        q, k, v = mixed.split([heads * dk, heads * dk, heads * dv], dim=-1)
        q, k = q.view(n_tok, heads, dk), k.view(n_tok, heads, dk)
        v = v.view(n_tok, heads, dv)
    beta = torch.sigmoid(beta_logits.float())
    if defer is None:
        o = kda.kda_gated_attention(q, k, v, gate_logits, dt_bias, a_log, lower_bound, beta,
                                    state, cu_seqlens, state_ids, has_initial_state,
                                    cu_seqlens_host)
        return kda.gated_rms_norm(o, out_gate, norm_weight, eps), None
    g = kda.kda_gate(gate_logits, dt_bias, a_log, lower_bound)
    o = kda.kda_attention(q, k, v, g, beta, state, cu_seqlens, state_ids, has_initial_state,
                          defer, gate_lower_bound=lower_bound)
    replay = (q, k, v, g, beta)
    if replay_out is not None:
        replay = tuple(out.copy_(t) for out, t in zip(replay_out, replay, strict=True))
    return kda.gated_rms_norm(o, out_gate, norm_weight, eps), replay
