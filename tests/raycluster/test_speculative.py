"""Speculative decoding (draft -> verify -> accept) on CPU with tiny checkpoints.

Greedy and seeded outputs with speculation must be token-identical to plain decoding; forced
draft patterns (all accepted, none, partial, some requests without drafts) exercise the KDA
state commit, the indexer ring and the counters; rejection sampling for drafts that carry a
distribution matches the target distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.caches import cache_bytes
from glm53.actors.step import SamplingParams
from glm53.kernels.ref.rejection import rejection_sample
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints(seed=5, layers=5, mtp=True, index_topk=8))


def _prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, size).tolist() for size in (1, 5, 23, 40, 61, 9, 33, 70)[:n]]


def _engine(path: str, k: int = 0, **kw) -> LLMEngine:
    spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
    return LLMEngine(EngineConfig(model=path, num_blocks=256, max_num_batched_tokens=40,
                                  **spec, **kw))


@pytest.fixture(scope="module")
def plain(tiny):
    return _engine(tiny).generate(_prompts(), GREEDY)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain_decoding(tiny, plain, k):
    engine = _engine(tiny, k)
    assert engine.generate(_prompts(), GREEDY) == plain
    assert engine.spec_stats.num_drafts > 0  # drafts were really verified


class OracleProposer:
    """Drafts from the known greedy continuation, corrupted by a per-step pattern, so that
    steps with every draft accepted, none, some, and no drafts at all are all exercised.
    `skip=False` drafts every token asked for, all wrong, where it would draft none (an
    overlapped engine schedules the drafts asked for before they are proposed)."""

    def __init__(self, full: dict[str, list[int]], k: int, corrupt: bool = True,
                 skip: bool = True) -> None:
        self.full, self.k, self.calls, self.corrupt, self.skip = full, k, 0, corrupt, skip

    def propose(self, step, hidden, kept, next_tokens, taps=None):
        self.calls += 1
        drafts = np.full((len(kept), self.k), -1, dtype=np.int64)
        starts = step.cu_seqlens[:-1]
        for i, rid in enumerate(step.request_ids):
            want = int(step.propose[i])
            if not want or not kept[i]:
                continue
            last = int(step.positions[starts[i] + kept[i] - 1])  # last kept position
            truth = self.full[rid][last + 2:last + 2 + want]
            mode = (self.calls + i) % 4 if self.corrupt else 0
            if mode == 1 and self.skip:  # no drafts for this request this step
                continue
            guess = list(truth) if mode != 1 else [(t + 1) % 256 for t in truth]
            if mode == 2 and guess:  # first draft wrong: nothing accepted
                guess[0] = (guess[0] + 1) % 256
            if mode == 3 and len(guess) > 1:  # a later draft wrong: partial acceptance
                guess[-1] = (guess[-1] + 1) % 256
            drafts[i, : len(guess)] = guess
        return drafts


@pytest.mark.parametrize("k", [1, 3, 7])  # 7 = a DFlash2 block's drafts
def test_forced_acceptance_patterns_keep_outputs_exact(tiny, plain, k):
    prompts = _prompts()
    engine = _engine(tiny, k)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    full = {i: p + o for i, p, o in zip(ids, prompts, plain, strict=True)}
    engine.executor.runner.proposer = OracleProposer(full, k)
    out = {i: [] for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[i] for i in ids] == plain
    stats = engine.spec_stats
    assert 0 < stats.num_accepted < stats.num_drafts  # some accepted, some rejected
    assert stats.accepted_per_position[0] > 0
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)


def test_all_drafts_correct_gives_full_acceptance_statistics(tiny, plain):
    k, prompts = 3, _prompts()
    engine = _engine(tiny, k)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    full = {i: p + o for i, p, o in zip(ids, prompts, plain, strict=True)}

    engine.executor.runner.proposer = OracleProposer(full, k, corrupt=False)
    out = {i: [] for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[i] for i in ids] == plain
    stats = engine.spec_stats
    assert stats.num_accepted == stats.num_drafts > 0
    assert stats.accepted_per_position == stats.drafts_per_position
    assert stats.mean_accepted_length > 3.0  # k + 1 = 4 except where max_tokens truncates


def test_seeded_sampling_is_identical_with_speculation(tiny):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                            ignore_eos=True)
    prompts = _prompts(5)
    assert _engine(tiny, 3).generate(prompts, params) == _engine(tiny).generate(prompts, params)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_rejection_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 40000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen)
                          for j in range(k)], dim=1)
    bonus = torch.multinomial(p[k], n, replacement=True, generator=gen)
    accepted, emitted = rejection_sample(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts,
                                         torch.rand(n, k, generator=gen),
                                         torch.rand(n, vocab, generator=gen), bonus)
    # the first emitted token is distributed as p_0 whatever the draft distribution
    counts = torch.bincount(emitted[:, 0], minlength=vocab).double()
    expected = p[0].double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(vocab - 1)
    assert 0 < accepted.float().mean() < k  # both outcomes happen
    # given d_1 accepted, the second token is distributed as p_1
    second = emitted[accepted >= 1, 1]
    counts = torch.bincount(second, minlength=vocab).double()
    expected = p[1].double() * len(second)
    assert float(((counts - expected) ** 2 / expected).sum()) < _chi2_critical(vocab - 1)
    assert (emitted[accepted == k, k] == bonus[accepted == k]).all()


def test_probabilistic_mtp_drafts_keep_greedy_output_exact(tiny, plain):
    engine = _engine(tiny, 3, draft_sampling="probabilistic")
    assert engine.generate(_prompts(), GREEDY) == plain
    assert engine.spec_stats.num_drafts > 0


def test_probabilistic_mtp_sampled_run_completes_with_rejections(tiny):
    engine = _engine(tiny, 3, draft_sampling="probabilistic")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    outs = engine.generate(_prompts(4), params)
    assert [len(o) for o in outs] == [12] * 4
    assert engine.spec_stats.num_drafts > engine.spec_stats.num_accepted


def test_state_memory_per_sequence_stays_within_two_kda_states(tiny):
    engine = _engine(tiny)
    cfg = engine.model_config
    _, plain_slot = cache_bytes(cfg, 16, torch.float32, with_mtp=False)
    _, mtp3_slot = cache_bytes(cfg, 16, torch.float32, with_mtp=True, num_spec=3)
    kda_state = len(cfg.kda_layers) * (cfg.linear_num_heads * cfg.linear_head_dim**2 * 4)
    print(f"state bytes per sequence: plain {plain_slot}, MTP3 {mtp3_slot}, "
          f"one KDA state {kda_state}")
    assert mtp3_slot <= 2 * plain_slot  # one committed state; drafts replayed, not copied
