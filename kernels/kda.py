"""Triton KDA ops over a flat varlen batch with state slots (twins of `kernels/ref/kda.py`).

- `causal_conv1d`: token-parallel depthwise conv + SiLU reading each sequence's window from its
  slot, then a per-sequence pass that writes the new window (two launches: the second must not
  overwrite history the first still reads).
- `kda_gate`: the bounded (or softplus) per-channel log-decay, elementwise.
- `kda_gated_attention`: the gate and the recurrence in one call, for prefill, where fla's chunked
  kernels compute the gate themselves.
- `kda_attention`: the gated delta rule with the q/k l2norm, scale, exp(g) and beta prologue
  fused. Decode and verify (a few tokens per sequence) run the fused recurrent kernel: one
  program per (sequence, head, BV columns) keeps its [K, BV] state tile in registers, walks the
  sequence's tokens (one output per position, as verification needs) and writes the final state
  back into its slot in place. Prefill (many tokens per sequence) runs a chunked form of the
  same recurrence: fla's `chunk_kda` when fla is installed (2.3-2.5x faster than ours on an
  H200 at 4K tokens, benchmarks/results/kernels_kda_h200_7e0edaa.json), else our own
  `kernels/kda_chunk.py` (3.6x faster than the token walk there).
- `gated_rms_norm`: per-head RMSNorm times sigmoid(gate).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import kda_chunk
from .utils import INTERPRET, log2_ceil, next_pow2, pdl, pdl_start, pdl_wait, seq_of_token

__all__ = ["causal_conv1d", "conv_commit", "gated_rms_norm", "kda_attention", "kda_commit",
           "kda_gate", "kda_gated_attention"]


@triton.jit
def causal_conv1d_fwd_kernel(x, weight, conv_state, y, cu_seqlens, state_ids, has_initial_state,
                             T, N, C, PW, stride_x, LOG_N: tl.constexpr, W: tl.constexpr,
                             BT: tl.constexpr, BC: tl.constexpr):
    """y is `C / PW` planes of [T, PW], one after another (one plane of [T, C] when PW = C)."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    i_n = seq_of_token(o_t, cu_seqlens, N, LOG_N)
    bos = tl.load(cu_seqlens + i_n, mask=m_t, other=0)
    i_s = tl.load(state_ids + i_n, mask=m_t, other=0)
    init = tl.load(has_initial_state + i_n, mask=m_t, other=0) != 0
    b_y = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W + 1):
        o_src = o_t - W + j
        in_seq = o_src >= bos
        m_x = (m_t & in_seq)[:, None] & m_c[None, :]
        p_x = x + o_src[:, None] * stride_x + o_c[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        # before the sequence's first token of this step: window slot W + (src - bos)
        m_h = (m_t & ~in_seq & init)[:, None] & m_c[None, :]
        p_h = conv_state + (i_s * C * W)[:, None] + o_c[None, :] * W + (W + o_src - bos)[:, None]
        b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_c * (W + 1) + j, mask=m_c, other=0.0).to(tl.float32)
        b_y += (b_x + b_h) * b_w[None, :]
    b_y = b_y * tl.sigmoid(b_y)
    o_pl = o_c // PW
    p_y = (y + (o_pl.to(tl.int64) * T * PW + o_c - o_pl * PW)[None, :]
           + o_t.to(tl.int64)[:, None] * PW)
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def causal_conv1d_state_kernel(x, conv_state, cu_seqlens, state_ids, has_initial_state, defer,
                               num_accepted, C, stride_x, W: tl.constexpr, BW: tl.constexpr,
                               BC: tl.constexpr, HAS_DEFER: tl.constexpr, HAS_ACC: tl.constexpr,
                               PDL: tl.constexpr = False):
    pdl_start(PDL)
    pdl_wait(PDL)  # (`utils.pdl`) everything it reads may be the kernel before's
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    if HAS_ACC:  # commit after verification: only the accepted prefix enters the window
        eos = bos + tl.load(num_accepted + i_n)
    i_s = tl.load(state_ids + i_n)
    init = tl.load(has_initial_state + i_n) != 0
    o_c = i_c * BC + tl.arange(0, BC)
    o_w = tl.arange(0, BW)
    m_c, m_w = o_c < C, o_w < W
    # new window = last W entries of [old window (W), this step's inputs (L)]
    o_src = (eos - bos) + o_w
    from_old = o_src < W
    p_old = conv_state + i_s * C * W + o_c[:, None] * W + o_src[None, :]
    b_old = tl.load(p_old, mask=m_c[:, None] & (m_w & from_old & init)[None, :], other=0.0)
    p_x = x + (bos + o_src - W)[None, :] * stride_x + o_c[:, None]
    b_x = tl.load(p_x, mask=m_c[:, None] & (m_w & ~from_old)[None, :], other=0.0)
    b_new = tl.where(from_old[None, :], b_old.to(tl.float32), b_x.to(tl.float32))
    p_new = conv_state + i_s * C * W + o_c[:, None] * W + o_w[None, :]
    if HAS_DEFER:
        m_w = m_w & (tl.load(defer + i_n) == 0)
    tl.store(p_new, b_new.to(conv_state.dtype.element_ty), mask=m_c[:, None] & m_w[None, :])


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

    x: [T, C] (rows may be strided); weight: [C, K]; conv_state: [S, C, K-1]; cu_seqlens: [N+1];
    state_ids, has_initial_state: [N]; defer: [N] bool or None (those windows stay unwritten).
    Returns [T, C] in x's dtype, or with planes > 1 [T, planes, C / planes] whose planes are
    each contiguous in memory (q, k and v as separate dense tensors for fla's kernels).
    """
    n_tok, chans = x.shape
    width = weight.shape[1] - 1
    n_seq = cu_seqlens.shape[0] - 1
    if chans % planes:
        raise ValueError(f"{chans} channels do not split into {planes} planes")
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert conv_state.shape[1:] == (chans, width)
    y = torch.empty((planes, n_tok, chans // planes), dtype=x.dtype, device=x.device)
    bt, bc = 16, 128 if INTERPRET else 256
    if n_tok:
        grid = (triton.cdiv(n_tok, bt), triton.cdiv(chans, bc))
        # 8 warps: on 4 the [16, 256] tile's fp32 sums and 64-bit row pointers spill (~300-460 B
        # a thread on sm_90, scripts/kernel_build.py)
        causal_conv1d_fwd_kernel[grid](x, weight, conv_state, y, cu_seqlens, state_ids,
                                       has_initial_state, n_tok, n_seq, chans, chans // planes,
                                       x.stride(0), LOG_N=log2_ceil(n_seq), W=width, BT=bt,
                                       BC=bc, num_warps=4 if INTERPRET else 8)
    if n_seq:
        causal_conv1d_state_kernel[(n_seq, triton.cdiv(chans, bc))](
            x, conv_state, cu_seqlens, state_ids, has_initial_state, defer, None, chans,
            x.stride(0), W=width, BW=next_pow2(width), BC=bc, HAS_DEFER=defer is not None,
            HAS_ACC=False)
    return y[0] if planes == 1 else y.permute(1, 0, 2)


def conv_commit(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Advance deferred conv windows past the first num_accepted[i] rows of each sequence.

    x: [T, C] pre-conv inputs the verify step ran on; conv_state: [S, C, K-1]; cu_seqlens:
    [N+1]; state_ids, has_initial_state, num_accepted: [N]."""
    chans, width = conv_state.shape[1], conv_state.shape[2]
    n_seq = cu_seqlens.shape[0] - 1
    assert x.stride(1) == 1 and conv_state.is_contiguous()
    if n_seq:
        bc = 128 if INTERPRET else 256
        causal_conv1d_state_kernel[(n_seq, triton.cdiv(chans, bc))](
            x, conv_state, cu_seqlens, state_ids, has_initial_state, None, num_accepted, chans,
            x.stride(0), W=width, BW=next_pow2(width), BC=bc, HAS_DEFER=False, HAS_ACC=True)


@triton.jit
def kda_gate_kernel(gate_logits, dt_bias, a_log, g, lower_bound, HK, stride_t,
                    K: tl.constexpr, HAS_BOUND: tl.constexpr, BD: tl.constexpr):
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < HK
    b_a = tl.load(gate_logits + i_t * stride_t + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_a += tl.load(dt_bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_r = tl.exp(tl.load(a_log + o_d // K, mask=m_d, other=0.0).to(tl.float32))
    if HAS_BOUND:
        b_g = lower_bound * tl.sigmoid(b_r * b_a)
    else:
        b_g = -b_r * tl.where(b_a > 20.0, b_a, tl.log(1.0 + tl.exp(tl.minimum(b_a, 20.0))))
    tl.store(g + i_t * HK + o_d, b_g, mask=m_d)


def kda_gate(
    gate_logits: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log-decay g (<= 0). gate_logits: [T, H*dk]; dt_bias: [H*dk]; a_log: [H].
    Returns g: [T, H, dk] fp32."""
    n_tok, hk = gate_logits.shape
    heads = a_log.shape[0]
    assert gate_logits.stride(1) == 1 and hk % heads == 0
    g = torch.empty((n_tok, heads, hk // heads), dtype=torch.float32, device=gate_logits.device)
    bd = min(next_pow2(hk), 1024)
    if n_tok:
        kda_gate_kernel[(n_tok, triton.cdiv(hk, bd))](
            gate_logits, dt_bias, a_log, g, 0.0 if lower_bound is None else float(lower_bound),
            hk, gate_logits.stride(0), K=hk // heads, HAS_BOUND=lower_bound is not None, BD=bd)
    return g


@triton.jit
def kda_recurrent_kernel(q, k, v, g, beta, state, o, cu_seqlens, state_ids, has_initial_state,
                         defer, num_accepted, scale, stride_q, stride_k, stride_v,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, HAS_DEFER: tl.constexpr, HAS_ACC: tl.constexpr):
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    if HAS_ACC:  # commit: replay only the accepted prefix, outputs are not needed
        eos = bos + tl.load(num_accepted + i_n)
    i_s = tl.load(state_ids + i_n).to(tl.int64)
    init = tl.load(has_initial_state + i_n) != 0
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = state + i_s * H * K * V + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=m_h & init, other=0.0).to(tl.float32)
    for i_t in range(bos, eos):
        b_q = tl.load(q + i_t * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + i_t * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + i_t * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_t * H + i_h).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h = b_h * tl.exp(b_g)[:, None]
        b_u = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h += b_k[:, None] * b_u[None, :]
        if not HAS_ACC:
            b_o = tl.sum(b_h * b_q[:, None], 0)
            tl.store(o + (i_t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if HAS_DEFER:
        m_h = m_h & (tl.load(defer + i_n) == 0)
    tl.store(p_h, b_h.to(state.dtype.element_ty), mask=m_h)


@functools.cache
def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


# fla's bounded-gate (tensor-core) intra-chunk path holds for log gates in [-5, 0)
FLA_SAFE_GATE_BOUND = -5.0


def _kda_chunk_fla(chunk, q, k, v, g, beta, state, cu_seqlens, state_ids, has_initial_state,
                   gate_lower_bound, cu_seqlens_host, gate_params=None):
    """fla's chunked KDA over the varlen batch; states gathered from and scattered to slots.
    q, k and v should be dense (fla copies strided inputs first). With gate_params
    (dt_bias, a_log), g holds the raw gate logits [T, H*dk] and fla's chunk cumsum computes
    the gate (the same formula as `kda_gate`)."""
    slots = state_ids.long()
    # where, not a multiply: a fresh slot's stale contents (even inf/NaN) must not leak in
    h0 = torch.where(has_initial_state.view(-1, 1, 1, 1).bool(), state[slots], 0.0)
    safe = gate_lower_bound is not None and gate_lower_bound >= FLA_SAFE_GATE_BOUND
    gate = {}
    if gate_params is not None:
        g = g.reshape(q.shape)
        gate = dict(use_gate_in_kernel=True, dt_bias=gate_params[0], A_log=gate_params[1],
                    lower_bound=gate_lower_bound)
    o, ht = chunk(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                  beta.unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=h0,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=safe,
                  cu_seqlens=cu_seqlens.long(),
                  cu_seqlens_cpu=None if cu_seqlens_host is None else cu_seqlens_host.long(),
                  **gate)
    state.index_copy_(0, slots, ht.to(state.dtype))
    return o[0].to(v.dtype)


# Prefill takes the chunked kernel when a step averages at least this many tokens per sequence
# (one chunk): shorter sequences are cheaper to walk token by token than to factor per chunk.
CHUNK_MIN_TOKENS_PER_SEQ = 64


def _chunked(n_tok: int, n_seq: int, dk: int, dv: int, defer: torch.Tensor | None) -> bool:
    return bool(defer is None and n_seq and n_tok >= CHUNK_MIN_TOKENS_PER_SEQ * n_seq
                and kda_chunk.supports(dk, dv))


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
    """Gated delta rule with per-channel decay; q and k are L2-normalised in the kernel.

    q, k: [T, H, dk] (rows may be strided); v: [T, H, dv]; g: [T, H, dk] log-decay; beta: [T, H];
    state: [S, H, dk, dv] fp32, updated in place for the slots used except those with defer[i]
    (speculative verification; `kda_commit` writes them later). Returns o: [T, H, dv] in v's
    dtype. gate_lower_bound: the caller's promise that g >= it (not checked here: the reference
    checks it); from -5 up, fla's chunked prefill takes its bounded-gate tensor-core path.
    cu_seqlens_host: cu_seqlens on the host, if the caller has it: fla plans its chunks from it
    instead of reading the device copy back (a device sync per step otherwise).
    """
    n_tok, heads, dk = q.shape
    dv = v.shape[-1]
    n_seq = cu_seqlens.shape[0] - 1
    for t, d in ((q, dk), (k, dk), (v, dv)):
        assert t.stride(2) == 1 and t.stride(1) == d, "heads must be packed within a row"
    assert g.is_contiguous() and beta.is_contiguous() and state.is_contiguous()
    if _chunked(n_tok, n_seq, dk, dv, defer):
        fla_chunk = _fla_chunk_kda() if q.is_cuda else None
        if fla_chunk is not None:
            return _kda_chunk_fla(fla_chunk, q, k, v, g, beta, state, cu_seqlens, state_ids,
                                  has_initial_state, gate_lower_bound, cu_seqlens_host)
        return kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu_seqlens, state_ids,
                                             has_initial_state)
    o = torch.empty((n_tok, heads, dv), dtype=v.dtype, device=v.device)
    if n_seq == 0:
        return o
    bk = next_pow2(dk)
    bv = min(next_pow2(dv), 32 if INTERPRET else 16)
    grid = (triton.cdiv(dv, bv), heads, n_seq)
    kda_recurrent_kernel[grid](q, k, v, g, beta, state, o, cu_seqlens, state_ids,
                               has_initial_state, defer, None, dk ** -0.5, q.stride(0),
                               k.stride(0), v.stride(0), H=heads, K=dk, V=dv, BK=bk, BV=bv,
                               HAS_DEFER=defer is not None, HAS_ACC=False,
                               num_warps=1 if bk * bv <= 2048 else 4)
    return o


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
    """`kda_gate` then `kda_attention` (no deferred slots). Where the step takes fla's chunked
    prefill, fla computes the gate inside its chunk cumsum: no gate launch, and no fp32 g
    written and read back (16K tokens x 32 heads x 128: 268 MB each way per layer)."""
    n_tok, _, dk = q.shape
    fla_chunk = None
    if q.is_cuda and _chunked(n_tok, cu_seqlens.shape[0] - 1, dk, v.shape[-1], None):
        fla_chunk = _fla_chunk_kda()
    if fla_chunk is None:
        g = kda_gate(gate_logits, dt_bias, a_log, lower_bound)
        return kda_attention(q, k, v, g, beta, state, cu_seqlens, state_ids, has_initial_state,
                             gate_lower_bound=lower_bound, cu_seqlens_host=cu_seqlens_host)
    return _kda_chunk_fla(fla_chunk, q, k, v, gate_logits, beta, state, cu_seqlens, state_ids,
                          has_initial_state, lower_bound, cu_seqlens_host, (dt_bias, a_log))


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
    """Write each deferred sequence's state after its first num_accepted[i] tokens: the
    recurrence replayed in place from the committed state (shapes as in `kda_attention`)."""
    heads, dk = q.shape[1], q.shape[2]
    dv = v.shape[-1]
    n_seq = cu_seqlens.shape[0] - 1
    for t, d in ((q, dk), (k, dk), (v, dv)):
        assert t.stride(2) == 1 and t.stride(1) == d, "heads must be packed within a row"
    assert g.is_contiguous() and beta.is_contiguous() and state.is_contiguous()
    if n_seq == 0:
        return
    bk, bv = next_pow2(dk), min(next_pow2(dv), 32 if INTERPRET else 16)
    kda_recurrent_kernel[(triton.cdiv(dv, bv), heads, n_seq)](
        q, k, v, g, beta, state, None, cu_seqlens, state_ids, has_initial_state, None,
        num_accepted, dk ** -0.5, q.stride(0), k.stride(0), v.stride(0), H=heads, K=dk, V=dv,
        BK=bk, BV=bv, HAS_DEFER=False, HAS_ACC=True, num_warps=1 if bk * bv <= 2048 else 4)


@triton.jit
def gated_rms_norm_kernel(x, gate, weight, y, eps, D, BD: tl.constexpr, PDL: tl.constexpr):
    """Row i_r: rms_norm(x) * weight * sigmoid(gate). PDL (`utils.pdl`): the weight is loaded
    before the wait for the kernel before."""
    pdl_start(PDL)
    i_r = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    b_x = tl.load(x + i_r * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_z = tl.load(gate + i_r * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x) / D + eps)
    b_y = b_x * b_r * b_w * tl.sigmoid(b_z)
    tl.store(y + i_r * D + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, gate: [T, H, dv]; weight: [dv] (a weight: read before the wait for the kernel
    before, `utils.pdl`). Returns x's dtype."""
    dv = x.shape[-1]
    x2, z2 = x.reshape(-1, dv).contiguous(), gate.reshape(-1, dv).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        on = pdl(x2.device, "kda")
        gated_rms_norm_kernel[(x2.shape[0],)](x2, z2, weight, y, eps, dv, BD=next_pow2(dv),
                                              PDL=on, launch_pdl=on)
    return y.view(x.shape)
