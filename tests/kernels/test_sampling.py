"""Reference sampling against analytic distributions, a Python splitmix64 and naive loops.

Statistical checks use fixed seeds, so they are deterministic; their thresholds are chi-square
critical values at p = 1e-4 (Wilson-Hilferty), i.e. a correct sampler fails 1 seed in 10^4.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53.kernels.ref import sampling

Z_1E4 = 3.719016  # upper 1e-4 quantile of the standard normal
LOGITS = [1.3, -0.4, 2.1, 0.2, -1.5, 0.9, 1.7, -0.9, 0.5, -0.25, 1.0, -1.2]
N_DRAWS = 20000


def _chi2_critical(df: int) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + Z_1E4 * math.sqrt(a)) ** 3


def _analytic(logits, temperature, top_k, top_p, min_p) -> list[float]:
    """Float64 probabilities after temperature, min-p, top-k, top-p, each renormalised."""
    x = [v / temperature for v in logits]
    w = [math.exp(v - max(x)) for v in x]  # w_i = p_i / p_max
    order = sorted((i for i in range(len(x)) if w[i] >= min_p), key=lambda i: -x[i])
    if top_k:
        order = order[:top_k]
    total, mass, nucleus = sum(w[i] for i in order), 0.0, []
    for i in order:
        if mass < top_p:
            nucleus.append(i)
        mass += w[i] / total
    total = sum(w[i] for i in nucleus)
    return [w[i] / total if i in nucleus else 0.0 for i in range(len(x))]


def _row(value, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


CONFIGS = {  # temperature, top_k, top_p, min_p
    "temperature": (0.7, 0, 1.0, 0.0),
    "top_k": (1.0, 3, 1.0, 0.0),
    "top_p": (1.0, 0, 0.8, 0.0),
    "min_p": (1.0, 0, 1.0, 0.1),
    "combined": (0.8, 7, 0.8, 0.05),  # min-p keeps 8, top-k 7, top-p 4
}


@pytest.mark.parametrize("name", CONFIGS)
def test_distribution_matches_analytic(name):
    temperature, top_k, top_p, min_p = CONFIGS[name]
    expected = torch.tensor(_analytic(LOGITS, temperature, top_k, top_p, min_p),
                            dtype=torch.float64)
    kept = expected > 0
    n = N_DRAWS
    processed = sampling.process_logits(
        torch.tensor([LOGITS]).expand(n, -1), _row(temperature, n),
        _row(top_k, n, torch.int32), _row(top_p, n), _row(min_p, n))
    # the processed logits are exactly the analytic distribution, masked tokens at -inf
    assert torch.equal(torch.isinf(processed[0]), ~kept)
    assert torch.allclose(torch.softmax(processed[0], -1).double(), expected, atol=1e-6)
    seeds = torch.arange(n) * 7919 + 11  # 20k distinct (seed, position) pairs
    draws = sampling.sample(processed, _row(temperature, n), seeds, torch.arange(n) % 97)
    counts = torch.bincount(draws, minlength=len(LOGITS)).double()
    assert counts[~kept].sum() == 0  # masked tokens are never drawn
    chi2 = (((counts - n * expected)[kept]) ** 2 / (n * expected[kept])).sum().item()
    assert chi2 < _chi2_critical(int(kept.sum()) - 1)


def test_greedy_rows_are_unprocessed_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    top_k = torch.tensor([0, 2, 1, 1, 0, 0])
    top_p = torch.tensor([1.0, 0.3, 0.9, 1.0, 1e-6, 1.0])
    min_p = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.0, 0.99999])
    processed = sampling.process_logits(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(processed[:3], logits[:3])  # greedy rows: no scaling, no masks
    # top-k 1, a tiny top-p and min-p ~1 each keep only the argmax
    assert (~torch.isinf(processed[3:])).sum(-1).tolist() == [1, 1, 1]
    assert processed[5].max() == logits[5].max() / 0.5
    for seed in range(20):
        ids = sampling.sample(processed, temperature, torch.full((6,), seed), torch.zeros(6))
        assert ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_ties_and_top_p_edges():
    k2 = sampling.process_logits(torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]]), torch.ones(1),
                                 torch.tensor([2]), torch.ones(1), torch.zeros(1))
    assert (~torch.isinf(k2)).sum() == 2  # ties at the k-th value: still exactly k kept
    flat = torch.zeros(1, 50000)
    full = sampling.process_logits(flat, torch.ones(1), torch.zeros(1), torch.ones(1),
                                   torch.zeros(1))
    assert not torch.isinf(full).any()  # top_p = 1 keeps all despite fp32 cumsum rounding
    half = sampling.process_logits(flat[:, :1000], torch.ones(1), torch.zeros(1),
                                   torch.tensor([0.5]), torch.zeros(1))
    assert abs((~torch.isinf(half)).sum().item() - 500) <= 1


M64 = (1 << 64) - 1


def _py_mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_random_uniform_is_splitmix64_of_seed_position_and_index():
    assert _py_mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64(0)'s first output
    seeds = torch.tensor([0, -1, 2**62 + 12345, -(2**63), 7])
    positions = torch.tensor([0, 5, 1000, 3, 2**40])
    u = sampling.random_uniform(seeds, positions, 37)
    for r, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        key = _py_mix(_py_mix(seed) ^ (pos & M64))
        for v in (0, 1, 17, 36):
            bits = _py_mix(key + (v + 1) * 0x9E3779B97F4A7C15) >> 41
            assert u[r, v].item() == (bits + 0.5) / 2**23


def test_random_uniform_is_uniform_and_uncorrelated():
    n_rows, vocab = 256, 4096
    u = sampling.random_uniform(torch.arange(n_rows) - 100, torch.arange(n_rows) % 3, vocab)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002  # std of the mean ~3e-4
    assert abs(u.var().item() - 1 / 12) < 0.001
    counts = torch.histc(u, bins=64, min=0, max=1).double()
    expected = u.numel() / 64
    assert ((counts - expected) ** 2 / expected).sum() < _chi2_critical(63)
    c = u - 0.5
    for a, b in [(c[:, 1:], c[:, :-1]), (c[1:], c[:-1])]:  # neighbouring indices, rows
        assert abs((a * b).mean().item() * 12) < 0.01


def _batch_draw(logits, temperature, top_k, top_p, seeds, positions):
    n = logits.shape[0]
    processed = sampling.process_logits(logits, temperature, top_k, top_p, torch.zeros(n))
    return sampling.sample(processed, temperature, seeds, positions)


def test_seeded_draws_do_not_depend_on_batch_composition():
    g = torch.Generator().manual_seed(1)
    vocab = 500
    target = torch.randn(1, vocab, generator=g) * 0.5  # many plausible tokens
    alone = []
    for t in range(20):
        seed, pos = torch.tensor([1000 + t]), torch.tensor([3 * t])
        one = _batch_draw(target, torch.ones(1), torch.zeros(1), torch.tensor([0.95]), seed, pos)
        alone.append(one.item())
        idx = t % 8
        logits = torch.randn(8, vocab, generator=g) * 2
        logits[idx] = target[0]
        temperature = torch.rand(8, generator=g) * (torch.rand(8, generator=g) > 0.3)
        top_k = torch.randint(0, 50, (8,), generator=g)
        top_p = torch.rand(8, generator=g) * 0.9 + 0.1
        seeds = torch.randint(0, 2**40, (8,), generator=g)
        positions = torch.randint(0, 100, (8,), generator=g)
        temperature[idx], top_k[idx], top_p[idx] = 1.0, 0, 0.95
        seeds[idx], positions[idx] = seed, pos
        batched = _batch_draw(logits, temperature, top_k, top_p, seeds, positions)
        assert batched[idx].item() == alone[-1]
    assert len(set(alone)) > 10  # the draws do vary, so agreeing means something


def test_different_seeds_or_positions_draw_differently():
    n, vocab = 500, 500
    logits = torch.zeros(n, vocab)
    ones = torch.ones(n)
    by_seed = _batch_draw(logits, ones, ones * 0, ones, torch.arange(n), torch.zeros(n))
    by_pos = _batch_draw(logits, ones, ones * 0, ones, torch.zeros(n), torch.arange(n))
    # 500 uniform draws over 500 tokens: ~316 distinct expected
    assert len(set(by_seed.tolist())) > 250
    assert len(set(by_pos.tolist())) > 250
    assert (by_seed != by_pos).float().mean() > 0.9


def _naive_penalties(row, presence, frequency, repetition, prompt, output):
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


def test_penalties_match_naive_per_row_loop():
    g = torch.Generator().manual_seed(2)
    vocab = 20
    logits = torch.randn(5, vocab, generator=g) * 2
    presence = [0.5, 0.0, -1.0, 0.0, 2.0]
    frequency = [0.3, 0.0, 0.7, 0.0, -0.5]
    repetition = [1.3, 1.0, 0.8, 1.0, 2.0]
    prompts = [[1, 2, 2, 5], [3, 4], [], [], [7, 7, 0]]
    outputs = [[2, 9, 9, 9], [4, 4], [11, 11, 19], [], [0, 1, 1]]

    def ragged(lists):
        offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
        return torch.tensor([t for x in lists for t in x], dtype=torch.long), offsets

    out = sampling.apply_penalties(logits, torch.tensor(presence), torch.tensor(frequency),
                                   torch.tensor(repetition), *ragged(prompts), *ragged(outputs))
    for r in range(5):
        ref = _naive_penalties(logits[r].tolist(), presence[r], frequency[r], repetition[r],
                               prompts[r], outputs[r])
        assert torch.allclose(out[r], torch.tensor(ref), atol=1e-6)
    assert torch.equal(out[1], logits[1])  # context but neutral penalties
    assert not torch.equal(out[0], logits[0])
