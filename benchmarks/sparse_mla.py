# ruff: noqa: B023 (closures are timed immediately, inside their loop iteration)
"""KPool-DSA sparse-MLA decode on one GPU (performance.md: indexer + top-k + latent attention
>= 60% of HBM bandwidth at 32K-128K for the bytes they must read).

Per case (batch 1/16/64 x context 2K/32K/128K; 64 heads, and 32 for a TP2 rank) each stage is
timed alone and the whole decode call together, as CUDA-graph replays (median):
  score      indexer scoring of every pool the block table addresses (reads the pooled keys)
  select     radix top-k over the visible pool scores + expansion to token positions
  topk_torch torch.topk(sorted=False) over the same scores, for comparison (not used)
  attention  sparse latent attention over the 2051 selected rows (incl. the split merge)
  total      indexer_topk + sparse_mla_attention, as the layer calls them
with the bytes each must read (pooled keys 128 x bf16 a pool; scores fp32 once; latent rows
512 x bf16 each; with --kv-cache-dtype fp8 / nvfp4 the packed rows: 528 / 304 B a latent row,
132 B a pooled key) and that as % of the 4.3e12 B/s copy ceiling. A short sweep of the tiling
constants at 32K follows (for retuning). Every sequence owns its blocks, so reads come from
HBM, not L2. Before timing, each case checks its selection against torch.topk of the same
scores and its attention against the torch reference (`check_case`).

    python benchmarks/sparse_mla.py [--json benchmarks/results/sparse_mla_h200_<commit>.json]
        [--commit X] [--quick | --sweep-only] [--kv-cache-dtype bf16|fp8|nvfp4]
"""

from __future__ import annotations

import argparse
import json
import traceback
from datetime import UTC, datetime
from unittest import mock

import torch
from bench_common import git_commit, graph_ms

from glm53.kernels import radix_select, sparse_mla
from glm53.kernels.ref import latent_quant
from glm53.kernels.ref import sparse_mla as ref_sparse_mla
from glm53.kernels.utils import is_sm120

DEV = "cuda"
BW = 4.3e12  # measured device-to-device copy bandwidth of an H200, B/s
BLOCK, LATENT, BUDGET, KPOOL, INDEX_HEADS, INDEX_DIM = 64, 512, 512, 4, 32, 128
# the cache layout measured (main sets them from --kv-cache-dtype): latent rows and pooled keys
LATENT_FORMAT, POOL_FORMAT = "plain", "plain"
NVFP4_OUTER = 2.0**-9  # the calibration rule's scale for randn rows (|x| <= ~5.5)


def _row_bytes() -> tuple[int, int]:
    """Bytes of one latent row and one pooled key in the measured layout."""
    if LATENT_FORMAT == "plain":
        return LATENT * 2, INDEX_DIM * 2
    return latent_quant.row_bytes(LATENT_FORMAT, LATENT), latent_quant.fp8_row_bytes(INDEX_DIM)


def _attention(q, latent, table, qs, tokens, impl=sparse_mla):
    return impl.sparse_mla_attention(q, latent, table, qs, tokens, 1 / 16,
                                     latent_format=LATENT_FORMAT)


def _score(q_idx, w, pools, table, qs, pos):
    return sparse_mla._score_pools(q_idx, w, pools, table, qs, pos, KPOOL, POOL_FORMAT)


def _indexer(q_idx, w, pools, table, qs, pos):
    return sparse_mla.indexer_topk(q_idx, w, pools, table, qs, pos, BUDGET, KPOOL, POOL_FORMAT)


def _us(fn) -> float:
    return graph_ms(fn, rep=20) * 1e3


def _pct(nbytes: float, us: float) -> float:
    return 100 * nbytes / (us * 1e-6) / BW


