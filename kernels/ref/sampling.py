"""Reference token sampling: greedy, temperature, top-k and top-p per row."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row.

    logits: [R, V]; temperature, top_p: [R] float; top_k: [R] int (0 = off). Rows with
    temperature 0 are greedy (argmax). Returns [R] int64.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    temp = temperature.float().clamp(min=1e-5).unsqueeze(1)
    probs = torch.softmax(logits / temp, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, probs.shape[1]).unsqueeze(1)
    # keep a token if the mass strictly before it is < top_p (the first token always survives)
    keep = (rank < k) & ((sorted_p.cumsum(-1) - sorted_p) < top_p.float().unsqueeze(1))
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=generator)
    sampled = order.gather(1, choice).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)
