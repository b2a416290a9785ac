"""Exact-match verification against the target's own seeded samples is rejection sampling for
deterministic drafts: emitted tokens follow the target distribution (chi-square, fixed logits),
whatever the draft."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.sampler import Sampler, build_sampling_inputs
from glm53.actors.speculative.verify import SyntheticAcceptance, accept_drafts
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


def _synthetic_step(n: int, k: int, verifying: int):
    """n sequences, the first `verifying` with k drafts (10 + position), the rest none;
    sample rows hold 100 + row."""
    num_drafts = np.array([k] * verifying + [0] * (n - verifying))
    seqs = np.repeat(np.arange(n), 1 + num_drafts)
    drafts = np.full((n, k), -1)
    drafts[:verifying] = 10 + np.arange(k)
    return 100 + np.arange(len(seqs)), seqs, num_drafts, drafts


def test_synthetic_acceptance_emits_accepted_drafts_then_the_targets_sample():
    sampled, seqs, num_drafts, drafts = _synthetic_step(3, 3, verifying=2)
    accepted, emitted = SyntheticAcceptance([1.0, 1.0, 0.0])(sampled, seqs, num_drafts, drafts)
    # sequence 0: rows 0..3, sequence 1: rows 4..7, sequence 2 (no drafts): row 8
    assert accepted.tolist() == [2, 2, 0]
    assert emitted == [[10, 11, 102], [10, 11, 106], [108]]


def test_synthetic_acceptance_rates_per_position_are_the_given_ones():
    p = [0.9, 0.6, 0.3]
    verify = SyntheticAcceptance(p, seed=1)
    sampled, seqs, num_drafts, drafts = _synthetic_step(4000, 3, verifying=4000)
    accepted, _ = verify(sampled, seqs, num_drafts, drafts)
    rates = [(accepted > j).mean() for j in range(3)]
    assert rates == pytest.approx(p, abs=0.03)


@pytest.mark.parametrize("p", [[0.5, 0.7], [1.2], [], [-0.1]])
def test_synthetic_acceptance_refuses_impossible_probabilities(p):
    with pytest.raises(ValueError, match="synthetic acceptance"):
        SyntheticAcceptance(p)
