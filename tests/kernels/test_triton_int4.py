"""Triton INT4 kernels (kernels/int4.py, int4_gemv.py) vs the reference on awkward sizes.

Dequantisation is bit-exact (a 4-bit code times an fp16 scale is exact in fp32). moe_int4, both
paths: relative error 1e-5 under the interpreter (fp32 operands; sums in another order) and 2e-2
on CUDA (fp16/bf16 operands, fp32 accumulation). Group sizes: 32 (several groups per row, and
a K step of one group) and 128, which exceeds every in_features here, so each projection's
group is its whole row (96 and 64: whole-group K steps; 48: per-element scales).

The fused path's two variants are forced through int4_gemv.DECODE_GEMV (the dot-free one at 1, 2
and 4 rows per block, and the tl.dot one), with several K splits of the dot-free w2 and a group
that is no multiple of 8 (the dot-free variant falls back to tl.dot). The unsorted-pairs path
(T <= 16: w13, w2 into a scratch, one reduce launch) is checked with other ranks' pairs, a
token with none of its own, bf16 / fp32 inputs and routing weights, K splits, scratch and
output poisoned with NaN (nothing unwritten is read), and run to run bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import int4 as ref_int4
from tests.kernel_launches import KernelLaunches

from .test_int4_ref import quantized_experts
from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton
TOL = 1e-5 if DEVICE == "cpu" else 2e-2


# the dequantise tile (<= 128 bytes a row) covers whole groups (g 32, 64; the first masked), no
# whole group (g 48: a scale per byte) or lies inside one (g 512)
@pytest.mark.parametrize("shape,g", [((3, 40, 96), 32), ((2, 5, 48), 48), ((7, 64), 64),
                                     ((2, 3, 512), 512)])
def test_dequantize_exact(shape, g):
    from glm53.kernels import int4

    gen = torch.Generator().manual_seed(3)
    q, scale, zero = ref_int4.quantize_int4(torch.randn(shape, generator=gen), g)
    out = int4.dequantize_int4(q.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), g)
    assert out.dtype == torch.float32
    assert torch.equal(out.cpu(), ref_int4.dequantize_int4(q, scale, zero, g))


SHAPES = [(64, 32, 32), (96, 32, 32), (96, 48, 128), (64, 48, 128)]  # D, I, group_size
# T, k, E_local, expert_offset (ids drawn from E_local + 3 experts: some are another rank's)
ROUTES = [(1, 1, 3, 0), (5, 3, 4, 2), (17, 3, 5, 3)]


def _case(d, inter, group_size, t, k, n_local, seed):
    gen = torch.Generator().manual_seed(seed)
    packed, _ = quantized_experts(n_local, d, inter, group_size, gen)
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(n_local + 3, generator=gen)[:k] for _ in range(t)])
    return x, packed, torch.rand(t, k, generator=gen), ids


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("d,inter,group_size", SHAPES)
@pytest.mark.parametrize("t,k,n_local,offset", ROUTES)
def test_moe_int4_matches_ref(path, d, inter, group_size, t, k, n_local, offset):
    from glm53.kernels import int4

    x, packed, wts, ids = _case(d, inter, group_size, t, k, n_local, seed=d + inter + t)
    if offset == 0 and k == 1:
        ids[0, 0] = 1  # one local expert at least, so the reference is not all zeros
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, offset, group_size)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, offset,
                                group_size, path=path)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_moe_int4_bf16_strided_input(path):
    """bf16 x with strided rows: the result is the reference on the same bf16 input."""
    from glm53.kernels import int4

    x, packed, wts, ids = _case(64, 32, 32, 6, 3, 4, seed=9)
    xb = torch.cat([x, x], dim=1).bfloat16()[:, ::2]
    want = ref_int4.moe_int4(xb, *packed, wts, ids, 7.0, 1, 32)
    out = int4.moe_int4_on_path(xb.to(DEVICE), *(a.to(DEVICE) for a in (*packed, wts, ids)),
                                7.0, 1, 32, path=path)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < max(TOL, 1e-2)


def test_switch_rule_and_bad_path(monkeypatch):
    """The prefill path from PREFILL_MIN_ROWS_PER_EXPERT rows per local expert on (it alone
    dequantises through the scratch)."""
    from glm53.kernels import int4

    x, packed, wts, ids = _case(64, 32, 32, 8, 3, 4, seed=11)
    args = [a.to(DEVICE) for a in (x, *packed, wts, ids)]
    calls, dequant = [], int4._dequant_into
    monkeypatch.setattr(int4, "_dequant_into", lambda *a: calls.append(dequant(*a)))
    monkeypatch.setattr(int4, "PREFILL_MIN_ROWS_PER_EXPERT", 7)  # 24 pairs < 7 * 4 experts
    int4.moe_int4(*args, 7.0, 0, 32)
    assert not calls
    monkeypatch.setattr(int4, "PREFILL_MIN_ROWS_PER_EXPERT", 6)  # 24 >= 6 * 4
    int4.moe_int4(*args, 7.0, 0, 32)
    assert calls
    with pytest.raises(ValueError, match="path"):
        int4.moe_int4_on_path(*args, 7.0, 0, 32, path="gemv")


# variant: (DECODE_GEMV table, GEMV_AHEAD)
GEMV = {"dot": ((), 1), "gemv1": (((10**9, 1),), 1), "gemv2": (((10**9, 2),), 1),
        "gemv4": (((10**9, 4),), 1), "gemv1-ahead2": (((10**9, 1),), 2),
        "gemv4-ahead2": (((10**9, 4),), 2), "gemv1-ahead3": (((10**9, 1),), 3),
        "gemv2-ahead4": (((10**9, 2),), 4)}


@pytest.mark.parametrize("variant", list(GEMV))
@pytest.mark.parametrize("d,inter,group_size,t,k,n_local,split", [
    (96, 48, 128, 9, 3, 3, None),  # g2 48: 2-word steps; ~4.5 rows per local expert
    (64, 128, 32, 5, 2, 3, 4),     # w2: 4 steps of 4 words in 4 splits (w13: 2 of 4 each)
    (256, 64, 32, 3, 2, 3, None),  # w13: 8 steps of 4 words (every step-ahead ring turns)
])
def test_decode_variants(monkeypatch, variant, d, inter, group_size, t, k, n_local, split):
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4_gemv, "DECODE_GEMV", GEMV[variant][0])
    monkeypatch.setattr(int4_gemv, "GEMV_AHEAD", GEMV[variant][1])
    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", split)
    x, packed, wts, ids = _case(d, inter, group_size, t, k, n_local, seed=t + inter)
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, 2, group_size)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, 2,
                                group_size, path="decode")
    assert rel_err(out, want) < TOL


def test_decode_variant_choice(monkeypatch):
    """The dot-free rows per block from T (none past GEMV_MAX_TOKENS); none for groups that are
    no multiple of 8 words; K splits are powers of two dividing the steps."""
    from glm53.kernels import int4_gemv

    assert [int4_gemv.rows_per_block(t, 128, 128) for t in (1, 16, 17, 64, 65, 128, 129)] == \
        [1, 1, 2, 2, 4, 4, 0]
    assert int4_gemv.rows_per_block(1, 12, 128) == 0
    with monkeypatch.context() as patch:
        patch.setattr(int4_gemv, "GEMV_MAX_TOKENS", 16)  # the sweep's crossover
        assert [int4_gemv.rows_per_block(t, 128, 128) for t in (16, 17, 64)] == [1, 0, 0]
    cpu = torch.device("cpu")
    assert int4_gemv._w2_split(16, 256, cpu) == 2  # T = 1: 8 experts x 32 column tiles
    # w13 columns: halved while under half of 4 programs x 132 SMs
    assert int4_gemv._w13_columns(2048, 1, 8, cpu) == 32  # T = 1: 512 programs
    assert int4_gemv._w13_columns(2048, 1, 64, cpu) == 64  # T = 8: 2048 programs
    assert int4_gemv._w13_columns(2048, 2, 128, cpu) == 32  # 2 rows a block: half the columns
    assert int4_gemv._w2_split(16, 4096, cpu) == 1
    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", 8)
    assert int4_gemv._w2_split(12, 1, cpu) == 4 and int4_gemv._w2_split(16, 1, cpu) == 8


@pytest.mark.parametrize("nibble_min_rows", [16, 128])
@pytest.mark.parametrize("bm_max", [16, 32, 64])
def test_dot_variant_rows_per_block(monkeypatch, bm_max, nibble_min_rows):
    """The tl.dot variant's blocks: 40 tokens x top-3 over 3 local experts (of 6): ~20 rows a
    local expert and 40 pairs per expert hit, so blocks of 64 (one a local expert, one loading
    its rows as one contiguous tile split into even and odd columns), of 32 (two, some with
    one row) or of 16 (the stride-2 loads); group 32 gives whole-group K steps at D = 64.
    Codes dequantised by the nibble trick (from 16 rows a block) or converted (never)."""
    from glm53.kernels import int4, int4_gemv

    assert [int4.dot_rows_per_block(p, h) for p, h in ((1600, 288), (1600, 8), (40, 3))] == \
        [16, 64, 16]  # 5.6 rows an expert, 200 (capped), 13.3
    monkeypatch.setattr(int4_gemv, "DECODE_GEMV", ())
    monkeypatch.setattr(int4, "DOT_BM_MAX", bm_max)
    monkeypatch.setattr(int4, "DOT_NIBBLE_MIN_ROWS", nibble_min_rows)
    assert int4.dot_rows_per_block(120, 3) == bm_max
    x, packed, wts, ids = _case(64, 32, 32, 40, 3, 3, seed=77)
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, 1, 32)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, 1, 32,
                                path="decode")
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("variant,nibble_min_rows", [("gemv1", 16), ("gemv4", 32)])
def test_decode_group_not_multiple_of_8(monkeypatch, variant, nibble_min_rows):
    """Group 12: the dot-free variant is skipped (tl.dot with per-element scales, the codes by
    the nibble trick or converted)."""
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4, "DOT_NIBBLE_MIN_ROWS", nibble_min_rows)
    monkeypatch.setattr(int4_gemv, "DECODE_GEMV", GEMV[variant][0])
    monkeypatch.setattr(int4_gemv, "GEMV_AHEAD", GEMV[variant][1])
    x, packed, wts, ids = _case(48, 24, 12, 5, 2, 3, seed=5)
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, 0, 12)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, 0, 12,
                                path="decode")
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("ep", [1, 3])
@pytest.mark.parametrize("pairs_max", [0, 64])
@pytest.mark.parametrize("t,k,n_local,offset", [(1, 4, 6, 0), (6, 3, 4, 2), (9, 2, 3, 5)])
def test_decode_unsorted_pairs(monkeypatch, pairs_max, t, k, n_local, offset, ep):
    """Up to PAIRS_MAX_TOKENS the dot-free variant runs on the unsorted pairs (experts chosen
    twice, another rank's experts skipped); 0 forces the sorted blocks on the same inputs.
    With ep ranks' experts named (num_experts), the launch is sized for this rank's share of
    the pairs: fewer columns per program, the same result."""
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4_gemv, "PAIRS_MAX_TOKENS", pairs_max)
    calls, pairs = [], int4_gemv.moe_decode_pairs
    monkeypatch.setattr(int4_gemv, "moe_decode_pairs",
                        lambda *a, **kw: calls.append(a) or pairs(*a, **kw))
    x, packed, wts, ids = _case(64, 32, 32, t, k, n_local, seed=31 + t)
    ids[0, 0] = offset  # one local expert at least
    if t > 1:
        ids[1, 0] = offset  # the same expert for two tokens
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, offset, 32)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, offset,
                                32, ep * n_local, path="decode")
    assert len(calls) == (pairs_max >= t)
    assert rel_err(out, want) < TOL


@pytest.mark.parametrize("bn13_min", [8, 16])
def test_w13_columns_halve_to_their_floor(monkeypatch, bn13_min):
    """With few live pairs w13's columns per program halve down to GEMV_BN13_MIN (8: 16 rows
    of gate and up a program); the result is the reference's."""
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4_gemv, "GEMV_BN13_MIN", bn13_min)
    w13 = KernelLaunches(int4_gemv.w13_gemv_kernel)
    monkeypatch.setattr(int4_gemv, "w13_gemv_kernel", w13)
    x, packed, wts, ids = _case(64, 64, 32, 1, 4, 6, seed=5)
    want = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, 0, 32)
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, 0, 32,
                                path="decode")
    assert [c["BN"] for c in w13.calls] == [bn13_min]
    assert rel_err(out, want) < TOL


