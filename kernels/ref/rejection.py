"""Reference speculative rejection sampling for drafts drawn from a distribution q: accept d_j
with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a draw from the
normalised residual max(0, p_j - q_j); if all k are accepted, emit the bonus token (a draw
from p_k). The emitted tokens are then distributed exactly as sampling from p. All randomness
comes in as uniforms, so a request's outcome is a pure function of its own seed."""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniform: torch.Tensor,
    residual_uniform: torch.Tensor,
    bonus: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence per batch row.

    target_probs: [N, k+1, V]; draft_probs: [N, k, V]; draft_ids: [N, k]; uniform: [N, k]
    in (0, 1) (acceptance tests); residual_uniform: [N, V] in (0, 1) (Gumbel noise of the
    residual draw); bonus: [N] token drawn from p_k. Returns (accepted [N] in 0..k,
    emitted [N, k+1], -1 after the last emitted token).
    """
    n, k = draft_ids.shape
    p_d = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    q_d = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    ok = uniform < torch.clamp(p_d / q_d.clamp(min=1e-30), max=1.0)
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    dev = draft_ids.device
    rows = torch.arange(n, device=dev)
    at = accepted.clamp(max=k - 1)
    residual = (target_probs[rows, at] - draft_probs[rows, at]).clamp(min=0)
    gumbel = -torch.log(-torch.log(residual_uniform))
    resampled = (torch.log(residual) + gumbel).argmax(dim=-1)
    last = torch.where(accepted == k, bonus, resampled)
    emitted = torch.where(torch.arange(k + 1, device=dev)[None, :] < accepted[:, None],
                          torch.cat([draft_ids, draft_ids[:, :1]], dim=1), -1)
    emitted[rows, accepted] = last
    return accepted, emitted
