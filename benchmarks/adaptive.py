"""Tokens/s of adaptive draft length (`mtp:K:auto`) vs fixed MTP k=1..K vs no drafts, at each
batch size, under SYNTHETIC acceptance patterns (drafts accepted by chance with the given
per-position probabilities: the speculative mechanism, never the model), through
`glm53 bench latency` (raycluster/latency.py) in this process.

Per pattern: the fixed engines run with every draft length 1..K, then the adaptive one with a
step-cost table of every width measured on this device, none interpolated
(StepCostModel.from_bench_record): `mtp:1`..`mtp:K` rows for widths 1..K (a speculating step
pays its MTP passes and the acceptance round trip at any width, so a line from `none` to
`mtp:K` undercounts the small widths), and for width 0 the adaptive engine's own 0-draft step,
not plain decoding's (it still writes the MTP cache rows of its rows, from its samples on the
device): measured once, by the adaptive engine with every draft rejected (synthetic
acceptance 0), which then chooses 0 drafts (`adaptive_zero_drafts` in the record, with the
steps it chose; a warning if it did not mostly choose 0). `none` runs once (acceptance does
not touch it); the adaptive engine is compared with the best of all of them. `--slice`
serves the full-width slice + MTP with random weights (slice.py) on `--device cuda`; CUDA
graphs as the engine captures them by default.

    python benchmarks/adaptive.py [--model DIR | --slice [--experts N]] [--device cuda]
        [--batch 1,8,32,64] [--context 1024] [--output-len 128] [--k 3]
        [--acceptance 0.8,0.6,0.4 --acceptance 0.2,0.05,0] [--async-scheduling] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from bench_common import git_commit
from slice import random_weights, slice_checkpoint, slice_label

from glm53.deployments.cli import main as glm53_main


def bench_latency(argv: list[str], out: Path) -> list[dict]:
    """`glm53 bench latency ARGV --json OUT`: its result rows."""
    if glm53_main(["bench", "latency", *argv, "--json", str(out)]) != 0:
        raise RuntimeError(f"glm53 bench latency {' '.join(argv)} failed")
    gc.collect()  # the next engine's weights need this one's memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return json.loads(out.read_text())["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--slice", action="store_true",
                    help="the full-width slice + MTP, random weights (for --device cuda)")
    ap.add_argument("--experts", type=int, default=288, help="--slice: routed experts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="drafts of the fixed setting, at most "
                                                     "for the adaptive one")
    ap.add_argument("--acceptance", action="append", default=None, metavar="P1,P2,...",
                    help="a synthetic per-position acceptance pattern (repeatable; default "
                         "0.8,0.6,0.4 and 0.2,0.05,0)")
    ap.add_argument("--cache-bytes", default=None, help="KV/state budget (default: 4GiB on "
                                                        "cuda, the CPU default otherwise)")
    ap.add_argument("--workdir", default=None, help="where each `glm53 bench latency` run "
                    "leaves its JSON (default: a temporary directory); runs that finished are "
                    "kept there if a later one is cut short")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="every setting with overlapped scheduling")
    ap.add_argument("--commit", default=None, help="recorded commit (default: git's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    patterns = args.acceptance or ["0.8,0.6,0.4", "0.2,0.05,0"]
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="adaptive-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    common = ["--device", args.device, "--batch", args.batch, "--context", str(args.context),
              "--output-len", str(args.output_len)]
    if args.slice:
        label = slice_label(args.experts, mtp=True)
        common += ["--model", slice_checkpoint(tempfile.mkdtemp(prefix="adaptive-slice-"),
                                               args.experts)]
    else:
        label = args.model or "tiny"
        common += ["--model", args.model] if args.model else []
    cache = args.cache_bytes or ("4GiB" if args.device.startswith("cuda") else None)
    common += ["--cache-bytes", cache] if cache else []
    common += ["--async-scheduling"] if args.async_scheduling else []
    k = args.k
    record = {"benchmark": "adaptive", "commit": args.commit or git_commit(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": label, "args": vars(args),
              "acceptance": "SYNTHETIC: drafts accepted by chance with the given per-position "
                            "probabilities; measures the mechanism, not the model",
              "patterns": {}}
    with random_weights() if args.slice else contextlib.nullcontext():
        none = bench_latency([*common, "--speculative", "none"], tmp / "none.json")
        record["device"] = json.loads((tmp / "none.json").read_text())["device"]
        zero_rows = None  # width 0 of the cost table: the adaptive engine's own 0-draft step
        for i, pattern in enumerate(patterns):
            synthetic = ["--synthetic-acceptance", pattern]
            fixed = {j: bench_latency([*common, "--speculative", f"mtp:{j}", *synthetic],
                                      tmp / f"fixed{i}_{j}.json") for j in range(1, k + 1)}
            table = tmp / f"cost{i}.json"
            if zero_rows is None:
                table.write_text(json.dumps({"results": none + sum(fixed.values(), [])}))
                zero = bench_latency([*common, "--speculative", f"mtp:{k}:auto",
                                      "--synthetic-acceptance", "0", "--draft-cost-table",
                                      str(table)], tmp / "zero.json")
                record["adaptive_zero_drafts"] = zero
                for r in zero:
                    steps = r["draft_length_steps"]
                    if steps[0] * 2 <= sum(steps):
                        print(f"warning: batch {r['batch']}: the 0-draft run chose 0 drafts in "
                              f"only {steps[0]} of {sum(steps)} steps; its median is not the "
                              "0-draft step's", flush=True)
                zero_rows = [dict(r, speculative="none") for r in zero]
            table.write_text(json.dumps({"results": zero_rows + sum(fixed.values(), [])}))
            auto = bench_latency([*common, "--speculative", f"mtp:{k}:auto", *synthetic,
                                  "--draft-cost-table", str(table)], tmp / f"auto{i}.json")
            summary = []
            for row, (n, a) in enumerate(zip(none, auto, strict=True)):
                per_k = {f"tok_s_mtp{j}": rows[row]["tok_s_total"] for j, rows in fixed.items()}
                best = max(n["tok_s_total"], *per_k.values())
                summary.append({
                    "batch": n["batch"], "tok_s_none": n["tok_s_total"], **per_k,
                    "tok_s_adaptive": a["tok_s_total"], "adaptive_vs_best": a["tok_s_total"] / best,
                    "adaptive_draft_length_steps": a["draft_length_steps"]})
                print(json.dumps({"acceptance": pattern, **summary[-1]}), flush=True)
            record["patterns"][pattern] = {
                "summary": summary, "none": none,
                **{f"mtp{j}": rows for j, rows in fixed.items()}, "adaptive": auto}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