def _pairs_case(t, x_dtype, w_dtype):
    """D 96 (3 reduce tiles of 32 columns at GEMV_REDUCE_TILE 512), I 128 (w2: 4 K steps of 4
    words, so up to 4 K splits), top-3 of 12 experts, this rank's being 2..5 (offset 2): token
    0 has two local pairs, every other even token one (expert 2 + t/2 % 4: at T = 16 each is
    picked twice), every odd token none."""
    x, packed, wts, _ = _case(96, 128, 32, t, 3, 4, seed=40 + t)
    gen = torch.Generator().manual_seed(50 + t)
    remote = torch.tensor([0, 1, 6, 7, 8, 9, 10, 11])
    ids = torch.stack([remote[torch.randperm(8, generator=gen)[:3]] for _ in range(t)])
    for i in range(0, t, 2):
        ids[i, i % 3] = 2 + i // 2 % 4
    ids[0, 2] = 5
    return x.to(x_dtype), packed, wts.to(w_dtype), ids


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("t,x_dtype,w_dtype,split", [
    (1, F32, F32, None), (1, BF16, BF16, 4), (3, F32, BF16, 4), (3, BF16, F32, None),
    (3, BF16, BF16, 4), (16, BF16, F32, 4)])
def test_decode_pairs_reduce(monkeypatch, t, x_dtype, w_dtype, split):
    """The pairs path against the reference in fp32 on the same (rounded) inputs: relative
    error TOL for fp32 x, 4e-3 for bf16 x (its output is rounded to bf16: 2^-9 relative at
    most per element). Every empty scratch and the output start as NaN: rows of remote pairs
    are never read and the output needs no zeroing; a token with no local pair gets exact 0.
    split None: 1 split (few steps); 4: forced, so 4 rows per pair meet in the reduce."""
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", split)
    monkeypatch.setattr(int4_gemv, "GEMV_REDUCE_TILE", 512)
    reduce = KernelLaunches(int4_gemv.pairs_reduce_kernel)
    monkeypatch.setattr(int4_gemv, "pairs_reduce_kernel", reduce)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    x, packed, wts, ids = _pairs_case(t, x_dtype, w_dtype)
    want = ref_int4.moe_int4(x.float(), *packed, wts.float(), ids, 7.0, 2, 32)
    args = [a.to(DEVICE) for a in (x, *packed, wts, ids)]
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        out = int4.moe_int4_on_path(*args, 7.0, 2, 32, 12, path="decode")
    assert [c["SPLIT"] for c in reduce.calls] == [split or 1]
    assert out.dtype == x_dtype and out.shape == x.shape
    assert rel_err(out, want) < (TOL if x_dtype == F32 else max(TOL, 4e-3))
    assert torch.equal(out[1::2].cpu(), torch.zeros_like(x[1::2]))


