"""Reference EXL3 (exllamav3) routed experts: trellis decode, Hadamard transforms, and the MoE.

Format (design/exl3-dflash-spec.md §B.2-B.6). A weight W of shape (in k, out n), y = x @ W
(the HF nn.Linear weight is W^T), is stored as
  trellis int16 [k/16, n/16, 16K]: per 16x16 tile, 256 K-bit symbols as one MSB-first bitstream
                                   held in 8K little-endian uint32 words (pairs of int16),
  suh fp16 [k], svh fp16 [n]:      input- and output-side scales (random signs included),
and W = diag(suh) . BH_k . What . BH_n . diag(svh), where What = the decoded tiles (fp16, the
"rotated basis") and BH_m = block-diagonal natural-order Sylvester Hadamard over 128-blocks,
scaled 1/sqrt(128). The state of symbol i is the 16 stream bits ending where s_i ends (the tile
wraps around: tail-biting); a codebook maps each 16-bit state to an fp16 value (§B.5).

Decoding is bit-exact (integer math in int64, each fp16 value rounded once from an exact fp32
sum); the linear algebra runs in fp32 (fp64 when given fp64).
"""

from __future__ import annotations

import torch

from .moe import swiglu

# codebook -> (multiplier, addend) of the uint32 hash of the state (§B.5)
_CB_HASH = {0: (89226354, 64248484), 1: (0xCBAC1FED, 0), 2: (0x83DCD12D, 0)}
_MASK, _XOR = 0x8FFF8FFF, 0x3B603B60
_MUL1_SCALE, _MUL1_BIAS = 0x1EEE, 0xC931  # fp16 bit patterns: 0.00676727..., -10.3828125


