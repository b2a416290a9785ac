"""Runs the sparse-MLA decode path (score, radix select, attention + merge) in the Triton
interpreter at a benchmark shape with GPU tiling constants, checking every unmasked load/store
address against the tensors that exist (the interpreter wraps int32 arithmetic like the GPU, so
an overflowing offset shows as an address outside every buffer). Buffers from torch.empty are
filled with garbage-looking values so an unwritten token slot shows too.

    python scripts/sparse_mla_bounds_check.py BATCH CONTEXT HEADS   # 16 131072 64: ~7 min
"""
# ruff: noqa: E402, E731
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
import numpy as np
import torch
import triton.runtime.interpreter as I

from glm53.kernels import radix_select
from glm53.kernels import sparse_mla as S

batch, ctx, heads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
radix_select.SELECT_CHUNK, S.COL_TILE, S.MIN_SPLIT_ROWS = 2048, 256, 128
RANGES = []
BAD = []
def reg(name, t):
    RANGES.append((name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return t
def check(ptrs, mask, nbytes, what):
    p = np.asarray(ptrs).reshape(-1).astype(np.uint64)
    m = np.asarray(mask).reshape(-1).astype(bool) if mask is not None else np.ones(p.shape, bool)
    p = p[m]
    if p.size == 0:
        return
    ok = np.zeros(p.shape, bool)
    for _, lo, hi in RANGES:
        ok |= (p >= lo) & (p + nbytes <= hi)
    if not ok.all():
        BAD.append((what, int(p[~ok][0]), int((~ok).sum())))
        raise RuntimeError(f"out of bounds {what}: {int((~ok).sum())} lanes, "
                           f"first {int(p[~ok][0]):#x}")
ol, os_ = I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store
def ml(self, ptrs, mask, other, *a):
    dt = I._get_np_dtype(ptrs.get_element_ty())
    check(ptrs.data, mask.data, np.dtype(dt).itemsize, "load")
    return ol(self, ptrs, mask, other, *a)
def ms(self, ptrs, value, mask, *a):
    check(ptrs.data, mask.data, value.data.dtype.itemsize, "store")
    return os_(self, ptrs, value, mask, *a)
I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store = ml, ms
orig_empty = torch.empty
def empty(*a, **k):  # garbage-looking fill so unwritten slots show, and register every buffer
    t = orig_empty(*a, **k)
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(0x3F3F3F3F)
    return reg("empty", t)
S.torch.empty = empty
S.torch.empty_like = lambda x, **k: empty(x.shape, dtype=k.get("dtype", x.dtype))

BLOCK, LATENT, BUDGET, KPOOL = 64, 512, 512, 4
g = torch.Generator().manual_seed(0)
blocks = -(-ctx // BLOCK)
table = reg("table", torch.randperm(batch * blocks, generator=g).view(batch, blocks))
t0 = time.time()
latent = reg("latent", torch.randn(batch * blocks, BLOCK, LATENT, generator=g).to(torch.bfloat16))
pools = reg("pools", torch.randn(batch * blocks, BLOCK // KPOOL, 128,
                                 generator=g).to(torch.bfloat16))
q_idx = reg("q_idx", torch.randn(batch, 32, 128, generator=g).to(torch.bfloat16))
w = reg("w", torch.randn(batch, 32, generator=g) * 32 ** -0.5)
pos = reg("pos", torch.full((batch,), ctx - 1))
qs = reg("qs", torch.arange(batch))
print("inputs", time.time() - t0, flush=True)
scores = S._score_pools(q_idx, w, pools, table, qs, pos, KPOOL, "plain")  # bf16 pool keys
print("score", time.time() - t0, flush=True)
tokens = radix_select.select_pools(scores, pos, BUDGET, KPOOL)
print("select", time.time() - t0, "token range", int(tokens.min()), int(tokens.max()),
      "rows", int((tokens >= 0).sum()), flush=True)
ref = torch.topk(scores, BUDGET, dim=-1).indices
for i in range(batch):
    got = tokens[i, :BUDGET * KPOOL].view(BUDGET, KPOOL)[:, 0] // KPOOL
    assert set(got.tolist()) == set(ref[i].tolist()), i
q = reg("q", torch.randn(batch, heads, LATENT, generator=g).to(torch.bfloat16))
print("plan", S._attention_plan(batch, heads, tokens.shape[1], LATENT, True))
out, lse = S.sparse_mla_attention(q, latent, table, qs, tokens, 1 / 16)
print("attention", time.time() - t0, "nan", bool(out.float().isnan().any()), flush=True)
print("BAD", BAD)
