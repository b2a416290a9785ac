# ruff: noqa: B023 (closures are timed immediately, inside their loop iteration)
"""Kernel microbenchmarks on one GPU (performance.md, benchmark 1): each kernel's time, the
bytes it must move and % of the measured copy bandwidth, against the reference and fla.

Decode-sized calls are timed as CUDA-graph replays (what a graph-captured step pays); prefill
calls with triton's do_bench (median). Prints a table and writes JSON.

    python benchmarks/kernels.py [--json benchmarks/results/kernels_h200_<commit>.json] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
from datetime import UTC, datetime

import torch
from bench_common import device_ms, git_commit, graph_ms
from triton.testing import do_bench

from glm53.kernels import kda, kda_chunk, kda_mixer, mhc, moe
from glm53.kernels.ref import kda as ref_kda

DEV = "cuda"
BW = 4.3e12  # measured device-to-device copy bandwidth of an H200 (read + write), B/s


def _ms(fn, graph: bool) -> float:
    if graph:
        return graph_ms(fn, rep=50)
    return float(do_bench(fn, warmup=10, rep=100, return_mode="median"))


def _fla():
    try:
        import fla.ops.kda as fla_kda
    except ImportError:
        return None
    return fla_kda


def _kda_inputs(t, heads, gen):
    mixed = torch.randn(t, 3 * heads * 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    q, k, v = (c.view(t, heads, 128) for c in mixed.chunk(3, dim=-1))
    g = -5 * torch.sigmoid(torch.randn(t, heads, 128, device=DEV, generator=gen))
    beta = torch.sigmoid(torch.randn(t, heads, device=DEV, generator=gen))
    return q, k, v, g, beta


def _decode_inputs(batch, heads, gen, slots=256):
    q, k, v, g, beta = _kda_inputs(batch, heads, gen)
    state = torch.randn(slots, heads, 128, 128, device=DEV, generator=gen) * 0.01
    ids = torch.randperm(slots, device=DEV, generator=gen)[:batch]
    cu = torch.arange(batch + 1, device=DEV)
    init = torch.ones(batch, dtype=torch.bool, device=DEV)
    return q, k, v, g, beta, state, ids, cu, init


def bench_kda_decode(rows, gen, quick):
    """Our decode recurrence over state slots (one token per sequence), eager and as graph
    replays, and the whole decode-side KDA op chain of a layer (conv + gate + recurrence +
    gated norm) replayed in a graph, separately and as the fused mixer: performance.md's ≤5 µs
    per layer at batch 1."""
    for heads in (32, 64):
        for batch in (1, 8, 64) if not quick else (1, 64):
            q, k, v, g, beta, state, ids, cu, init = _decode_inputs(batch, heads, gen)

            def rec():
                kda.kda_attention(q, k, v, g, beta, state, cu, ids, init)
            # fp32 state read + write dominates; q/k/v/g/o are small
            nbytes = batch * heads * 128 * 128 * 4 * 2
            eager, graph = _ms(rec, False), _ms(rec, True)
            row = dict(kernel="kda_decode", heads=heads, batch=batch, ours_us=eager * 1e3,
                       ours_graph_us=graph * 1e3, bytes=nbytes,
                       graph_bw_pct=100 * nbytes / (graph * 1e-3) / BW)
            chans = 3 * heads * 128
            x = torch.randn(batch, chans, device=DEV, dtype=torch.bfloat16, generator=gen)
            w = torch.randn(chans, 4, device=DEV, generator=gen)
            conv = torch.zeros(256, chans, 3, device=DEV, dtype=torch.bfloat16)
            logits = torch.randn(batch, heads * 128, device=DEV, dtype=torch.bfloat16,
                                 generator=gen)
            dt, alog = torch.zeros(heads * 128, device=DEV), torch.zeros(heads, device=DEV)
            normw = torch.ones(128, device=DEV, dtype=torch.bfloat16)

            def layer():
                y = kda.causal_conv1d(x, w, conv, cu, ids, init)
                qq, kk, vv = (c.view(batch, heads, 128) for c in y.chunk(3, dim=-1))
                gg = kda.kda_gate(logits, dt, alog, -5.0)
                o = kda.kda_attention(qq, kk, vv, gg, beta, state, cu, ids, init)
                kda.gated_rms_norm(o, vv, normw, 1e-5)
            row["layer_ops_graph_us"] = _ms(layer, True) * 1e3
            z = torch.randn(batch, heads, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
            bl = torch.randn(batch, heads, device=DEV, dtype=torch.bfloat16, generator=gen)

            def mixer():  # the same chain fused into one launch
                kda_mixer.kda_mixer(x, w, conv, logits, dt, alog, -5.0, bl, z, normw, 1e-5,
                                    state, cu, ids, init)
            row["mixer_graph_us"] = _ms(mixer, True) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)


def bench_kda_decode_fla(rows, gen, quick):
    """fla's fused_recurrent_kda on the same decode shapes (batch form, one token per
    sequence, in-place state slots), eager and as graph replays. A separate part: an earlier
    H200 run died with an illegal address around this call (most likely the timing race `graph_ms`
    now closes: the graph benchmark's stream read inputs still being written)."""
    fla = _fla()
    if fla is None:
        rows.append(dict(kernel="kda_decode_fla", error="fla not installed"))
        return
    for heads in (32, 64):
        for batch in (1, 8, 64) if not quick else (1, 64):
            q, k, v, g, beta, state, ids, cu, init = _decode_inputs(batch, heads, gen)
            qc, kc, vc = (x.contiguous().unsqueeze(1) for x in (q, k, v))
            gc, bc = g.unsqueeze(1).contiguous(), beta.unsqueeze(1).contiguous()
            ids32 = ids.to(torch.int32)

            def run_fla():
                fla.fused_recurrent_kda(qc, kc, vc, gc, bc, initial_state=state,
                                        inplace_final_state=True, ssm_state_indices=ids32,
                                        use_qk_l2norm_in_kernel=True)
            row = dict(kernel="kda_decode_fla", heads=heads, batch=batch,
                       fla_us=_ms(run_fla, False) * 1e3)
            row["fla_graph_us"] = _ms(run_fla, True) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)