@pytest.mark.parametrize("t,x_dtype,split", [(1, F32, 4), (1, BF16, None), (2, BF16, 4)])
def test_pair_rows_summed_by_the_gemv(monkeypatch, t, x_dtype, split):
    """The pairs path's scratch left unsummed (`defer_reduce`: PairRows) and passed as a
    projection's `add`: at one token the GEMV sums it in its epilogue (no reduce launch), as
    `reduce` would: fp32 within rounding of the order, bf16 within an ulp of the reduced sum
    (each is rounded to bf16 before the add, as the routed output was); past the GEMV's rows
    it is reduced first. Tokens without a local pair add 0 (token 1); the reference
    projection takes PairRows too; a sum of the wrong shape is refused."""
    from glm53.kernels import int4, int4_gemv, linear
    from glm53.kernels.ref import linear as ref_linear

    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", split)
    reduce = KernelLaunches(int4_gemv.pairs_reduce_kernel)
    monkeypatch.setattr(int4_gemv, "pairs_reduce_kernel", reduce)
    x, packed, wts, ids = _pairs_case(t, x_dtype, x_dtype)
    args = [a.to(DEVICE) for a in (x, *packed, wts, ids)]
    rows = int4.moe_int4_on_path(*args, 7.0, 2, 32, 12, True, path="decode")
    assert isinstance(rows, int4_gemv.PairRows) and rows.shape == (t, 96) and not reduce.calls
    summed = rows.reduce()
    gen = torch.Generator().manual_seed(60 + t)
    h = torch.randn(t, 40, generator=gen).to(x_dtype).to(DEVICE)
    w = (torch.randn(96, 40, generator=gen) / 8).to(x_dtype).to(DEVICE)
    reduce.calls.clear()
    fused = linear.linear(h, w, add=rows)
    assert len(reduce.calls) == (t > linear.GEMV_MAX_TOKENS)
    want = linear.linear(h, w, add=summed)
    tol = dict(rtol=1e-6, atol=1e-6) if x_dtype == F32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(fused, want, **tol)
    assert fused.abs().max() > 0.1  # a real sum, not zeros
    torch.testing.assert_close(ref_linear.linear(h, w, add=rows), ref_linear.linear(
        h, w, add=summed), rtol=0, atol=0)
    with pytest.raises(ValueError, match="add sums to"):
        linear.linear(h[:, :32], w[:32, :32], add=rows)


