"""Verification of drafts against the target.

Every verify row is sampled exactly as plain decoding would sample that position (same seeded
noise, same processing). A deterministic draft (greedy MTP, DFlash) is accepted while it equals
the target's sample: that *is* rejection sampling with q = one-hot (the draft survives with
probability p(d); on rejection the emitted token is the target's sample conditioned on
differing from d, i.e. the normalised residual), and it keeps speculative output
token-identical to plain decoding. A draft drawn from a distribution q (probabilistic MTP)
goes through the min(1, p/q) rule of `ops.rejection_sample` with request-seeded uniforms.
"""

from __future__ import annotations

import numpy as np
import torch

from glm53.kernels import ops

# seed streams of the acceptance tests and the residual draw, distinct from the sampler's
ACCEPT_SALT, RESIDUAL_SALT, DRAFT_SALT = 0x5EED_ACCE, 0x5EED_2E51, 0x5EED_D2AF


def accept_drafts(sampled: np.ndarray, sample_seqs: np.ndarray, num_drafts: np.ndarray,
                  draft_ids: np.ndarray, probs: torch.Tensor | None = None,
                  draft_probs: list[torch.Tensor | None] | None = None,
                  seeds: np.ndarray | None = None,
                  positions: np.ndarray | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """Per sequence: accepted draft count and the emitted tokens.

    sampled: [R] target samples of the sample rows (sequence s has 1 + num_drafts[s] rows, in
    order); draft_ids: [N, K] drafts (-1 padded). For sequences with `draft_probs[s]` ([k, V],
    the drafts' distributions) `probs` ([R, V] target distributions), `seeds` and `positions`
    ([R], the sampler's keys) drive the rejection rule. Returns (accepted [N], emitted per
    sampling sequence in sample_seqs order: accepted drafts, then the final token).
    """
    accepted = np.zeros(len(num_drafts), dtype=np.int64)
    emitted: list[list[int]] = []
    row = 0
    for seq in dict.fromkeys(sample_seqs.tolist()):
        k = int(num_drafts[seq])
        q = draft_probs[seq] if draft_probs is not None and k else None
        if q is not None:
            a, tokens = _rejection(sampled, probs, q[:k], draft_ids[seq, :k], seeds, positions,
                                   row, k)
        else:
            rows = sampled[row:row + 1 + k]
            a = 0
            while a < k and rows[a] == draft_ids[seq, a]:
                a += 1
            tokens = [int(t) for t in rows[: a + 1]]
        accepted[seq] = a
        emitted.append(tokens)
        row += 1 + k
    return accepted, emitted


def _rejection(sampled, probs, q, drafts, seeds, positions, row, k) -> tuple[int, list[int]]:
    device = probs.device
    seed = torch.tensor([int(seeds[row])], device=device)
    keys = torch.tensor(positions[row:row + k], device=device)
    uniform = ops.random_uniform(seed.expand(k) ^ ACCEPT_SALT, keys, 1)[:, 0]
    residual_u = ops.random_uniform(seed ^ RESIDUAL_SALT, keys[:1], probs.shape[-1])
    a, out = ops.rejection_sample(probs[row:row + k + 1].unsqueeze(0), q.unsqueeze(0).to(probs),
                                  torch.as_tensor(drafts, device=device).unsqueeze(0),
                                  uniform.unsqueeze(0), residual_u,
                                  torch.tensor([int(sampled[row + k])], device=device))
    a = int(a[0])
    return a, [int(t) for t in out[0, : a + 1]]


class SyntheticAcceptance:
    """A stand-in for `accept_drafts` that measures the speculative mechanism, not a model:
    draft position j is accepted with the given probability `p[j]` (positions beyond the list:
    never), whatever the draft and the target say. A draft is accepted only after every
    earlier one, so p must not increase; one uniform draw per sequence and step gives
    P(accepted >= j) = p[j - 1] exactly, which is what `glm53 bench latency` reports back per
    position. The emitted tokens are the accepted drafts and then the target's own sample at
    the first rejected position (the row that saw exactly those drafts), so the KDA state
    commit, the cache rows kept and the next drafts are those of a real step with that
    acceptance. Output text is meaningless: results using it must say "synthetic"."""

    def __init__(self, probabilities: list[float] | tuple[float, ...], seed: int = 0) -> None:
        p = np.asarray(probabilities, dtype=np.float64)
        if p.ndim != 1 or not len(p) or not ((p >= 0) & (p <= 1)).all():
            raise ValueError(f"synthetic acceptance {list(probabilities)}: one probability "
                             "in [0, 1] per draft position")
        if (np.diff(p) > 0).any():
            raise ValueError(f"synthetic acceptance {list(probabilities)} must not increase: "
                             "a draft is accepted only after every earlier one")
        self.p = p
        self.rng = np.random.default_rng(seed)

    def __call__(self, sampled: np.ndarray, sample_seqs: np.ndarray, num_drafts: np.ndarray,
                 draft_ids: np.ndarray, *_unused) -> tuple[np.ndarray, list[list[int]]]:
        accepted = np.zeros(len(num_drafts), dtype=np.int64)
        emitted: list[list[int]] = []
        row = 0
        for seq in dict.fromkeys(sample_seqs.tolist()):
            k = int(num_drafts[seq])
            a = int((self.rng.random() < self.p[:k]).sum()) if k else 0
            accepted[seq] = a
            emitted.append([*(int(t) for t in draft_ids[seq, :a]), int(sampled[row + a])])
            row += 1 + k
        return accepted, emitted