def _fp16_bits(u: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int tensor as fp16."""
    return (((u & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)


def _fp16_const(bits: int) -> float:
    return float(_fp16_bits(torch.tensor([bits])).float())


def exl3_codebook(state: torch.Tensor, codebook: int) -> torch.Tensor:
    """state: int tensor of 16-bit trellis states -> fp16 values of the same shape.
    codebook: 0 = 3INST, 1 = MCG, 2 = MUL1."""
    if codebook not in _CB_HASH:
        raise ValueError(f"unknown EXL3 codebook {codebook}; expected 0 (3INST), 1 (MCG), 2 (MUL1)")
    mult, add = _CB_HASH[codebook]
    x = ((state.long() & 0xFFFF) * mult + add) & 0xFFFFFFFF  # < 2**48: exact in int64
    if codebook == 2:
        s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        # fp16(0x6400 + s) == 1024 + s; the fp32 product-sum is exact before the one rounding
        v = (1024 + s).float() * _fp16_const(_MUL1_SCALE) + _fp16_const(_MUL1_BIAS)
        return v.half()
    x = (x & _MASK) ^ _XOR
    return (_fp16_bits(x).float() + _fp16_bits(x >> 16).float()).half()


def _bits_of(trellis: torch.Tensor) -> int:
    words = trellis.shape[-1]
    if words % 16 or not 1 <= words // 16 <= 8:
        raise ValueError(f"EXL3 trellis tiles hold 16*K int16 words with K in 1..8, got {words}")
    return words // 16


def exl3_pack(symbols: torch.Tensor, bits: int) -> torch.Tensor:
    """symbols: int [..., 256] (each < 2**bits, symbol order) -> int16 [..., 16*bits] tile words:
    the MSB-first bitstream as little-endian uint32 words, each split into (low, high) int16."""
    shift = torch.arange(bits - 1, -1, -1, device=symbols.device)
    stream = (symbols.long().unsqueeze(-1) >> shift) & 1  # [..., 256, bits]
    stream = stream.reshape(*symbols.shape[:-1], 8 * bits, 32)
    u32 = (stream << torch.arange(31, -1, -1, device=symbols.device)).sum(-1)
    u16 = torch.stack([u32 & 0xFFFF, u32 >> 16], dim=-1).flatten(-2)
    return ((u16 ^ 0x8000) - 0x8000).to(torch.int16)


def _tile_states(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words: int16 [..., 16*bits] -> int64 [..., 256] states in symbol order (§B.6 state_of)."""
    u16 = words.long() & 0xFFFF
    u32 = u16[..., 0::2] | (u16[..., 1::2] << 16)  # [..., 8*bits]
    i = torch.arange(256, device=words.device)
    end = bits * (i + 1) + 256 * bits  # end bit (exclusive), shifted positive for the wrap
    w1, w0 = (end - 1) // 32, (end - 16) // 32
    sh = 32 * (w1 + 1) - end
    # only the low 16 bits of the earlier word can reach the window (sh + 16 <= 47)
    v = ((u32[..., w0 % (8 * bits)] & 0xFFFF) << 32) | u32[..., w1 % (8 * bits)]
    return (v >> sh) & 0xFFFF


def _tile_symbol_index(device: torch.device | str = "cpu") -> torch.Tensor:
    """[16, 16] int64: i(r, c), the symbol stored at row r, column c of a tile (§B.4)."""
    r = torch.arange(16, device=device).unsqueeze(1)
    c = torch.arange(16, device=device).unsqueeze(0)
    return 8 * (4 * (c % 8) + (r % 8) // 2) + 4 * (c // 8) + 2 * (r // 8) + (r % 2)


def exl3_dequant(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
    """trellis: int16 [..., k/16, n/16, 16K] -> What fp16 [..., k, n] (rotated basis), bit-exact."""
    bits = _bits_of(trellis)
    *batch, kt, nt, _ = trellis.shape
    vals = exl3_codebook(_tile_states(trellis, bits), codebook)  # [..., kt, nt, 256]
    tiles = vals[..., _tile_symbol_index(trellis.device)]  # [..., kt, nt, 16, 16]
    return tiles.transpose(-3, -2).reshape(*batch, 16 * kt, 16 * nt)


def _hadamard_matrix(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """H128 / sqrt(128), natural (Sylvester) order: H[i, j] = (-1)**popcount(i & j)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / 128**0.5).to(device, dtype)


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """x: [..., m], m % 128 == 0 -> x . BH_m: the scaled 128-point Hadamard of each 128-block of
    the last dim, in fp32 (fp64 stays fp64)."""
    m = x.shape[-1]
    if m % 128:
        raise ValueError(f"EXL3 Hadamard blocks need the last dim to be a multiple of 128, got {m}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    blocks = x.to(dtype).reshape(*x.shape[:-1], m // 128, 128)
    return (blocks @ _hadamard_matrix(x.device, dtype)).reshape(x.shape)


def exl3_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: int) -> torch.Tensor:
    """trellis int16 [..., k/16, n/16, 16K], suh [..., k], svh [..., n] -> W fp32 [..., k, n]
    in the original basis: y = x @ W (HF weight = W^T)."""
    what = exl3_dequant(trellis, codebook).float()
    w = hadamard128(what.transpose(-1, -2)).transpose(-1, -2) * suh.float().unsqueeze(-1)
    return hadamard128(w) * svh.float().unsqueeze(-2)


def exl3_linear(x: torch.Tensor, what: torch.Tensor, suh: torch.Tensor,
                svh: torch.Tensor) -> torch.Tensor:
    """x [..., k] through one EXL3 linear without forming W: ((x * suh) . BH_k) @ What . BH_n * svh.
    what: decoded [k, n]; suh [k]; svh [n]. fp32 math (fp64 stays fp64)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xh = hadamard128(x.to(dtype) * suh.to(dtype))
    return hadamard128(xh @ what.to(dtype)) * svh.to(dtype)


def moe_exl3(
    x: torch.Tensor,
    w13_trellis: torch.Tensor,
    w13_suh: torch.Tensor,
    w13_svh: torch.Tensor,
    w2_trellis: torch.Tensor,
    w2_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int,
    codebook: int,
) -> torch.Tensor:
    """Routed experts with EXL3 weights: for each token, sum over its routed experts e in
    [expert_offset, expert_offset + E) of weight * down(swiglu(gate(x), up(x))) (EP: other
    ranks' experts are skipped).

    x: [T, D]; w13_trellis int16 [E, D/16, 2I/16, 16K] (gate tiles, then up tiles);
    w13_suh fp16 [E, 2, D] (gate, up); w13_svh fp16 [E, 2I]; w2_trellis int16 [E, I/16, D/16, 16K];
    w2_suh fp16 [E, I]; w2_svh fp16 [E, D]; topk_weights fp32 [T, k]; topk_ids int64 [T, k]
    (global ids). fp32 math (fp64 for fp64 x). Returns [T, D] in x's dtype.
    """
    inter = w13_svh.shape[-1] // 2
    dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    local = topk_ids - expert_offset
    for e in torch.unique(local[(local >= 0) & (local < w13_trellis.shape[0])]).tolist():
        tok, slot = torch.where(local == e)
        w13 = exl3_dequant(w13_trellis[e], codebook)
        gate = exl3_linear(x[tok], w13[:, :inter], w13_suh[e, 0], w13_svh[e, :inter])
        up = exl3_linear(x[tok], w13[:, inter:], w13_suh[e, 1], w13_svh[e, inter:])
        a = swiglu(gate, up, swiglu_limit)
        y = exl3_linear(a, exl3_dequant(w2_trellis[e], codebook), w2_suh[e], w2_svh[e])
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(dtype))
    return out.to(x.dtype)