def test_decode_pairs_no_local_pair():
    """One token, all of whose experts are another rank's: zeros, in x's dtype."""
    from glm53.kernels import int4

    x, packed, wts, ids = _pairs_case(1, BF16, BF16)
    ids[0] = torch.tensor([0, 6, 11])
    out = int4.moe_int4_on_path(*(a.to(DEVICE) for a in (x, *packed, wts, ids)), 7.0, 2, 32,
                                path="decode")
    assert torch.equal(out.cpu(), torch.zeros(1, 96, dtype=BF16))


def test_decode_pairs_deterministic(monkeypatch):
    """No atomics on the pairs path: two runs agree bit for bit (4 K splits, two tokens with
    two local pairs each, expert 5 picked by both)."""
    from glm53.kernels import int4, int4_gemv

    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", 4)
    x, packed, wts, ids = _pairs_case(4, F32, F32)
    ids[2, 0] = 5
    args = [a.to(DEVICE) for a in (x, *packed, wts, ids)]
    first = int4.moe_int4_on_path(*args, 7.0, 2, 32, path="decode")
    assert torch.equal(int4.moe_int4_on_path(*args, 7.0, 2, 32, path="decode"), first)


@pytest.mark.parametrize("t,split", [(1, None), (3, 2)])
def test_decode_pairs_tiled_codes(monkeypatch, t, split):
    """tile_words' layout read with tiled=True gives the row-major result bit for bit (16-row,
    16-word tiles: D 256, I 128, group 128; w2 in K splits too); shapes off the tile refuse."""
    from glm53.kernels import int4_gemv

    monkeypatch.setattr(int4_gemv, "GEMV_W2_SPLIT", split)
    x, (q13, s13, z13, q2, s2, z2), wts, ids = _case(256, 128, 128, t, 3, 5, seed=7 + t)
    q13t, q2t = int4_gemv.tile_words(q13), int4_gemv.tile_words(q2)
    assert q13t.shape == q13.shape and not torch.equal(q13t, q13)
    def run(a13, a2, tiled):
        w13 = tuple(a.to(DEVICE) for a in (a13, s13, z13))
        w2 = tuple(a.to(DEVICE) for a in (a2, s2, z2))
        return int4_gemv.moe_decode_pairs(x.to(DEVICE), w13, w2, 128, 128, ids.to(DEVICE),
                                          wts.to(DEVICE), 1, 7.0, 8, tiled=tiled)

    outs = [run(q13, q2, False), run(q13t, q2t, True)]
    assert torch.equal(outs[0], outs[1])
    want = ref_int4.moe_int4(x, q13, s13, z13, q2, s2, z2, wts, ids, 7.0, 1, 128)
    assert rel_err(outs[1], want) < TOL
    with pytest.raises(ValueError, match="multiples of 16"):
        int4_gemv.tile_words(q13[:, :8])


