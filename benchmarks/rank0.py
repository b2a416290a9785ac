"""Rank-0 emulation (performance.md §5.1): the full-depth model (45 layers + MTP, embedding,
lm_head) with rank 0's exact TP2/EP2/DCP2 shapes on one GPU, routed experts in 4 bits (EXL3 K4
codes by default, random), random bf16 elsewhere, collectives as no-ops, uniform top-8 routing.
Built by the serving code (`glm53.actors.emulation.build_rank0`: `build_model` on the meta
device, `materialize`, random fill on the GPU).

Measures decode steps with CUDA graphs at each BATCHxCONTEXT: `graph_ms` (one replay of the
captured forward + lm_head), `engine_step_ms` (the step as the model runner serves it:
host arrays -> static buffers -> replay -> sampling -> tokens on the host) and
`engine_step_overlapped_ms` (the same with step N+1 launched before step N's tokens are
waited for, as overlapped execution runs steps: slice.engine_step_ms), and the modeled
bytes the step reads (weights that run, the routed experts the batch touches in expectation,
KDA state read + write, DSA pooled keys + selected latent rows) as % of 4.3 TB/s. Also the
weight GiB per part and the KV pool left on the rank, for each latent-cache format asked for
(`--kv-cache-dtype bf16,fp8,nvfp4`: one model, its caches reallocated per format). A case
whose sequences do not fit the pool shares physical blocks between its sequences
(`kv_shared`: same bytes read per step, the capacity is reported separately).

Each case also times the MTP3 cycle of issue 20 (`mtp3_cycle_ms`, mtp_cycle.py): the verify
step of 4 tokens a sequence through the runner's decode graphs, sampling, acceptance on the
host, then the graph after acceptance (the KDA commit and the MTP proposer's 3 drafts), as
ModelRunner.launch runs it, with its split (`mtp3_cycle_split`: verify + sample, accept,
commit + draft, and the drafts the timed cycles accepted). Acceptance is synthetic by
default (`--mtp-acceptance 1,1,0`: 2 drafts a cycle, 3 tokens, the whole number nearest the
published runs; `measured` applies the real rule to the random model's drafts).
`mtp3_tokens_per_cycle_assumed` is the accepted length of published GLM-5.3-Flash MTP3 runs
(2.6-2.8 tokens a cycle, issue 20), stated, not measured.

`--prefill CHUNK[xDEPTH],...` adds prefill rows (phase "prefill"): one sequence's chunk after
DEPTH cached tokens, eager as the engine prefills, only the last row's logits: wall ms, tok/s,
the modeled GFLOP a token on this rank (`prefill_gflop_per_token`, performance.md §4.4 at rank
0's shapes), TFLOP/s and MFU against 790 TFLOP/s, and the kernels one chunk launches.

    python benchmarks/rank0.py [--json benchmarks/results/rank0_h200_<commit>.json]
        [--commit SHA] [--decode 1x8192,...] [--experts exl3|int4] [--utilization 0.9]
        [--profile] [--compare-pdl] [--graph-only] [--kv-cache-dtype bf16[,fp8,nvfp4]]
        [--mtp-acceptance 1,1,0|measured]
        [--prefill 2048,8192,16384,8192x32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import traceback
from datetime import UTC, datetime

import torch
from bench_common import kernel_profile, unit_scale_bank
from mtp_cycle import mtp_cycle_ms
from slice import BLOCK, _timed, engine_step_ms

from glm53.actors.caches import ModelCaches, cache_bytes, latent_bytes_per_token, pool_row
from glm53.actors.config import ModelConfig
from glm53.actors.emulation import build_rank0
from glm53.actors.forward_batch import ForwardBatch
from glm53.actors.loader import with_expert_format
from glm53.actors.memory_plan import activation_bytes_per_token, weight_bytes
from glm53.actors.parallel import ParallelConfig
from glm53.actors.release import exl3_release_config, release_config
from glm53.kernels import utils as kernel_utils

DEV = "cuda"
PLAN = ParallelConfig(tp=2, ep=2, dcp=2)
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (performance.md)
GRAPH_RESERVE = 6 * 2**30  # graphs' private pools and workspace during the run
MTP_SPEC = 3  # drafts a cycle of the MTP3 setting
PEAK_TFLOPS = 790.0  # dense bf16 the prefill MFU is taken against (performance.md §4.4)
# tokens an MTP3 cycle emits in published GLM-5.3-Flash runs (issue 20): stated, not measured
MTP3_TOKENS_PER_CYCLE = (2.6, 2.8)


def emulation_config(experts: str, layers: int | None = None) -> ModelConfig:
    """The release config with `experts`; `layers`: only the first N trunk layers (debugging)."""
    if experts == "exl3":
        cfg = ModelConfig.from_hf(exl3_release_config())
    else:
        cfg = with_expert_format(ModelConfig.from_hf(release_config()), experts)
    if layers is None:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=layers,
                               layer_types=cfg.layer_types[:layers],
                               mlp_layer_types=cfg.mlp_layer_types[:layers])


def _param_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def step_bytes(model, batch: int, context: int, kv_cache_dtype: str = "bf16") -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `context` reads on this rank (GB), the
    latent rows and pooled keys at `kv_cache_dtype`'s width."""
    cfg = model.config
    dense = experts = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name == "embed_tokens.weight":
            continue  # the MTP layer does not run in a decode step; one embedding row a token
        if ".mlp.experts." in name:
            experts += _param_bytes(p)
        else:
            dense += _param_bytes(p)
    n_local = next(m.mlp.experts.n_local for m in model.layers if hasattr(m.mlp, "experts"))
    # each token picks k distinct of E experts uniformly: expected distinct local experts
    touched = n_local * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)
    expert_bytes = experts / n_local * touched
    caches_per_seq = 0.0
    heads = cfg.linear_num_heads // model.parallel.tp_size
    state = heads * cfg.linear_head_dim ** 2 * 4 + 3 * heads * cfg.linear_head_dim * (
        cfg.linear_conv_kernel - 1) * 2
    caches_per_seq += len(cfg.kda_layers) * 2 * state  # read and written back
    dcp = model.parallel.dcp_size
    selected = min(context, cfg.index_topk + cfg.index_kpool) / dcp
    latent_row = latent_bytes_per_token(cfg, kv_cache_dtype, torch.bfloat16)
    _, pool_dtype, pool_width = pool_row(cfg, kv_cache_dtype, torch.bfloat16)
    pool_key = pool_width * pool_dtype.itemsize
    caches_per_seq += len(cfg.dsa_layers) * (
        context / cfg.index_kpool * pool_key + selected * latent_row)
    embed = batch * cfg.hidden_size * 2
    return dict(weights_gb=dense / 1e9, experts_gb=expert_bytes / 1e9,
                caches_gb=batch * caches_per_seq / 1e9,
                total_gb=(dense + expert_bytes + embed + batch * caches_per_seq) / 1e9)