def _case_inputs(batch, ctx, gen):
    """Paged latent + pooled-key caches with distinct blocks per sequence; one query each at
    the last position."""
    blocks = -(-ctx // BLOCK)
    table = torch.randperm(batch * blocks, device=DEV, generator=gen).view(batch, blocks)
    latent = torch.randn(batch * blocks, BLOCK, LATENT, device=DEV, dtype=torch.bfloat16,
                         generator=gen)
    pools = torch.randn(batch * blocks, BLOCK // KPOOL, INDEX_DIM, device=DEV,
                        dtype=torch.bfloat16, generator=gen)
    if LATENT_FORMAT != "plain":
        latent = latent_quant.pack_latent(latent.view(-1, LATENT), LATENT_FORMAT,
                                          NVFP4_OUTER).view(batch * blocks, BLOCK, -1)
        pools = latent_quant.pack_pool_keys(pools.view(-1, INDEX_DIM)).view(
            batch * blocks, BLOCK // KPOOL, -1)
    q_idx = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=DEV, dtype=torch.bfloat16,
                        generator=gen)
    w = torch.randn(batch, INDEX_HEADS, device=DEV, generator=gen) * INDEX_HEADS**-0.5
    pos = torch.full((batch,), ctx - 1, device=DEV)
    qs = torch.arange(batch, device=DEV)
    return table, latent, pools, q_idx, w, pos, qs


def check_case(scores, tokens, q, latent, table, qs, ctx) -> float:
    """What is timed must be right: every selected position lies in the context, the selected
    pools carry the top BUDGET visible scores (as values: ties may pick other pools), and the
    attention over them matches the torch reference. Returns the attention's max |error|
    relative to the reference's largest entry; raises on a wrong selection or error > 2e-2."""
    if int(tokens.min()) < -1 or int(tokens.max()) >= ctx:
        raise AssertionError(f"selected positions outside [-1, {ctx}): "
                             f"{int(tokens.min())}..{int(tokens.max())}")
    visible = ctx // KPOOL
    k = min(BUDGET, visible)
    picked = tokens[:, : k * KPOOL : KPOOL] // KPOOL
    if bool((picked < 0).any()):
        raise AssertionError("fewer pools selected than visible")
    got = scores.gather(1, picked).sort(dim=1).values
    want = torch.topk(scores[:, :visible], k, dim=1).values.sort(dim=1).values
    if not torch.equal(got, want):
        raise AssertionError("selection is not the top-k of the scores")
    out, lse = _attention(q, latent, table, qs, tokens)
    ref, ref_lse = _attention(q, latent, table, qs, tokens, ref_sparse_mla)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    if err > 2e-2 or not torch.allclose(lse, ref_lse, rtol=1e-3, atol=1e-2):
        raise AssertionError(f"attention differs from the reference: rel {err:.3g}")
    return err


def bench_case(batch, ctx, heads_list, gen, rows):
    table, latent, pools, q_idx, w, pos, qs = _case_inputs(batch, ctx, gen)
    n_pools = table.shape[1] * (BLOCK // KPOOL)
    visible = ctx // KPOOL
    scores = _score(q_idx, w, pools, table, qs, pos)
    tokens = radix_select.select_pools(scores, pos, BUDGET, KPOOL)
    k = min(BUDGET, n_pools)
    t_score = _us(lambda: _score(q_idx, w, pools, table, qs, pos))
    t_select = _us(lambda: radix_select.select_pools(scores, pos, BUDGET, KPOOL))
    t_topk = _us(lambda: torch.topk(scores, k, dim=-1, sorted=False))
    t_index = _us(lambda: _indexer(q_idx, w, pools, table, qs, pos))
    latent_row, pool_row = _row_bytes()
    score_bytes = batch * visible * pool_row
    select_bytes = batch * visible * 4
    sel_rows = int((tokens >= 0).sum())  # rows the attention must read, all queries
    att_bytes = sel_rows * latent_row
    for heads in heads_list:
        q = torch.randn(batch, heads, LATENT, device=DEV, dtype=torch.bfloat16, generator=gen)
        att_err = check_case(scores, tokens, q, latent, table, qs, ctx)
        t_att = _us(lambda: _attention(q, latent, table, qs, tokens))

        def step():
            _attention(q, latent, table, qs, _indexer(q_idx, w, pools, table, qs, pos))
        t_total = _us(step)
        plan = sparse_mla._attention_plan(batch, heads, tokens.shape[1], LATENT, False,
                                         is_sm120(q.device))
        row = dict(kernel="sparse_mla_decode", kv_cache_dtype=LATENT_FORMAT, heads=heads,
                   batch=batch, context=ctx,
                   pools_addressed=n_pools, rows_selected=sel_rows,
                   score_us=t_score, select_us=t_select, topk_torch_us=t_topk,
                   indexer_topk_us=t_index, attention_us=t_att, total_us=t_total,
                   score_bytes=score_bytes, select_bytes=select_bytes, attention_bytes=att_bytes,
                   total_bytes=score_bytes + att_bytes,
                   score_bw_pct=_pct(score_bytes, t_score),
                   select_bw_pct=_pct(select_bytes, t_select),
                   indexer_bw_pct=_pct(score_bytes, t_index),
                   attention_bw_pct=_pct(att_bytes, t_att),
                   total_bw_pct=_pct(score_bytes + att_bytes, t_total),
                   attention_splits=plan["splits"], attention_col_tiles=plan["grid_c"],
                   attention_rel_err=att_err)
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                          for k, v in row.items()}), flush=True)


