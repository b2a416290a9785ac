"""Reference token sampling, vectorised over rows: penalties, logits processing and seeded draws.

Pipeline (vLLM semantics): `apply_penalties` -> `process_logits` (temperature, then min-p,
top-k and top-p masks) -> `sample` (greedy argmax, or Gumbel-max with counter-based noise).
A row's noise is a pure function of its (seed, position), so a seeded request draws the same
tokens whatever else shares the batch and wherever its row lands.
"""

from __future__ import annotations

import torch


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: mask the sign copies)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps mod 2**64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def random_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms: [R] int64 seeds and positions -> [R, vocab] float32 in (0, 1).

    Entry (r, v) is the v-th splitmix64 output of a stream keyed by (seeds[r], positions[r]),
    so it depends on nothing else in the batch. Values are (k + 0.5) / 2**23 for a 23-bit k:
    exact in float32 and never 0 or 1 (the Gumbel transform needs both logs finite).
    """
    key = _mix64(_mix64(seeds.long()) ^ positions.long()).unsqueeze(1)
    counter = (torch.arange(1, vocab + 1, device=seeds.device) * _GOLDEN).unsqueeze(0)
    bits = _shr(_mix64(key + counter), 41)
    return (bits.float() + 0.5) * 2.0**-23


def _row_counts(ids: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[R, V] float32 occurrence counts of the ragged rows ids[offsets[r]:offsets[r+1]]."""
    rows = torch.repeat_interleave(torch.arange(shape[0], device=ids.device), offsets.diff(),
                                   output_size=ids.shape[0])  # output_size: no host sync
    counts = torch.zeros(shape[0] * shape[1], device=ids.device)
    counts.scatter_add_(0, rows * shape[1] + ids, torch.ones(ids.shape[0], device=ids.device))
    return counts.view(shape)


def apply_penalties(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_offsets: torch.Tensor,
    output_ids: torch.Tensor,
    output_offsets: torch.Tensor,
) -> torch.Tensor:
    """Penalise tokens already seen (vLLM semantics); returns new [R, V] fp32 logits.

    logits: [R, V]; presence, frequency, repetition: [R] float; row r's context is
    prompt_ids[prompt_offsets[r]:prompt_offsets[r+1]] and likewise output_ids ([R+1] offsets).
    Repetition divides positive / multiplies negative logits of tokens in prompt or output;
    then frequency subtracts per output occurrence and presence once per token in the output.
    """
    logits = logits.float()
    shape = (logits.shape[0], logits.shape[1])
    out_counts = _row_counts(output_ids, output_offsets, shape)
    seen = (_row_counts(prompt_ids, prompt_offsets, shape) > 0) | (out_counts > 0)
    rep = torch.where(seen, repetition.float().unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency.float().unsqueeze(1) * out_counts
    return logits - presence.float().unsqueeze(1) * (out_counts > 0).float()


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature and truncation: [R, V] logits -> [R, V] fp32 logits, -inf where masked.

    temperature, top_p, min_p: [R] float; top_k: [R] int (0 = off). Non-greedy rows are divided
    by temperature, then masked in vLLM's order, each on what the previous step kept: min-p
    (drop p < min_p * max p), top-k (stable-sorted ties: exactly k kept), top-p (keep a token
    if the mass strictly before it in descending order is < top_p; top_p = 1 keeps all, as
    fp32 sums may reach 1 early). Greedy rows (temperature 0) come back unscaled and unmasked,
    so their softmax is the plain (penalised) distribution that logprobs report.
    """
    logits = logits.float()
    greedy = (temperature == 0).unsqueeze(1)
    x = logits / torch.where(greedy, 1.0, temperature.float().unsqueeze(1))
    # min-p compares p_i / p_max = exp(x_i - x_max), which no renormalisation changes
    ratio = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    x = x.masked_fill(ratio < min_p.float().unsqueeze(1), float("-inf"))
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.long(), x.shape[1]).unsqueeze(1)
    sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    p = top_p.float().unsqueeze(1)
    sorted_x = sorted_x.masked_fill((before >= p) & (p < 1), float("-inf"))
    x = torch.empty_like(x).scatter_(1, order, sorted_x)
    return torch.where(greedy, logits, x)


def sample(
    processed: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row of `process_logits` output: [R, V] -> [R] int64.

    Greedy rows (temperature 0) take the argmax (first index on ties); the others take
    argmax(processed + Gumbel noise), an exact draw from softmax(processed), with the noise of
    `random_uniform(seeds, positions)`. The 23-bit uniforms bound the Gumbel noise to about
    [-2.8, 16.6], so a token ~19 nats below the best is never drawn (probability < 4e-9).
    """
    u = random_uniform(seeds, positions, processed.shape[1])
    noisy = processed.float() - torch.log(-torch.log(u))
    return torch.where(temperature == 0, processed.argmax(dim=-1), noisy.argmax(dim=-1))