def reps_for(ms: float, budget_ms: float = 3000.0) -> int:
    """Timed repetitions that fit `budget_ms` (3..20): slow formats still finish a case."""
    return int(min(20, max(3, budget_ms // max(ms, 1e-3))))


def graph_replay_ms(model, caches, batch: int, context: int, tables,
                    profile: bool = False) -> tuple[float, dict | None]:
    """(ms of one replay of the captured decode step, its kernels' device time profiled on one
    eager step when `profile`)."""
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=DEV)
    fb = ForwardBatch.build([context - 1] * batch, [1] * batch, list(range(batch)), tables,
                            BLOCK, device=DEV)

    def step():
        return model.compute_logits(model(ids, fb, caches)).argmax(-1)
    # a host sync would invalidate the capture: find it first, with its traceback
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = _timed(graph.replay, reps_for(_timed(graph.replay, 1)))
    del graph
    return ms, kernel_profile(step, top=200) if profile else None


def graph_ms_pdl_off(model, caches, batch: int, context: int, tables) -> float:
    """`graph_replay_ms` with every kernel launched without programmatic dependent launch."""
    pdl_on = kernel_utils.PDL
    kernel_utils.PDL = frozenset()
    try:
        return graph_replay_ms(model, caches, batch, context, tables)[0]
    finally:
        kernel_utils.PDL = pdl_on


def prefill_gflop_per_token(model, depth: int, chunk: int) -> float:
    """Modeled GFLOP this rank computes per token of a prefill chunk of `chunk` tokens after
    `depth` cached ones (performance.md §4.4, at rank 0's shapes): 2 x the linear weights a
    token runs through here (every trunk weight of the shard but the embedding, lm_head (one
    row a chunk) and MTP layer; of the routed experts, its 8 picks' share on this rank, 8 x
    n_local / n_routed under uniform routing); KDA's chunked form (C = 64: 5 x 2 C d + 3 x 2
    d^2 per head); the absorbed sparse MLA (2 x sel x (512 + 512) per head, sel = min(pos + 1,
    2048), over this rank's heads, or all heads over half the rows under DCP2: the same); the
    indexer (2 x heads x d x pos / kpool, replicated: every rank scores every pool)."""
    cfg, ps = model.config, model.parallel
    skip = ("mtp.", "embed_tokens.", "lm_head.")
    # every matrix a token runs through (the depthwise conv's taps too: 2 C K, as counted);
    # routed experts apart: stored as 4-bit codes, their element counts are not weights
    dense = sum(p.numel() for name, p in model.named_parameters()
                if p.dim() == 2 and not name.startswith(skip) and ".mlp.experts." not in name)
    n_local = next(m.mlp.experts.n_local for m in model.layers if hasattr(m.mlp, "experts"))
    n_moe = sum(hasattr(m.mlp, "experts") for m in model.layers)
    expert_params = n_moe * n_local * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active_experts = expert_params * cfg.num_experts_per_tok / cfg.n_routed_experts
    linear = 2 * (dense + active_experts)
    d, heads = cfg.linear_head_dim, cfg.linear_num_heads // ps.tp_size
    kda = len(cfg.kda_layers) * heads * (5 * 2 * 64 * d + 3 * 2 * d * d)
    positions = torch.arange(depth, depth + chunk, dtype=torch.float64)
    sel = torch.clamp(positions + 1, max=cfg.index_topk).mean().item()
    mla_heads = cfg.num_attention_heads // ps.tp_size
    mla = len(cfg.dsa_layers) * mla_heads * 2 * sel * 2 * cfg.kv_lora_rank
    pools = (positions + 1).div(cfg.index_kpool).floor().mean().item()
    indexer = len(cfg.dsa_layers) * 2 * cfg.index_n_heads * cfg.index_head_dim * pools
    return (linear + kda + mla + indexer) / 1e9


def prefill_case(model, caches, cfg, chunk: int, depth: int) -> dict:
    """One prefill chunk of `chunk` tokens of one sequence after `depth` cached tokens (their
    rows: whatever the pool holds; random weights), eager as the engine runs prefill, only
    the last row's logits: wall ms (host launches included), tokens/s, modeled TFLOP/s and
    MFU against PEAK_TFLOPS, and the kernels launched (one profiled call)."""
    per = -(-(depth + chunk) // BLOCK)
    ids = torch.randint(0, cfg.vocab_size, (chunk,), device=DEV)
    fb = ForwardBatch.build([depth], [chunk], [0], [list(range(1, 1 + per))], BLOCK,
                            device=DEV)

    def step():
        return model.compute_logits(model(ids, fb, caches)[-1:]).argmax(-1)

    ms = _timed(step, reps_for(_timed(step, 1)))
    gflop = prefill_gflop_per_token(model, depth, chunk)
    tflops = gflop * chunk / (ms * 1e-3) / 1e3
    prof = kernel_profile(step, top=15)
    return dict(phase="prefill", batch=1, context=depth + chunk, depth=depth, chunk=chunk,
                ms=ms, tok_s=chunk / (ms * 1e-3), gflop_per_token=round(gflop, 3),
                tflops=round(tflops, 1), mfu_pct=round(tflops / PEAK_TFLOPS * 100, 1),
                launches=prof["launches"], device_ms=prof["device_ms"],
                top_kernels=prof["kernels"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--commit")
    ap.add_argument("--decode", default="1x8192,16x8192,64x8192,1x131072,16x131072,64x131072")
    ap.add_argument("--prefill", default="",
                    help="prefill chunks CHUNK[xDEPTH],... (e.g. 2048,8192,16384x32768): one "
                         "sequence's chunk after DEPTH cached tokens, eager, MFU (issue 20)")
    ap.add_argument("--experts", choices=["exl3", "int4"], default="exl3")
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--layers", type=int, default=None,
                    help="only the first N trunk layers (to debug a failing case quickly)")
    ap.add_argument("--graph-only", action="store_true",
                    help="decode cases: the graph replay alone (no engine step, no MTP3 cycle)")
    ap.add_argument("--compare-pdl", action="store_true",
                    help="also time each decode replay captured with programmatic dependent "
                         "launch off (graph_ms_pdl_off; kernels.utils.pdl)")
    ap.add_argument("--profile", action="store_true",
                    help="device time per kernel of one eager decode step per case")
    ap.add_argument("--kv-cache-dtype", default="bf16",
                    help="latent-cache formats to run, comma-separated (bf16, fp8, nvfp4)")
    ap.add_argument("--mtp-acceptance", default="1,1,0",
                    help="the MTP3 cycle's synthetic acceptance probability per draft "
                         "position, or 'measured' (the real rule on the random drafts)")
    args = ap.parse_args()
    acceptance = (None if args.mtp_acceptance == "measured" else
                  tuple(float(p) for p in args.mtp_acceptance.split(",")))
    cases = [tuple(int(v) for v in c.split("x")) for c in args.decode.split(",") if c]
    prefills = [(int(c.split("x")[0]), int(c.split("x")[1]) if "x" in c else 0)
                for c in args.prefill.split(",") if c]
    cfg = emulation_config(args.experts, args.layers)
    torch.manual_seed(0)
    model = build_rank0(cfg, PLAN, with_mtp=True, device=DEV)
    torch.cuda.synchronize()
    parts = weight_bytes(model)
    gc.collect()
    torch.cuda.empty_cache()  # the random fill's temporaries are not the rank's memory
    free, total = torch.cuda.mem_get_info()
    max_batch = max((b for b, _ in cases), default=1)
    # a prefill chunk's activations, allocated after the caches (memory_plan's estimate)
    prefill_reserve = max((chunk * activation_bytes_per_token(cfg, chunk + depth)
                           for chunk, depth in prefills), default=0)
    meta = dict(
        benchmark="rank0", device=torch.cuda.get_device_name(), commit=args.commit,
        date=datetime.now(UTC).isoformat(timespec="seconds"), torch=torch.__version__,
        plan="TP2/EP2/DCP2 rank 0", experts=args.experts, layers=cfg.num_hidden_layers,
        mtp=True, weights_gib={k: round(v / 2**30, 3) for k, v in parts.items()},
        weights_gib_total=round(sum(parts.values()) / 2**30, 3),
        device_gib=round(total / 2**30, 2), utilization=args.utilization,
        kv_block_tokens=BLOCK, kv_caches={},
        note="collectives are no-ops (not timed); random weights; uniform routing; "
             "engine_step_ms includes host work; engine_step_overlapped_ms hides it behind the "
             "step in flight (engine_minus_graph_us: it minus graph_ms, as the engine runs "
             "with async scheduling); graph_ms is one graph replay; mtp3_cycle_ms: verify "
             "width 4 + 3 "
             "MTP drafts with host work, acceptance as its split says; "
             "mtp3_tokens_per_cycle_assumed: published runs, not measured")
    rows = []

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta, results=rows), f, indent=2)

    for kv_dtype in args.kv_cache_dtype.split(","):
        budget = (int(args.utilization * total) - (total - free) - GRAPH_RESERVE
                  - prefill_reserve)
        # sized for the MTP3 cycle's verify steps (the indexer ring holds the drafts)
        per_block, per_slot = cache_bytes(cfg, BLOCK, torch.bfloat16, True, model.parallel,
                                          MTP_SPEC, kv_cache_dtype=kv_dtype)
        num_blocks = (budget - (max_batch + 1) * per_slot) // per_block
        caches = ModelCaches.allocate(cfg, num_blocks, BLOCK, max_batch + 1, torch.bfloat16, DEV,
                                      with_mtp=True, ps=model.parallel, num_spec=MTP_SPEC,
                                      kv_cache_dtype=kv_dtype, kv_scales=unit_scale_bank(cfg))
        kv_tokens = (num_blocks - 1) * BLOCK
        meta["kv_caches"][kv_dtype] = dict(
            kv_blocks=num_blocks, kv_tokens_per_rank=kv_tokens,
            kv_bytes_per_token=per_block / BLOCK, kda_state_bytes_per_seq=per_slot,
            kv_tokens_per_gib=round(2**30 * BLOCK / per_block),
            kv_128k_sequences=kv_tokens // 131072)
        print(json.dumps(meta, indent=1), flush=True)
        run_cases(model, caches, cfg, cases, num_blocks, kv_dtype, args.profile, rows, save,
                  acceptance, args.compare_pdl, args.graph_only)
        for chunk, depth in prefills:
            row = dict(phase="prefill", kv_cache_dtype=kv_dtype, chunk=chunk, depth=depth)
            try:
                with torch.inference_mode():
                    row.update(prefill_case(model, caches, cfg, chunk, depth))
            except Exception:  # noqa: BLE001 - a failed case is recorded, not fatal
                row["prefill_error"] = traceback.format_exc()[-3000:]
            rows.append(row)
            print({k: v for k, v in row.items() if k != "top_kernels"}, flush=True)
            save()
            gc.collect()
            torch.cuda.empty_cache()
        del caches
        gc.collect()
        torch.cuda.empty_cache()


def run_cases(model, caches, cfg, cases, num_blocks, kv_dtype, profile, rows, save,
              acceptance: tuple[float, ...] | None, compare_pdl: bool = False,
              graph_only: bool = False) -> None:
    """Time each (batch, context) case on `caches` (latent rows in `kv_dtype`) into `rows`;
    the MTP3 cycle under `acceptance` (mtp_cycle_ms's); with `compare_pdl` the replay again,
    captured with programmatic dependent launch off; `graph_only`: the replays alone."""
    with torch.inference_mode():
        for batch, context in cases:
            per = -(-context // BLOCK)
            shared = batch * per + 1 > num_blocks
            tables = [list(range(1, 1 + per)) if shared else
                      list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
            row = dict(phase="decode", kv_cache_dtype=kv_dtype, batch=batch, context=context,
                       kv_shared=shared)
            row.update({k: round(v, 4)
                        for k, v in step_bytes(model, batch, context, kv_dtype).items()})
            try:
                row["graph_ms"], prof = graph_replay_ms(model, caches, batch, context, tables,
                                                         profile)
                if prof:
                    row["profile"] = prof
                row["pct_bandwidth"] = round(
                    row["total_gb"] * 1e9 / (row["graph_ms"] * 1e-3) / HBM_BYTES_PER_S * 100, 1)
                if compare_pdl:
                    row["graph_ms_pdl_off"] = graph_ms_pdl_off(model, caches, batch, context,
                                                               tables)
            except Exception:  # noqa: BLE001 - a failed case is recorded, not fatal
                row["graph_error"] = traceback.format_exc()[-3000:]
                print(row["graph_error"], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            if graph_only:
                rows.append(row)
                print(row, flush=True)
                save()
                continue
            try:
                row["engine_step_ms"], row["engine_step_host"] = engine_step_ms(
                    model, caches, cfg, batch, context, tables,
                    steps=reps_for(row.get("graph_ms", 100.0)), profile=profile)
                row["engine_step_overlapped_ms"] = row["engine_step_host"]["overlapped_ms"]
                if "graph_ms" in row:  # issue 20's "engine step minus graph replay"
                    row["engine_minus_graph_us"] = round(
                        (row["engine_step_overlapped_ms"] - row["graph_ms"]) * 1e3, 1)
            except Exception as exc:  # noqa: BLE001
                row["engine_step_error"] = repr(exc)[:400]
            gc.collect()
            torch.cuda.empty_cache()
            try:
                row["mtp3_cycle_ms"], row["mtp3_cycle_split"] = mtp_cycle_ms(
                    model, caches, cfg, batch, context, tables, num_spec=MTP_SPEC,
                    steps=reps_for(2 * row.get("graph_ms", 100.0)), acceptance=acceptance)
            except Exception:  # noqa: BLE001
                row["mtp3_cycle_error"] = traceback.format_exc()[-3000:]
                print(row["mtp3_cycle_error"], flush=True)
            row["mtp3_tokens_per_cycle_assumed"] = list(MTP3_TOKENS_PER_CYCLE)
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
            save()

if __name__ == "__main__":
    main()