@pytest.mark.parametrize("t", [1, 3])
def test_one_token_launch_takes_its_own_warps_and_lookahead(monkeypatch, t):
    """One token (the batch-1 step: few live pairs, so more bytes in flight a program):
    GEMV_WARPS_1 and GEMV_AHEAD_1; more tokens: GEMV_WARPS and GEMV_AHEAD. Same result."""
    from glm53.kernels import int4_gemv

    seen, launch = [], int4_gemv.launch
    monkeypatch.setattr(int4_gemv, "launch",
                        lambda *a, **kw: seen.append((kw["warps"], kw["ahead"])) or
                        launch(*a, **kw))
    x, (q13, s13, z13, q2, s2, z2), wts, ids = _case(64, 32, 32, t, 3, 5, seed=11 + t)
    out = int4_gemv.moe_decode_pairs(
        x.to(DEVICE), tuple(a.to(DEVICE) for a in (q13, s13, z13)),
        tuple(a.to(DEVICE) for a in (q2, s2, z2)), 32, 32, ids.to(DEVICE), wts.to(DEVICE), 1,
        7.0, 8)
    want = ((int4_gemv.GEMV_WARPS_1, int4_gemv.GEMV_AHEAD_1) if t == 1 else (None, None))
    assert seen == [want]
    assert rel_err(out, ref_int4.moe_int4(x, q13, s13, z13, q2, s2, z2, wts, ids, 7.0, 1,
                                          32)) < TOL
