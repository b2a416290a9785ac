"""Reference speculative rejection sampling for drafts with a distribution (probabilistic
drafting): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit
a sample of the normalised residual max(0, p_j - q_j); if all k are accepted, emit a sample of
p_k (the bonus token). The emitted tokens are distributed exactly as sampling from p."""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniform: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence per batch row.

    target_probs: [N, k+1, V]; draft_probs: [N, k, V]; draft_ids: [N, k]; uniform: [N, k] in
    (0, 1). Returns (accepted [N] in 0..k, emitted [N, k+1] with -1 after the last emitted).
    """
    n, k = draft_ids.shape
    p_d = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    q_d = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    ok = uniform < torch.clamp(p_d / q_d.clamp(min=1e-30), max=1.0)
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    emitted = torch.full((n, k + 1), -1, dtype=torch.long)
    for i in range(n):
        a = int(accepted[i])
        emitted[i, :a] = draft_ids[i, :a]
        if a < k:
            residual = (target_probs[i, a] - draft_probs[i, a]).clamp(min=0)
            dist = residual / residual.sum()
        else:
            dist = target_probs[i, k]
        emitted[i, a] = torch.multinomial(dist, 1, generator=generator)[0]
    return accepted, emitted
