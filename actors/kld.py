"""KL divergence of a student configuration's next-token distributions from a teacher's: the
math (float64, chunked), one window's teacher-forced logits over the paged caches, and the
summaries `glm53 kld` reports (kld_run.py drives them over a corpus; exl3-dflash-spec.md A.5
is the reference runtime's harness, whose semantics this follows).

A window of W tokens is prefilled from position 0 (in chunks of `prefill_chunk` tokens, each
chunk resuming from the cache the previous ones wrote, as the engine's chunked prefill does);
row i of its logits predicts token i + 1, so W - 1 positions are scored (the reference's
`logits[:, :-1]`). Every DSA layer stores its latent rows (and pooled indexer keys) into the
paged cache in `kv_cache_dtype` and attends over the rows read back from it, so a quantised
cache is exercised at every position, the chunk's own tokens included.

Per position: KL(p || q) = sum_v p(v) (log p(v) - log q(v)), p the teacher's softmax and q the
student's, each log_softmax'ed in float64, `chunk` rows at a time (the full-vocabulary float64
rows of a real model are 1.2 MiB each). Top-1 agreement is argmax equality.

Cache ablation (`cache_mix`): the student's quantised cache on some DSA layers or on one part
of the cached state (latent rows or pooled indexer keys) and the teacher's cache elsewhere.
That is how KLD is attributed to layers: a cache dtype changes only what DSA layers store (KDA
layers keep their recurrent state in fp32 whatever the cache dtype), so "per layer type" is
"per DSA layer and per cached part"; the KLDs of the parts need not add up to the whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .caches import DSAState, ModelCaches
from .forward_batch import ForwardBatch
from .models.glm5_next import Glm5NextForCausalLM

CACHE_PARTS = ("latent", "pool_keys")  # what a DSA layer keeps per token in the paged cache
POSITION_EDGES = (16, 64, 256, 1024, 4096, 16384, 65536)  # per-position breakdown buckets


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The paged cache a window runs over. `mix_layers`/`mix_parts` (an ablation): only those
    DSA layers (str(layer id)) / cached parts use `kv_cache_dtype`, the rest `base_dtype`."""

    kv_cache_dtype: str = "auto"
    kv_scales: dict[str, float] | None = None
    block_size: int = 16
    base_dtype: str | None = None
    mix_layers: tuple[str, ...] | None = None
    mix_parts: tuple[str, ...] = CACHE_PARTS


def _caches(model: Glm5NextForCausalLM, n: int, spec: CacheSpec) -> ModelCaches:
    """One sequence's caches for n tokens (blocks 1.. of a pool whose block 0 is spare)."""
    w = model.embed_tokens.weight
    num_blocks = 1 + -(-n // spec.block_size)

    def alloc(kv_cache_dtype: str) -> ModelCaches:
        return ModelCaches.allocate(model.config, num_blocks, spec.block_size, 1, w.dtype,
                                    w.device, kv_cache_dtype=kv_cache_dtype,
                                    kv_scales=spec.kv_scales)

    student = alloc(spec.kv_cache_dtype)
    if spec.base_dtype is None:
        return student
    base = alloc(spec.base_dtype)
    layers = []
    for i, (s, b) in enumerate(zip(student.layers, base.layers, strict=True)):
        if isinstance(s, DSAState) and (spec.mix_layers is None or str(i) in spec.mix_layers):
            if "latent" not in spec.mix_parts:
                s = dataclasses.replace(s, latent=b.latent, latent_format=b.latent_format,
                                        outer_scale=b.outer_scale)
            if "pool_keys" not in spec.mix_parts:
                s = dataclasses.replace(s, pool_keys=b.pool_keys, pool_format=b.pool_format)
            layers.append(s)
        else:
            layers.append(b)
    return dataclasses.replace(student, layers=tuple(layers))


@torch.inference_mode()
def window_logits(model: Glm5NextForCausalLM, ids: Sequence[int], spec: CacheSpec,
                  prefill_chunk: int | None = None) -> torch.Tensor:
    """ids [W] -> fp32 logits [W, V] of every position, prefilled from position 0 over a fresh
    cache in chunks of `prefill_chunk` tokens (None: one chunk)."""
    n = len(ids)
    caches = _caches(model, n, spec)
    device = model.embed_tokens.weight.device
    tokens = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    blocks = [list(range(1, 1 + -(-n // spec.block_size)))]
    step = prefill_chunk or n
    rows = []
    for start in range(0, n, step):
        count = min(step, n - start)
        batch = ForwardBatch.build([start], [count], [0], blocks, spec.block_size, device)
        rows.append(model.compute_logits(model(tokens[start:start + count], batch, caches)))
    return torch.cat(rows)


def kl_rows(teacher: torch.Tensor, student: torch.Tensor, chunk: int = 64
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """teacher, student: logits [R, V] (any float dtype, same device) -> (KL(p || q) [R]
    float64, top-1 agreement [R] bool), `chunk` rows at a time in float64."""
    if teacher.shape != student.shape:
        raise ValueError(f"teacher logits {tuple(teacher.shape)} vs student "
                         f"{tuple(student.shape)}: not the same positions and vocabulary")
    kls, agree = [], []
    for a in range(0, teacher.shape[0], chunk):
        p = teacher[a:a + chunk].double().log_softmax(-1)
        q = student[a:a + chunk].double().log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append(teacher[a:a + chunk].argmax(-1) == student[a:a + chunk].argmax(-1))
    return torch.cat(kls), torch.cat(agree)


def nll_rows(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """logits [R, V], targets [R] -> -log softmax(logits)[target] [R] float64."""
    out = []
    for a in range(0, logits.shape[0], chunk):
        logp = logits[a:a + chunk].double().log_softmax(-1)
        out.append(-logp.gather(-1, targets[a:a + chunk, None].long()).squeeze(-1))
    return torch.cat(out)


def summarise(values: np.ndarray) -> dict[str, float | int]:
    """count, mean, std (ddof 1), p50/p95/p99, cvar95 (mean of the top 5%), max: the
    reference harness's summary of tokenwise KLDs."""
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if v.size == 0:
        raise ValueError("no positions to summarise")
    tail = v[int(np.floor(0.95 * v.size)):]
    return {"count": int(v.size), "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)),
            "p99": float(np.percentile(v, 99)), "cvar95": float(tail.mean()),
            "max": float(v[-1])}


def by_position(kl: np.ndarray) -> list[dict[str, float | int]]:
    """kl [N windows, P positions] -> mean KLD of each bucket of positions [lo, hi) (edges
    POSITION_EDGES below P, then P), over all windows."""
    p = kl.shape[1]
    edges = [0, *[e for e in POSITION_EDGES if e < p], p]
    return [{"positions": [lo, hi], "count": int(kl[:, lo:hi].size),
             "mean": float(kl[:, lo:hi].mean())}
            for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
