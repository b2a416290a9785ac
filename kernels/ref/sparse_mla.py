"""Reference KPool-DSA ops over a paged latent cache: indexer pooling, top-k selection, and
sparse latent (absorbed MLA) attention.

Paged layout shared by all DSA ops: token `p` of sequence `i` lives in block
`block_tables[i, p // block_size]` at offset `p % block_size`; its flat slot is
`block * block_size + offset`. The pooled indexer key of pool `j` (tokens kpool*j ..
kpool*j + kpool-1) lives in the same block at offset `(kpool*j % block_size) // kpool`, so a
token's pool slot is `slot // kpool` (block_size is a multiple of kpool).
The raw indexer rows of recent tokens live per state slot in a ring `open_rows[slot, p % R]`
(R >= kpool + the most draft tokens a step verifies), so after rejected drafts the open pool of
the last accepted token can still be rebuilt from accepted rows.

Decode context parallel (DCP, size W): a block holds block_size tokens of the sequence, but
rank r stores only the latent rows of its tokens (p % W == r), block_size / W of them, at
local offset (p % block_size) // W; pooled keys are replicated on every rank. Each rank then
attends only its own rows and returns (output, log-sum-exp) for `merge_attention_states`.
"""

from __future__ import annotations

import torch

from .latent_quant import hadamard_rotate, pack_pool_keys, unpack_fp8, unpack_latent


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
               dcp_rank: int = 0, dcp_size: int = 1) -> None:
    """Write per-token rows into a paged cache at their (logical) slots.

    rows: [T, C]; cache: [B, bs / dcp_size, C] (this rank's rows); slot_mapping: [T] logical
    slots (block * bs + offset). Under DCP only this rank's tokens are written: the others go
    to row 0 of the null block 0, which holds nothing (a boolean selection would read the
    mask back to the host, which a CUDA graph cannot capture).
    """
    slots = slot_mapping.long()
    if dcp_size > 1:
        local_bs = cache.shape[1]
        block, offset = slots // (local_bs * dcp_size), slots % (local_bs * dcp_size)
        mine = offset % dcp_size == dcp_rank
        slots = torch.where(mine, block * local_bs + offset // dcp_size, 0)
    cache.view(-1, cache.shape[-1])[slots] = rows.to(cache.dtype)


def pool_compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted pooling of kpool token keys, separately per channel.

    keys, gates: [P, kpool, d]; ape: [kpool, d]. Returns [P, d] in keys' dtype.
    """
    weights = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (weights * keys).sum(dim=1)


def indexer_update(
    keys: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    open_rows: torch.Tensor,
    pool_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    pool_format: str = "plain",
) -> None:
    """Record this step's indexer keys: complete pools go to the paged pool cache, every row
    also goes into its sequence's ring of recent rows.

    keys, gates: [T, d] (LayerNorm'd index keys, raw pooling logits); ape: [kpool, d];
    open_rows: [S, R, 2d] ring; pool_cache: [B, bs/kpool, d], or with `pool_format` "fp8"
    [B, bs/kpool, d + 4] uint8 rows of rotated keys (latent_quant.pack_pool_keys);
    positions, slot_mapping: [T].
    A sequence's tokens in one step are consecutive positions.
    """
    kpool, ring = ape.shape[0], open_rows.shape[1]
    d = keys.shape[-1]
    rows = torch.cat([keys, gates.to(keys.dtype)], dim=-1)
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        slot = int(state_ids[i])
        first = int(positions[start])
        # earlier tokens of the open pool, from the ring
        carried = open_rows[slot, (torch.arange(first - first % kpool, first)) % ring]
        seq_rows = torch.cat([carried.to(rows.dtype), rows[start:end]], dim=0)
        n_full = seq_rows.shape[0] // kpool
        if n_full:
            full = seq_rows[: n_full * kpool].view(n_full, kpool, 2 * d)
            pooled = pool_compress(full[..., :d], full[..., d:], ape)
            # the token closing pool j is the last of its kpool rows
            closing = start - carried.shape[0] + kpool * torch.arange(1, n_full + 1) - 1
            pool_slots = slot_mapping[closing].long() // kpool
            pool_cache.view(-1, pool_cache.shape[-1])[pool_slots] = (
                pack_pool_keys(pooled) if pool_format == "fp8" else pooled.to(pool_cache.dtype))
        keep = min(end - start, ring)  # only the last R rows can still be needed
        open_rows[slot, positions[end - keep:end].long() % ring] = rows[end - keep:end].to(
            open_rows.dtype)


def _gather_pools(pool_cache: torch.Tensor, block_row: torch.Tensor, n_pools: int) -> torch.Tensor:
    pools_per_block = pool_cache.shape[1]
    idx = torch.arange(n_pools)
    blocks = block_row[idx // pools_per_block].long()
    return pool_cache[blocks, idx % pools_per_block]


def indexer_topk(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pool_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    positions: torch.Tensor,
    pool_budget: int,
    kpool: int,
    pool_format: str = "plain",
    head_scale: float = 1.0,
) -> torch.Tensor:
    """Select, per query token, the tokens its sparse attention reads ("fp8" pool keys are
    rotated fp8 rows: the queries are rotated alike).

    q: [T, Hi, d]; head_weights: [T, Hi], times head_scale (the model's Hi^-0.5) in fp32;
    query_seq: [T] batch row of each query; positions: [T]. Score of complete pool j for query
    t: sum_h w_h * relu(q_h . K_j / sqrt(d)), over pools whose last token is visible
    (kpool*j + kpool-1 <= t). Returns token positions [T, pool_budget*kpool + kpool-1]:
    the top `pool_budget` pools expanded to their kpool tokens, then the tokens of the open pool
    holding t (t+1 mod kpool of them), -1 padded.
    """
    n_tok = q.shape[0]
    width = pool_budget * kpool + kpool - 1
    out = torch.full((n_tok, width), -1, dtype=torch.long)
    scale = q.shape[-1] ** -0.5
    offsets = torch.arange(kpool)
    if pool_format == "fp8":
        q = hadamard_rotate(q)
    for seq in query_seq.unique().tolist():
        rows = (query_seq == seq).nonzero().squeeze(1)
        pos = positions[rows].long()
        n_pools = int(pos.max() + 1) // kpool
        if n_pools:
            keys = _gather_pools(pool_cache, block_tables[seq], n_pools)
            keys = unpack_fp8(keys, q.shape[-1]) if pool_format == "fp8" else keys.float()
            scores = torch.relu(torch.einsum("thd,pd->thp", q[rows].float(), keys) * scale)
            index = torch.einsum("th,thp->tp", head_weights[rows].float() * head_scale, scores)
            visible = (torch.arange(n_pools) * kpool + kpool - 1).unsqueeze(0) <= pos.unsqueeze(1)
            index = index.masked_fill(~visible, float("-inf"))
            k = min(pool_budget, n_pools)
            top = index.topk(k, dim=-1)
            tokens = (top.indices.unsqueeze(-1) * kpool + offsets).flatten(1)
            valid = torch.isfinite(top.values).repeat_interleave(kpool, dim=1)
            out[rows, : k * kpool] = tokens.masked_fill(~valid, -1)
        tail_start = (pos + 1) // kpool * kpool
        tail = tail_start.unsqueeze(1) + offsets[: kpool - 1]
        out[rows, pool_budget * kpool:] = tail.masked_fill(tail > pos.unsqueeze(1), -1)
    return out


def sparse_mla_attention(
    q_latent: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    latent_format: str = "plain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over selected latent rows: every head attends the same 512-wide key=value.

    q_latent: [T, H, Lc] (W_UK-absorbed queries); latent_cache: [B, bs / dcp_size, Lc], or
    [B, bs / dcp_size, row bytes] uint8 rows of `latent_format` "fp8" / "nvfp4" (dequantised
    on read);
    token_indices: [T, W] positions in the query's sequence, -1 = unused. Under DCP only the
    positions this rank stores (p % dcp_size == dcp_rank) take part. Returns the softmax-weighted
    latents [T, H, Lc] in q_latent's dtype and the log-sum-exp of the scores [T, H] fp32
    (-inf where a query has no row here), for merging partial results across ranks.
    """
    local_bs = latent_cache.shape[1]
    block_size = local_bs * dcp_size
    idx = token_indices.clamp(min=0)
    blocks = block_tables[query_seq.long().unsqueeze(1), idx // block_size].long()
    unused = token_indices < 0
    if dcp_size > 1:
        unused = unused | (idx % dcp_size != dcp_rank)
    rows = unpack_latent(latent_cache[blocks, (idx % block_size) // dcp_size],
                         q_latent.shape[-1], latent_format)  # [T, W, Lc] fp32
    scores = torch.einsum("thc,twc->thw", q_latent.float(), rows) * scale
    scores = scores.masked_fill(unused.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
    out = torch.einsum("thw,twc->thc", probs.nan_to_num(0.0), rows)
    return out.to(q_latent.dtype), lse


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Combine partial attention results over disjoint key sets.

    outs: [P, T, H, C] (each normalised over its own keys); lses: [P, T, H]. Returns [T, H, C]:
    sum_p exp(lse_p - lse) * out_p with lse = logsumexp_p lse_p.
    """
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.unsqueeze(0)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * outs.float()).sum(dim=0).to(outs.dtype)
