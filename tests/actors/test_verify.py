"""Exact-match verification against the target's own seeded samples is rejection sampling for
deterministic drafts: emitted tokens follow the target distribution (chi-square, fixed logits),
whatever the draft."""

from __future__ import annotations

import numpy as np
import torch

from glm53.actors.sampler import Sampler, build_sampling_inputs
from glm53.actors.speculative.verify import accept_drafts
from glm53.actors.step import SamplingParams


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    expected = probs * counts.sum()
    df = len(probs) - 1
    critical = df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3  # p = 1e-4
    return float(((counts - expected) ** 2 / expected).sum()) < critical


def test_emitted_tokens_follow_the_target_distribution():
    vocab, n = 6, 6000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 1.2
    params = SamplingParams(temperature=0.8)
    draft = int(logits[0].argmax())  # a plausible draft for position 0
    rows, seqs = [], []
    for s in range(n):  # one sequence per seed: rows = [verify row 0, row 1]
        rows += [(params, s, 0, (), (), ()), (params, s, 1, (), (draft,), ())]
        seqs += [s, s]
    sampled, _ = Sampler()(logits.repeat(n, 1), build_sampling_inputs(rows))
    accepted, emitted = accept_drafts(sampled.numpy(), np.asarray(seqs), np.ones(n, np.int64),
                                      np.full((n, 1), draft))
    probs = torch.softmax(logits / 0.8, -1).double().numpy()
    first = np.array([e[0] for e in emitted])
    assert _chi2_ok(np.bincount(first, minlength=vocab), probs[0])
    assert 0.2 < accepted.mean() < 0.95  # the draft is accepted with probability p0(draft)
    assert abs(accepted.mean() - probs[0, draft]) < 0.03
    second = np.array([e[1] for e, a in zip(emitted, accepted, strict=True) if a == 1])
    assert _chi2_ok(np.bincount(second, minlength=vocab), probs[1])


def test_probabilistic_drafts_follow_the_target_distribution():
    vocab, n = 5, 6000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, vocab, generator=gen)
    q = torch.softmax(torch.randn(vocab, generator=gen), -1)  # the drafter's distribution
    params = SamplingParams(temperature=1.0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).numpy()
    rows, seqs = [], []
    for s in range(n):
        rows += [(params, s, 0, (), (), ()), (params, s, 1, (), (int(drafts[s]),), ())]
        seqs += [s, s]
    inputs = build_sampling_inputs(rows)
    sampled, _, probs = Sampler()(logits.repeat(n, 1), inputs, with_probs=True)
    accepted, emitted = accept_drafts(sampled.numpy(), np.asarray(seqs), np.ones(n, np.int64),
                                      drafts[:, None], probs, [q[None]] * n, inputs.seeds,
                                      inputs.positions)
    p = torch.softmax(logits, -1).double().numpy()
    assert _chi2_ok(np.bincount([e[0] for e in emitted], minlength=vocab), p[0])
    assert 0 < accepted.mean() < 1
