"""Reference mHC (manifold-constrained hyper-connections) for the 4 residual streams.

`hc_pre` computes one site's coefficients (pre / post / Sinkhorn-normalised comb) and the collapsed
block input; `hc_post` expands a block output back into the streams; `hc_post_pre` is the two
back to back (one site's expansion feeding the next site), one pass on the GPU. Coefficients are
per token.
"""

from __future__ import annotations

import torch

from .norm import rms_norm


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site.

    streams: [T, n, D]; fn: [(2+n)*n, n*D]; base: [(2+n)*n]; scale: [3]; norm_weight: [D], the
    block's input RMSNorm, applied to the collapsed input when given.
    Returns post [T, n] fp32, comb [T, n, n] fp32 (comb[i, j]: stream i -> output stream j),
    collapsed [T, D] in streams' dtype (RMS-normed with norm_weight, norm_eps when given:
    `rms_norm(collapsed, norm_weight, norm_eps)`).
    """
    n = streams.shape[1]
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    mixed = flat @ fn.float().t()
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp towards a doubly-stochastic matrix: a column pass, then (row, column) pairs.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    if norm_weight is not None:
        collapsed = rms_norm(collapsed, norm_weight, norm_eps)
    return post, comb, collapsed


def hc_post(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a block output into the streams: X'[j] = post[j] * y + sum_i comb[i, j] * X[i].

    streams: [T, n, D]; block_out: [T, D]; post: [T, n]; comb: [T, n, n]. Returns [T, n, D].
    """
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_post_pre(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_post` of one site, then `hc_pre` of the next on its output (arguments as theirs).
    Returns (streams [T, n, D], post [T, n], comb [T, n, n], collapsed [T, D])."""
    streams = hc_post(streams, block_out, post, comb)
    return (streams, *hc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters,
                             norm_weight, norm_eps))
