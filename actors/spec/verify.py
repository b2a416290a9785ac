"""Verification of drafts against the target's own samples.

Every verify row is sampled exactly as plain decoding would sample that position (same seeded
noise, same processing), and a draft is accepted while it equals the target's sample. For a
deterministic draft (greedy MTP, DFlash) this *is* rejection sampling with q = one-hot: the
draft survives with probability p(d), and on rejection the emitted token is the target's sample
conditioned on differing from d, i.e. the normalised residual. It also makes speculative output
token-identical to non-speculative output, greedy or seeded.
"""

from __future__ import annotations

import numpy as np


def accept_drafts(sampled: np.ndarray, sample_seqs: np.ndarray, num_drafts: np.ndarray,
                  draft_ids: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """Per sequence: accepted draft count and the emitted tokens.

    sampled: [R] target samples of the sample rows (sequence s has 1 + num_drafts[s] rows, in
    order); draft_ids: [N, K] drafts (-1 padded). Returns (accepted [N], emitted per sampling
    sequence, in sample_seqs order: drafts d_1..d_a then the target's token at row a).
    """
    accepted = np.zeros(len(num_drafts), dtype=np.int64)
    emitted: list[list[int]] = []
    row = 0
    for seq in dict.fromkeys(sample_seqs.tolist()):
        k = int(num_drafts[seq])
        rows = sampled[row:row + 1 + k]
        a = 0
        while a < k and rows[a] == draft_ids[seq, a]:
            a += 1
        accepted[seq] = a
        emitted.append([int(t) for t in rows[: a + 1]])
        row += 1 + k
    return accepted, emitted