ROUNDS = 3  # alternating timing rounds of the dispatch and fla direct


def bench_kda_prefill(rows, gen, quick, head_counts=(32, 64)):
    """Chunked prefill on the same inputs (initial states, final states out, in-kernel l2norm):
    what `kda_attention` dispatches to for the model's bounded gate (fla's `chunk_kda` with its
    bounded-gate path, through our slot gather/scatter, when fla is installed), our own chunked
    kernel, our recurrent kernel, and fla called directly: with its defaults, and with the
    bounded-gate path. q, k and v are dense planes, as the layer's conv writes them. Then the
    gate as well, from the projection's logits: the layer's prefill call (`kda_gated_attention`,
    the gate inside fla's chunk cumsum), the gate op + `kda_attention` it replaced, and fla's
    own call with the gate in its kernel (default and bounded-gate paths)."""
    fla = _fla()
    cases = [(32, [4096]), (32, [16384]), (32, [2048] * 8), (64, [4096]), (64, [16384])]
    cases = [(h, lens) for h, lens in cases if h in head_counts]
    for heads, lens in cases if not quick else cases[:1]:
        t, n = sum(lens), len(lens)
        q, k, v, g, beta = _kda_inputs(t, heads, gen)  # g = -5 sigmoid(.): bounded by -5
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        state = torch.randn(n + 1, heads, 128, 128, device=DEV, generator=gen) * 0.01
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
        ids = torch.arange(1, n + 1, device=DEV)
        init = torch.ones(n, dtype=torch.bool, device=DEV)
        args = (q, k, v, g, beta, state, cu, ids, init)
        row = dict(kernel="kda_prefill", heads=heads, tokens=t, seqs=n)
        row["ours_chunk_ms"] = _ms(lambda: kda_chunk.kda_chunk_attention(*args), False)
        row["ours_chunk_mtok_per_s"] = t / row["ours_chunk_ms"] / 1e3
        # our recurrent kernel, forced
        saved, kda.CHUNK_MIN_TOKENS_PER_SEQ = kda.CHUNK_MIN_TOKENS_PER_SEQ, 1 << 62
        try:
            row["ours_recurrent_ms"] = _ms(lambda: kda.kda_attention(*args), False)
        finally:
            kda.CHUNK_MIN_TOKENS_PER_SEQ = saved

        cu_host = cu.cpu()

        def dispatch(cu=cu, cu_host=cu_host):
            return kda.kda_attention(*args[:6], cu, *args[7:], gate_lower_bound=-5.0,
                                     cu_seqlens_host=cu_host)

        def new_step(host: bool):
            # a step's first KDA layer: fresh cu_seqlens, so fla plans its chunks again (the
            # later layers of the step hit fla's cache of the plan)
            return dispatch(cu.clone(), cu_host.clone() if host else None)
        if fla is None:
            row["dispatch_ms"] = _ms(dispatch, False)
        else:
            h0 = state[ids]

            def fla_direct(safe_gate=False):
                return fla.chunk_kda(q[None], k[None], v[None], g[None], beta[None],
                                     scale=128 ** -0.5, initial_state=h0,
                                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     safe_gate=safe_gate, cu_seqlens=cu)
            # same answer first: the dispatch (states through the slots) against fla's default
            want, want_h = fla_direct()
            before = state.clone()
            got = dispatch()
            row["dispatch_rel_err"] = float((got.float() - want[0].float()).norm()
                                            / want.float().norm())
            row["state_rel_err"] = float((state[ids] - want_h).norm() / want_h.norm())
            state.copy_(before)
            row["check"] = "ok" if max(row["dispatch_rel_err"], row["state_rel_err"]) < 2e-2 \
                else "FAILED"
            # the gate too, from the projection's logits (dt_bias = A_log = 0 gives the same
            # g = -5 sigmoid(x) as above): the layer's prefill call, the two-op form it
            # replaced, and fla's own call with the gate in its kernel
            logits = torch.randn(t, heads * 128, device=DEV, dtype=torch.bfloat16,
                                 generator=gen)
            dt0 = torch.zeros(heads * 128, device=DEV)
            alog0 = torch.zeros(heads, device=DEV)

            def gated():
                return kda.kda_gated_attention(q, k, v, logits, dt0, alog0, -5.0, beta, state,
                                               cu, ids, init, cu_host)

            def two_ops():
                return kda.kda_attention(q, k, v, kda.kda_gate(logits, dt0, alog0, -5.0), beta,
                                         state, cu, ids, init, gate_lower_bound=-5.0,
                                         cu_seqlens_host=cu_host)

            def fla_gated(safe_gate=False):
                return fla.chunk_kda(q[None], k[None], v[None], logits.view(q.shape)[None],
                                     beta[None], scale=128 ** -0.5, initial_state=h0,
                                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     use_gate_in_kernel=True, A_log=alog0, dt_bias=dt0,
                                     lower_bound=-5.0, safe_gate=safe_gate, cu_seqlens=cu)
            before = state.clone()
            got = gated()
            want = fla_gated()[0][0]
            state.copy_(before)
            row["gated_rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
            if row["gated_rel_err"] >= 2e-2:
                row["check"] = "FAILED"
            # alternate them (fla autotunes on first use; clocks drift): best of rounds. Wall
            # time (do_bench) is host-bound at these sizes: the launches cost more host time
            # than the kernels run; device time hides the host (bench_common.device_ms)
            timed = {"dispatch": dispatch, "fla_chunk": fla_direct,
                     "fla_safe_gate": lambda: fla_direct(True), "gated": gated,
                     "two_ops": two_ops, "fla_gated": fla_gated,
                     "fla_gated_safe_gate": lambda: fla_gated(True)}
            times = {f"{key}_{kind}": [] for key in timed for kind in ("ms", "device_ms")}
            for _ in range(ROUNDS):
                for key, fn in timed.items():
                    times[f"{key}_ms"].append(_ms(fn, False))
                    times[f"{key}_device_ms"].append(device_ms(fn))
            row.update({key: min(vals) for key, vals in times.items()})
            row["rounds_ms"] = times
            row["dispatch_vs_fla"] = row["fla_chunk_ms"] / row["dispatch_ms"]
            row["dispatch_vs_fla_device"] = row["fla_chunk_device_ms"] / row["dispatch_device_ms"]
            row["dispatch_vs_fla_safe_gate_device"] = (row["fla_safe_gate_device_ms"]
                                                       / row["dispatch_device_ms"])
            row["ours_chunk_vs_fla"] = row["fla_chunk_ms"] / row["ours_chunk_ms"]
            for kind in ("ms", "device_ms"):
                row[f"gated_vs_fla_gated_{kind}"] = row[f"fla_gated_{kind}"] / row[f"gated_{kind}"]
                row[f"gated_vs_two_ops_{kind}"] = row[f"two_ops_{kind}"] / row[f"gated_{kind}"]
            row["new_step_ms"] = _ms(lambda: new_step(True), False)
            row["new_step_without_host_cu_ms"] = _ms(lambda: new_step(False), False)
        rows.append(row)
        print(json.dumps(row), flush=True)


def bench_moe(rows, gen, quick):
    e, d, inter = 288, 4096, 2048
    w13 = torch.randn(e, 2 * inter, d, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, d, inter, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
    for tokens in (1, 16, 64, 512) if not quick else (1, 64):
        x = torch.randn(tokens, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        ids = torch.stack([torch.randperm(e, device=DEV, generator=gen)[:8]
                           for _ in range(tokens)])
        wts = torch.rand(tokens, 8, device=DEV, generator=gen)
        t = _ms(lambda: moe.fused_moe(x, w13, w2, wts, ids, 10.0), True)
        n_exp = int(ids.unique().numel())
        nbytes = n_exp * 3 * d * inter * 2
        rows.append(dict(kernel="fused_moe_bf16", tokens=tokens, experts_hit=n_exp,
                         ours_us=t * 1e3, bytes=nbytes, bw_pct=100 * nbytes / (t * 1e-3) / BW))


def bench_mhc(rows, gen, quick):
    """The mHC sites (release: 4 streams of 4096, 20 Sinkhorn iterations). Decode sizes (1, 16,
    64 tokens) as graph replays: `hc_pre` (mixing pass + one program a token), `hc_post_pre`
    (an expansion and the next site's projection, then the gates) and `hc_post`; at one token
    `hc_pre` also with one Sinkhorn iteration and at mhc.PRE_WARPS 4 / 8 / 16, which split the
    gate launch's latency into its parts; at 16 and 64 the mixing pass's tl.dot at the other
    MIX_PRECISION too. A 2048-token prefill chunk: `hc_pre` over mhc.MIX_LARGE's (tokens,
    columns, steps) tiles of its mixing pass at either MIX_PRECISION (tl.dot's "ieee" or
    "tf32x3"), against the reference's fp32 matmul of the streams (a cast and a cuBLAS GEMM)
    for scale."""
    n, d, iters = 4, 4096, 20
    m = (2 + n) * n
    fn = torch.randn(m, n * d, device=DEV, generator=gen) * 0.01
    base = torch.randn(m, device=DEV, generator=gen) * 0.1
    scale = torch.rand(3, device=DEV, generator=gen)
    norm_w = torch.rand(d, device=DEV, dtype=torch.bfloat16, generator=gen)
    defaults = dict(PRE_WARPS=mhc.PRE_WARPS, MIX_LARGE=mhc.MIX_LARGE,
                    MIX_PRECISION=mhc.MIX_PRECISION)
    other_precision = "ieee" if mhc.MIX_PRECISION == "tf32x3" else "tf32x3"

    def pre_us(streams, it, graph, **consts):
        for name, value in consts.items():
            setattr(mhc, name, value)
        try:
            return 1e3 * _ms(lambda: mhc.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, it,
                                                norm_w, 1e-6), graph)
        finally:
            for name, value in defaults.items():
                setattr(mhc, name, value)

    for tokens in (1, 16, 64) if not quick else (1,):
        streams = torch.randn(tokens, n, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        y = torch.randn(tokens, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        post, comb, _ = mhc.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, iters, norm_w, 1e-6)
        nbytes = streams.numel() * 2 + fn.numel() * 4
        settings = [dict(it=iters)]
        if tokens == 1:
            settings += [dict(it=1)] + [dict(it=iters, PRE_WARPS=w) for w in (4, 8, 16)
                                        if w != mhc.PRE_WARPS]
        else:
            settings += [dict(it=iters, MIX_PRECISION=other_precision)]
        for c in settings:
            it = c.pop("it")
            t = pre_us(streams, it, True, **c)
            rows.append(dict(kernel="hc_pre", tokens=tokens, sinkhorn_iters=it, **c,
                             ours_us=t, bytes=nbytes, bw_pct=100 * nbytes / (t * 1e-6) / BW))
        t = 1e3 * _ms(lambda: mhc.hc_post_pre(streams, y, post, comb, fn, base, scale, 1e-6,
                                              1e-6, iters, norm_w, 1e-6), True)
        rows.append(dict(kernel="hc_post_pre", tokens=tokens, ours_us=t))
        t = 1e3 * _ms(lambda: mhc.hc_post(streams, y, post, comb), True)
        rows.append(dict(kernel="hc_post", tokens=tokens, ours_us=t))
    tokens = 2048
    streams = torch.randn(tokens, n, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    # MIX_LARGE (tokens, columns, steps): the tile, then K loops of it (fewer programs, fewer
    # parts), then taller tiles over narrower steps (fn read once per more tokens)
    tiles = [(16, 64, 1), (16, 128, 1), (16, 256, 1), (32, 64, 1), (32, 128, 1),
             (16, 128, 4), (16, 128, 16), (32, 64, 8), (32, 64, 32), (64, 32, 16), (64, 32, 64)]
    for prec in ("ieee", "tf32x3"):
        for bt, bc, steps in tiles:
            t = pre_us(streams, iters, False, MIX_LARGE=(bt, bc, steps), MIX_PRECISION=prec)
            rows.append(dict(kernel="hc_pre", tokens=tokens, mix_precision=prec,
                             mix_tokens=bt, mix_columns=bc, mix_steps=steps, ours_us=t))
    flat = streams.view(tokens, n * d)
    t = 1e3 * _ms(lambda: flat.float() @ fn.t(), False)
    rows.append(dict(kernel="hc_projection_fp32_matmul", tokens=tokens, ref_us=t))


def bench_ref_kda_decode(rows, gen):
    """The reference recurrence at batch 1 (what the CPU path runs), for scale."""
    q, k, v, g, beta = _kda_inputs(1, 64, gen)
    state = torch.zeros(4, 64, 128, 128, device=DEV)
    cu, ids = torch.tensor([0, 1], device=DEV), torch.tensor([2], device=DEV)
    init = torch.ones(1, dtype=torch.bool, device=DEV)
    t = _ms(lambda: ref_kda.kda_attention(q, k, v, g, beta, state, cu, ids, init), False)
    rows.append(dict(kernel="kda_decode_ref_eager", heads=64, batch=1, ref_us=t * 1e3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--commit", help="the commit measured (the device copy has no .git)")
    ap.add_argument("--parts", default="kda_decode,kda_decode_fla,kda_prefill,moe",
                    help="comma-separated subset (run parts in separate processes to isolate a "
                         "fault: an illegal access poisons the CUDA context; --json then "
                         "appends to the file)")
    ap.add_argument("--prefill-heads", default="32,64",
                    help="head counts of the kda_prefill cases (comma-separated)")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows: list[dict] = []
    prefill_heads = tuple(int(h) for h in args.prefill_heads.split(","))
    parts = {"kda_decode": bench_kda_decode, "kda_decode_fla": bench_kda_decode_fla,
             "kda_prefill": functools.partial(bench_kda_prefill, head_counts=prefill_heads),
             "moe": bench_moe, "mhc": bench_mhc}
    for name in args.parts.split(","):
        try:
            parts[name](rows, gen, args.quick)
        except Exception as exc:  # keep the other numbers when one part fails
            rows.append(dict(kernel=name, error=repr(exc)[:500]))
        torch.cuda.empty_cache()
    if "kda_decode" in args.parts:
        bench_ref_kda_decode(rows, gen)
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in r.items()}))
    if args.json:
        commit = args.commit or git_commit()
        fla = _fla()
        out = dict(benchmark="kernels", device=torch.cuda.get_device_name(), commit=commit,
                   date=datetime.now(UTC).isoformat(timespec="seconds"),
                   torch=torch.__version__, fla=getattr(fla, "__name__", None) and
                   __import__("fla").__version__, bandwidth_ceiling_Bps=BW, results=rows)
        try:  # parts run in separate processes accumulate in one file
            with open(args.json) as f:
                earlier = json.load(f)
            if earlier.get("commit") == commit:
                out["results"] = earlier["results"] + rows
        except (OSError, ValueError):
            pass
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
