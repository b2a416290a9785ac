"""Sequences one rank holds at a fixed memory budget with no speculation, MTP3 and DFlash
(issue 23, deliverable 2). No GPU and no weights: every number is the memory plan
(actors/memory_plan.py) of a meta-built shard, the same plan the runner sizes its caches by.

A case is "n sequences of C tokens, all running": n state slots (+ the graph padding slot),
n x ceil(C / block) paged blocks, and with DFlash n draft K/V rings of the draft's window
(`memory_plan.sequences_held`). MTP pays its layer's weights and one more DSA layer in every
block and slot; DFlash pays this rank's shard of the draft's weights and a fixed ring of its KV
heads per sequence (the draft's layers are TP-sharded like the target's), in the draft's dtype
or, in the `_fp8` modes, as fp8 rows (`draft_kv_cache_dtype` fp8: e4m3 + one fp32 scale per
row of head_dim values). Cases:

- real shapes: the release config, TP2/EP2/DCP2 rank 0, EXL3 K4 and int4 experts, 139.8 GiB
  (H200) x 0.9, bf16 cache, block 16 per DCP rank, 2048 batched tokens; contexts 8K and 128K;
  MTP with 3 drafts, DFlash with the published DFlash2 drafter (release.dflash2_release_config)
  with its 7 drafts and with 3, and MTP with 7 as dflash7's same-width reference (see MODES).
- the serving profiles' KV tokens (`profiles`): lang-mtp3 vs lang-dflash2 vs DFlash2 under
  lang-mtp3's settings, nvfp4 latents, as the reference runtime compared them.
- the tiny model on CPU (tests/tiny.py's TINY spec, its tiny DFlash2 draft): a fixed 8 MiB
  device budget at utilization 1, no reserve; contexts 256 and 2048.

    python benchmarks/spec_capacity.py [--json benchmarks/results/spec_capacity_cpu_C.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import UTC, datetime

from bench_common import git_commit

from glm53.actors.loader import read_config
from glm53.actors.memory_plan import GiB, MiB, meta_shard, plan_memory, sequences_held
from glm53.actors.release import dflash2_release_config, exl3_release_config, release_config
from glm53.actors.speculative.dflash_model import DFlashConfig
from glm53.actors.tiny import write_tiny_draft
from glm53.deployments.tiny_model import make_tiny

# mode -> (MTP layer built, drafts, DFlash draft ring: None without a draft, else its
# draft_kv_cache_dtype); dflash7 is the reference runtime's profile (k=7), dflash3 the same
# draft verifying MTP3's width (its CUDA graphs and logits rows cost what MTP3's do, plus the
# tap states the draft reads, so the two differ only by the draft's memory); mtp7 is a
# reference for dflash7: what verifying 8 positions costs the target without any draft model;
# the _fp8 modes store the ring as fp8
MODES = {"none": (False, 0, None), "mtp3": (True, 3, None), "dflash7": (False, 7, "auto"),
         "dflash3": (False, 3, "auto"), "mtp7": (True, 7, None),
         "dflash7_fp8": (False, 7, "fp8"), "dflash3_fp8": (False, 3, "fp8")}


def capacity(config: dict, draft: DFlashConfig, *, device_bytes: int, utilization: float,
             contexts: tuple[int, ...], block_size: int, layout: dict,
             **plan_kw) -> list[dict]:
    """One row per (context, mode): sequences held and where the memory goes."""
    models = {with_mtp: meta_shard(config, with_mtp=with_mtp, **layout)
              for with_mtp in (False, True)}
    rows = []
    for context in contexts:
        held = {}
        for mode in MODES:
            with_mtp, k, ring = MODES[mode]
            n, plan = sequences_held(models[with_mtp], device_bytes, utilization,
                                     context_len=context, block_size=block_size, num_spec=k,
                                     draft=draft if ring else None,
                                     draft_kv_cache_dtype=ring or "auto", **plan_kw)
            held[mode] = n
            row = {"context": context, "mode": mode, "sequences": n,
                   "draft_kv_cache_dtype": ring}
            if plan is not None:
                row.update(
                    weights_gib=plan.weight_bytes / GiB,
                    draft_weights_gib=plan.draft_weight_bytes / GiB,
                    reserve_gib=plan.reserve_bytes / GiB, kv_pool_gib=plan.kv_pool_bytes / GiB,
                    draft_rings_gib=plan.num_slots * plan.draft_bytes_per_slot / GiB,
                    slot_mib=plan.bytes_per_slot / MiB,
                    draft_ring_mib=plan.draft_bytes_per_slot / MiB,
                    block_kib=plan.bytes_per_block / 2**10,
                    per_sequence_mib=(plan.bytes_per_slot + plan.draft_bytes_per_slot
                                      + -(-context // plan.block_size) * plan.bytes_per_block)
                    / MiB)
            rows.append(row)
        for row in rows[-len(MODES):]:
            row["vs_mtp3"] = row["sequences"] / held["mtp3"] if held["mtp3"] else None
        print(f"  context {context:>7,}: " + ", ".join(f"{m} {held[m]}" for m in MODES)
              + (f"; dflash7/mtp3 {held['dflash7'] / held['mtp3']:.3f}, dflash3/mtp3 "
                 f"{held['dflash3'] / held['mtp3']:.3f}, fp8 ring: dflash7/mtp3 "
                 f"{held['dflash7_fp8'] / held['mtp3']:.3f}, dflash3/mtp3 "
                 f"{held['dflash3_fp8'] / held['mtp3']:.3f}" if held["mtp3"] else "")
              + (f", dflash7/mtp7 {held['dflash7'] / held['mtp7']:.3f}" if held["mtp7"] else ""))
    return rows


H200 = int(139.8 * GiB)
RANK0 = {"tp": 2, "ep": 2, "dcp": 2, "rank": 0}


def real_shapes() -> list[dict]:
    draft = DFlashConfig.from_hf(dflash2_release_config())
    out = []
    for experts, config, quantize, kv in (("exl3", exl3_release_config(), None, "auto"),
                                          ("exl3", exl3_release_config(), None, "nvfp4"),
                                          ("int4", release_config(), "int4", "auto")):
        print(f"GLM-5.3-Flash TP2/EP2/DCP2 rank 0, {experts} experts, kv_cache_dtype {kv}, "
              "139.8 GiB x 0.9:")
        layout = {**RANK0, "quantize_experts": quantize}
        rows = capacity(config, draft, device_bytes=H200, utilization=0.9,
                        contexts=(8192, 131072), block_size=16 * 2, layout=layout,
                        kv_cache_dtype=kv)
        out += [{"case": f"h200_tp2ep2dcp2_rank0_{experts}", "kv_cache_dtype": kv, **r}
                for r in rows]
    return out


def profiles() -> list[dict]:
    """KV tokens of the serving profiles (deployments/config.PROFILES, nvfp4 latents) on the
    same rank: lang-mtp3 (16 sequences of 131,072), lang-dflash2 as the reference runtime ran
    it (4 of 98,304, 2072 batched tokens), and DFlash2 k=7 under lang-mtp3's settings, each
    DFlash case with the bf16 ring and with the fp8 one. The
    reference runtime's build held 1,376,256 tokens with MTP3 and 184,619 with DFlash2
    (exl3-dflash-spec.md A.4: 0.13x)."""
    draft = DFlashConfig.from_hf(dflash2_release_config())
    config = exl3_release_config()
    cases = {"lang-mtp3": (True, 3, None, 131_072, 16, 2048, "auto"),
             "lang-dflash2": (False, 7, draft, 98_304, 4, 2072, "auto"),
             "lang-dflash2_fp8_ring": (False, 7, draft, 98_304, 4, 2072, "fp8"),
             "dflash2_at_lang-mtp3": (False, 7, draft, 131_072, 16, 2048, "auto"),
             "dflash2_fp8_ring_at_lang-mtp3": (False, 7, draft, 131_072, 16, 2048, "fp8"),
             "none_at_lang-mtp3": (False, 0, None, 131_072, 16, 2048, "auto")}
    models = {m: meta_shard(config, with_mtp=m, **RANK0) for m in (False, True)}
    rows = []
    print("serving profiles, EXL3 K4, nvfp4 latents, TP2/EP2/DCP2 rank 0, 139.8 GiB x 0.9:")
    for name, (with_mtp, k, drafter, max_len, seqs, batched, ring) in cases.items():
        plan = plan_memory(models[with_mtp], H200, 0.9, block_size=32, num_slots=seqs,
                           num_spec=k, max_model_len=max_len, max_num_batched_tokens=batched,
                           kv_cache_dtype="nvfp4", draft=drafter,
                           draft_kv_cache_dtype=ring).check()
        rows.append({"case": "profile", "profile": name, "kv_tokens": plan.num_tokens,
                     "max_num_seqs": seqs, "max_model_len": max_len, "num_spec": k})
    base = rows[0]["kv_tokens"]
    for row in rows:
        row["vs_mtp3"] = row["kv_tokens"] / base
        print(f"  {row['profile']:<31}{row['kv_tokens']:>12,} tokens ({row['vs_mtp3']:.3f}x "
              "lang-mtp3)")
    return rows


def tiny_cpu(budget_bytes: int = 8 * MiB) -> list[dict]:
    """The tests' TINY model (5 layers, MTP) and its tiny DFlash2 draft (2 layers, window 16),
    float32, at `budget_bytes` for weights and caches (utilization 1, no reserve)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny(f"{tmp}/target", seed=3, layers=5, mtp=True, index_topk=8)
        config = json.loads((target / "config.json").read_text())
        draft = DFlashConfig.from_dir(write_tiny_draft(f"{tmp}/draft", read_config(target)))
    print(f"tiny model on CPU, {budget_bytes / MiB:.0f} MiB:")
    rows = capacity(config, draft, device_bytes=budget_bytes, utilization=1.0,
                    contexts=(256, 2048), block_size=16, layout={},
                    reserve_bytes=0, max_num_batched_tokens=64)
    return [{"case": "tiny_cpu", "budget_bytes": budget_bytes, **r} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    args = ap.parse_args()
    rows = real_shapes() + profiles() + tiny_cpu()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "spec_capacity", "commit": args.commit or git_commit(),
                       "date": datetime.now(UTC).isoformat(timespec="seconds"),
                       "device": f"none (memory plans on {platform.machine()} CPU)",
                       "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