# the attention tilings swept, as overrides of kernels/sparse_mla.py's constants (the defaults:
# COL_TILE 256, MIN_SPLIT_ROWS 128, ATTENTION_STAGES 4, ATTENTION_ROWS 32, ATTENTION_WARPS 4,
# TARGET_PROGRAMS 264)
ATTENTION_VARIANTS = (
    [dict(COL_TILE=c, MIN_SPLIT_ROWS=m) for c in (256, 512) for m in (64, 128, 256)]
    + [dict(ATTENTION_STAGES=n) for n in (2, 3)]
    + [dict(ATTENTION_ROWS=n) for n in (16, 64)]
    + [dict(ATTENTION_WARPS=8, ATTENTION_ROWS=n) for n in (32, 64)]
    + [dict(ATTENTION_WARPS=8, ATTENTION_STAGES=2)]  # the earlier default
    # the unhalved latent (fewer FLOPs, half the programs) on 8 warps
    + [dict(ATTENTION_WARPS=8, COL_TILE=512, MIN_SPLIT_ROWS=m) for m in (64, 256)]
    # waves: the programs wanted in flight (one program per SM fits at these tiles)
    + [dict(TARGET_PROGRAMS=n) for n in (132, 396)]
)


def _constants(module, **overrides):
    """A kernel module's constants (kernels/sparse_mla.py, radix_select.py) overridden inside a
    with-block."""
    return mock.patch.multiple(module, **overrides)


def bench_sweep(gen, rows, save):
    """The tiling constants at 32K context, 64 heads, batch 1, 16 and 64: latent halved
    (256-column tiles) or not x fewest rows per split, the attention pipeline depth, rows per
    attention step, warps, programs in flight, and the select chunk. Each variant's output is
    compared with the defaults' (`rel_err_vs_default`)."""
    for batch in (1, 16, 64):
        table, latent, pools, q_idx, w, pos, qs = _case_inputs(batch, 32768, gen)
        scores = _score(q_idx, w, pools, table, qs, pos)
        tokens = radix_select.select_pools(scores, pos, BUDGET, KPOOL)
        q = torch.randn(batch, 64, LATENT, device=DEV, dtype=torch.bfloat16, generator=gen)
        att_bytes = int((tokens >= 0).sum()) * _row_bytes()[0]
        o_default = _attention(q, latent, table, qs, tokens)[0]
        for variant in ATTENTION_VARIANTS:
            row = dict(kernel="sweep_attention", batch=batch, heads=64, **variant)
            try:  # a variant may not compile (shared memory, registers)
                with _constants(sparse_mla, **variant):
                    o = _attention(q, latent, table, qs, tokens)[0]
                    t = _us(lambda: _attention(q, latent, table, qs, tokens))
                err = float((o.float() - o_default.float()).norm() / o_default.float().norm())
                row.update(attention_us=t, attention_bw_pct=_pct(att_bytes, t),
                           rel_err_vs_default=err)
            except Exception as exc:
                row["error"] = repr(exc)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
        for chunk in (1024, 2048, 4096):
            with _constants(radix_select, SELECT_CHUNK=chunk):
                t = _us(lambda: radix_select.select_pools(scores, pos, BUDGET, KPOOL))
            rows.append(dict(kernel="sweep_select", batch=batch, select_chunk=chunk,
                             select_us=t))
            print(json.dumps(rows[-1]), flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16 at 32K only, no sweep")
    ap.add_argument("--sweep-only", action="store_true", help="the tiling sweep, not the grid")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8", "nvfp4"], default="bf16",
                    help="latent rows and pooled keys as a quantised cache stores them")
    args = ap.parse_args()
    global LATENT_FORMAT, POOL_FORMAT
    if args.kv_cache_dtype != "bf16":
        LATENT_FORMAT, POOL_FORMAT = args.kv_cache_dtype, "fp8"
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows: list[dict] = []

    def save() -> None:  # after every case: a run cut short keeps what it measured
        if args.json:
            out = dict(benchmark="sparse_mla_decode", kv_cache_dtype=args.kv_cache_dtype,
                       device=torch.cuda.get_device_name(),
                       commit=args.commit or git_commit(),
                       date=datetime.now(UTC).isoformat(timespec="seconds"),
                       torch=torch.__version__, bandwidth_ceiling_Bps=BW, results=rows)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    cases = [(b, c) for b in (1, 16, 64) for c in (2048, 32768, 131072)]
    if args.quick:
        cases = [(1, 32768), (16, 32768)]
    for batch, ctx in [] if args.sweep_only else cases:
        try:
            bench_case(batch, ctx, (64, 32), gen, rows)
        except Exception as exc:  # keep the other numbers when one case fails
            traceback.print_exc()
            rows.append(dict(kernel="sparse_mla_decode", batch=batch, context=ctx,
                             error=repr(exc)[:500]))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()  # the case's caches are gone: give the next one room
        save()
    if not args.quick:
        bench_sweep(gen, rows, save)
    save()


if __name__ == "__main__":
    main()
