"""The error load-time int4 adds to the routed experts, measured on CPU: KL divergence of the
next-token distributions of the int4 model vs the unquantised model (fp32, float64 KL), and
top-1 agreement, over random prompts, for tiny random checkpoints of a few seeds and sizes.

Random tiny models have nearly flat next-token distributions (logit std ~1 over a 272-token
vocabulary), so top-1 flips far more easily than on a trained model: these numbers bound the
mechanism's error, they do not predict the real model's quality (that needs `glm53 kld` on real
weights).

    python benchmarks/quant_kld.py [--json benchmarks/results/quant_kld_cpu_<commit>.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from bench_common import git_commit

from glm53.actors.kld import CacheSpec, kl_rows, window_logits
from glm53.actors.loader import load_model
from glm53.deployments.tiny_model import make_tiny
from glm53.kernels import ops

BLOCK = 16
CASES = {  # name -> make_tiny overrides
    "tiny-5L": dict(layers=5),
    "tiny-8L-16experts": dict(layers=8, n_routed_experts=16, num_experts_per_tok=4),
    "tiny-5L-wide": dict(layers=5, hidden_size=128, moe_intermediate_size=128),
}


def weight_rel_err(base, quant) -> float:
    """||dequantise(codes) - w|| / ||w|| over every routed expert weight (gate, up, down)."""
    err = norm = 0.0
    for dense, codes in zip(base.modules(), quant.modules(), strict=True):
        if type(codes).__name__ != "Int4Experts":
            continue
        g = codes.group_size
        for w, q in ((dense.w13, (codes.w13_q, codes.w13_scale, codes.w13_zero)),
                     (dense.w2, (codes.w2_q, codes.w2_scale, codes.w2_zero))):
            deq = ops.dequantize_int4(*q, min(g, w.shape[-1]))
            err += float((deq - w.float()).pow(2).sum())
            norm += float(w.float().pow(2).sum())
    return (err / norm) ** 0.5


def measure(path: Path, prompts: list[list[int]]) -> dict:
    base = load_model(path, progress=False)
    quant = load_model(path, progress=False, quantize_experts="int4")
    kls, agree = [], []
    spec = CacheSpec(block_size=BLOCK)  # the model-dtype cache, one prefill step a prompt
    for ids in prompts:
        kl, same = kl_rows(window_logits(base, ids, spec), window_logits(quant, ids, spec))
        kls.append(kl)
        agree.append(same)
    kl, top1 = torch.cat(kls), torch.cat(agree).double()
    group = quant.layers[-1].mlp.experts.group_size
    return dict(positions=kl.numel(), group_size=group,
                weight_rel_err=weight_rel_err(base, quant), mean_kl=kl.mean().item(),
                p99_kl=kl.quantile(0.99).item(), max_kl=kl.max().item(),
                top1_agreement=top1.mean().item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=96)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES.items():
            for seed in (int(s) for s in args.seeds.split(",")):
                path = make_tiny(Path(tmp) / f"{name}-{seed}", seed=seed, **overrides)
                gen = torch.Generator().manual_seed(100 + seed)
                vocab = json.loads((path / "config.json").read_text())["text_config"][
                    "vocab_size"]
                prompts = [torch.randint(0, vocab, (args.length,), generator=gen).tolist()
                           for _ in range(args.prompts)]
                row = dict(model=name, seed=seed, **measure(path, prompts))
                print(row, flush=True)
                rows.append(row)
    result = dict(benchmark="quant_kld", format="int4 (group 128 or the whole row; fp16 scale "
                  "and zero)", reference="the same checkpoint with bf16/fp32 experts",
                  dtype="float32", commit=git_commit(),
                  date=datetime.now(UTC).isoformat(timespec="seconds"), results=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
