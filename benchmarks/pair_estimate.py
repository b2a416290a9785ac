"""The 2x H200 estimate of issue 20 from measured rank-0 emulation rows (performance.md §5.1):
an ESTIMATE, not a measurement. No GPU.

    t_step(2x H200) = t_R0E + n_coll x t_AR + EP-imbalance delta

- t_R0E: the rank-0 step through the engine (`engine_step_overlapped_ms`, else `graph_ms`);
  for MTP3 the measured cycle (`mtp3_cycle_ms`: verify of 4 tokens, acceptance, 3 drafts).
- n_coll: collectives a forward would run on the pair, which the emulation skips (no-ops):
  2 TP all-reduces per layer (45 layers: 90), one DCP merge per DSA layer (11) and the
  lm_head gather (1); an MTP draft pass is one more layer (2 + 1 + 1).
- t_AR: 4-9 us per collective of 8 KB x batch (H100 NVLink anchors, performance.md §3), so
  every number is a range.
- EP imbalance: the emulation routes rank 0 exactly its share of every token's 8 experts; on
  the pair the busier rank sets the step. With uniform routing over 2 ranks, rank 0 holds X ~
  Binomial(8 B, 1/2) of a batch's B x 8 token-expert pairs and the step waits for max(X,
  8 B - X): the routed experts' time grows by E[max] / (4 B) - 1 (1.27x at batch 1, 5.09
  experts instead of 4). Their time is taken as their share of the step's modeled bytes
  (`experts_gb / total_gb`), an approximation.
- MTP3 tokens a cycle: 2.6-2.8, from published GLM-5.3-Flash runs (the rows'
  `mtp3_tokens_per_cycle_assumed`), not measured here.

    python benchmarks/pair_estimate.py benchmarks/results/rank0_h200_int4_C.json
        [--json benchmarks/results/pair_estimate_h200_C.json]
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import UTC, datetime

COLLECTIVES_PER_FORWARD = 90 + 11 + 1
COLLECTIVES_PER_MTP_PASS = 2 + 1 + 1
ALL_REDUCE_US = (4.0, 9.0)
MTP_DRAFTS = 3


def hot_rank_factor(batch: int, top_k: int = 8) -> float:
    """E[max(X, n - X)] / (n / 2) for X ~ Binomial(n, 1/2), n = batch x top_k token-expert
    pairs: how much longer the busier of two EP ranks computes than an even split."""
    n = batch * top_k
    expected = sum(max(x, n - x) * math.comb(n, x) for x in range(n + 1)) / 2**n
    return expected / (n / 2)


def estimate_row(row: dict) -> dict:
    """The pair's step and tokens/s (low, high) for one measured decode row of rank0.py."""
    batch = row["batch"]
    step = row.get("engine_step_overlapped_ms") or row["graph_ms"]
    experts_share = row["experts_gb"] / row["total_gb"]
    factor = hot_rank_factor(batch)
    imbalance = step * experts_share * (factor - 1)
    coll = [COLLECTIVES_PER_FORWARD * us / 1e3 for us in ALL_REDUCE_US]
    pair = [step + c + imbalance for c in coll]
    out = dict(phase="decode", batch=batch, context=row["context"],
               kv_cache_dtype=row.get("kv_cache_dtype"), rank0_step_ms=step,
               rank0_step_source=("engine_step_overlapped_ms"
                                  if row.get("engine_step_overlapped_ms") else "graph_ms"),
               collectives_ms=coll, hot_rank_factor=factor, imbalance_ms=imbalance,
               pair_step_ms=pair,
               tok_s_per_user=[1e3 / t for t in reversed(pair)],
               tok_s_aggregate=[batch * 1e3 / t for t in reversed(pair)])
    if row.get("mtp3_cycle_ms"):
        cycle = row["mtp3_cycle_ms"]
        verify = row.get("mtp3_cycle_split", {}).get("verify_sample_ms", cycle)
        n_coll = COLLECTIVES_PER_FORWARD + MTP_DRAFTS * COLLECTIVES_PER_MTP_PASS
        # the verify step's routed experts see 4 tokens a sequence
        mtp_imbalance = verify * experts_share * (hot_rank_factor(4 * batch) - 1)
        cycles = [cycle + n_coll * us / 1e3 + mtp_imbalance for us in ALL_REDUCE_US]
        tau = row.get("mtp3_tokens_per_cycle_assumed", [2.6, 2.8])
        out["mtp3"] = dict(rank0_cycle_ms=cycle, imbalance_ms=mtp_imbalance,
                           pair_cycle_ms=cycles, tokens_per_cycle_assumed=tau,
                           tok_s_per_user=[tau[0] * 1e3 / cycles[1],
                                           tau[1] * 1e3 / cycles[0]])
    return out


def estimate(result: dict, source: str) -> dict:
    rows = [estimate_row(r) for r in result["results"]
            if r.get("phase") == "decode" and r.get("graph_ms")]
    return dict(benchmark="pair_estimate", estimate=True,
                note="ESTIMATE for 2x H200 (TP2/EP2/DCP2) from measured rank-0 emulation "
                     "rows; collectives, EP imbalance and MTP3 tokens per cycle are assumed "
                     "(see benchmarks/pair_estimate.py), not measured",
                source=source, source_device=result.get("device"),
                source_commit=result.get("commit"), layers=result.get("layers"),
                date=datetime.now(UTC).isoformat(timespec="seconds"),
                assumptions=dict(collectives_per_forward=COLLECTIVES_PER_FORWARD,
                                 collectives_per_mtp_pass=COLLECTIVES_PER_MTP_PASS,
                                 all_reduce_us=list(ALL_REDUCE_US)),
                rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank0_json")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.rank0_json) as f:
        result = json.load(f)
    if result.get("layers") not in (None, 45):
        raise SystemExit(f"{args.rank0_json} ran {result['layers']} layers: the estimate "
                         f"needs the full-depth rank (45)")
    out = estimate(result, args.rank0_json)
    for r in out["rows"]:
        mtp = r.get("mtp3", {}).get("tok_s_per_user")
        print(f"batch {r['batch']:3d} ctx {r['context']:6d} {r['kv_cache_dtype']}: pair step "
              f"{r['pair_step_ms'][0]:.2f}-{r['pair_step_ms'][1]:.2f} ms, "
              f"{r['tok_s_per_user'][0]:.0f}-{r['tok_s_per_user'][1]:.0f} tok/s per user"
              + (f", MTP3 {mtp[0]:.0f}-{mtp[1]:.0f}" if mtp else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
