"""Reference kernels against independent formulations (fp32/fp64, stated tolerances)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.ref import kda, mhc, moe, sparse_mla

G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=G)


def test_kda_attention_matches_chunked_algorithm_and_resumes_from_state():
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

    lens, h, dk, dv = [37, 5, 70], 3, 8, 6
    t = sum(lens)
    q, k, v = _randn(t, h, dk), _randn(t, h, dk), _randn(t, h, dv)
    g = -5 * torch.sigmoid(_randn(t, h, dk))
    beta = torch.sigmoid(_randn(t, h))
    cu = torch.tensor([0, 37, 42, 112])
    state = torch.zeros(5, h, dk, dv)
    ids = torch.tensor([4, 0, 2])
    out = kda.kda_attention(q, k, v, g, beta, state, cu, ids, torch.tensor([False] * 3))
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ref, final = chunk_kimi_delta_attention(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            chunk_size=16, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.allclose(out[s:e], ref[0], atol=1e-5, rtol=1e-4)
        assert torch.allclose(state[ids[i]], final[0], atol=1e-5, rtol=1e-4)
    # splitting the last sequence in two steps (state carried in its slot) changes nothing
    state2 = torch.zeros_like(state)
    one = torch.tensor([2])
    a = kda.kda_attention(q[42:80], k[42:80], v[42:80], g[42:80], beta[42:80], state2,
                          torch.tensor([0, 38]), one, torch.tensor([False]))
    b = kda.kda_attention(q[80:], k[80:], v[80:], g[80:], beta[80:], state2,
                          torch.tensor([0, 32]), one, torch.tensor([True]))
    assert torch.allclose(torch.cat([a, b]), out[42:], atol=1e-5)
    assert torch.allclose(state2[2], state[2], atol=1e-5)


def test_causal_conv1d_chunks_equal_one_padded_convolution():
    c, width = 6, 4
    x, w = _randn(23, c), _randn(c, width)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=width - 1, groups=c)[0, :, :23]).t()
    conv_state = torch.full((2, c, width - 1), 7.0)  # stale slot contents must be ignored
    outs = []
    for start, end in [(0, 2), (2, 3), (3, 15), (15, 23)]:
        outs.append(kda.causal_conv1d(x[start:end], w, conv_state, torch.tensor([0, end - start]),
                                      torch.tensor([1]), torch.tensor([start > 0])))
    assert torch.allclose(torch.cat(outs), ref, atol=1e-6)
    assert torch.equal(conv_state[1], x[-(width - 1):].t())


def test_sparse_mla_attention_with_every_token_selected_is_dense_causal_attention():
    h, c, block = 3, 8, 4
    lens = [9, 6]
    latents = [_randn(n, c) for n in lens]
    cache = torch.zeros(8, block, c)
    tables = torch.tensor([[5, 1, 7], [2, 0, 3]])
    for i, lat in enumerate(latents):
        slots = tables[i, torch.arange(lens[i]) // block] * block + torch.arange(lens[i]) % block
        sparse_mla.store_rows(lat, cache, slots)
    q = _randn(sum(lens), h, c)
    query_seq = torch.tensor([0] * 9 + [1] * 6)
    pos = torch.cat([torch.arange(9), torch.arange(6)])
    sel = torch.where(torch.arange(12)[None] <= pos[:, None], torch.arange(12)[None], -1)
    out, lse = sparse_mla.sparse_mla_attention(q, cache, tables, query_seq, sel, scale=0.3)
    for i, (start, n) in enumerate([(0, 9), (9, 6)]):
        kv = latents[i][None, None].expand(1, h, n, c)
        ref = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1)[None], kv, kv,
                                             is_causal=True, scale=0.3)[0].transpose(0, 1)
        assert torch.allclose(out[start:start + n], ref, atol=1e-5)
        scores = torch.einsum("thc,sc->ths", q[start:start + n], latents[i]) * 0.3
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        want = torch.logsumexp(scores.masked_fill(~causal[:, None], float("-inf")), dim=-1)
        assert torch.allclose(lse[start:start + n], want, atol=1e-5)
    # decode context parallel: 3 ranks each store every third row; merged = unsplit
    dcp = 3
    parts = []
    for rank in range(dcp):
        local = torch.zeros(8, 2, c)  # logical block of 6 tokens = 2 rows on each of 3 ranks
        for i, lat in enumerate(latents):
            p = torch.arange(lens[i])
            slots = tables[i, p // 6] * 6 + p % 6
            sparse_mla.store_rows(lat, local, slots, rank, dcp)
        parts.append(sparse_mla.sparse_mla_attention(q, local, tables, query_seq, sel, 0.3,
                                                     rank, dcp))
    merged = sparse_mla.merge_attention_states(torch.stack([o for o, _ in parts]),
                                               torch.stack([lse for _, lse in parts]))
    assert torch.allclose(merged, out, atol=1e-5)


def test_indexer_update_and_topk_match_brute_force():
    kpool, d, hi, block, budget = 4, 5, 6, 8, 2
    n = 27
    keys, gates, ape = _randn(n, d), _randn(n, d), _randn(kpool, d)
    table = torch.tensor([[3, 0, 5, 1]])
    slots = table[0, torch.arange(n) // block] * block + torch.arange(n) % block
    pool_cache = torch.zeros(6, block // kpool, d)
    open_rows = torch.zeros(2, kpool, 2 * d)
    for start, end in [(0, 3), (3, 10), (10, 11), (11, 27)]:  # chunks across pool boundaries
        sparse_mla.indexer_update(keys[start:end], gates[start:end], ape, open_rows, pool_cache,
                                  torch.arange(start, end), slots[start:end],
                                  torch.tensor([0, end - start]), torch.tensor([1]))
    pools = []
    for p in range(n // kpool):
        w = torch.softmax(gates[p * 4:p * 4 + 4] + ape, dim=0)
        pools.append((w * keys[p * 4:p * 4 + 4]).sum(0))
    pools = torch.stack(pools)
    q, wts = _randn(n, hi, d), _randn(n, hi)
    got = sparse_mla.indexer_topk(q, wts, pool_cache, table, torch.zeros(n, dtype=torch.long),
                                  torch.arange(n), budget, kpool)
    for t in range(n):
        visible = [p for p in range(n // kpool) if 4 * p + 3 <= t]
        score = {p: float((wts[t] * torch.relu(q[t] @ pools[p] / d**0.5)).sum()) for p in visible}
        top = sorted(visible, key=lambda p: -score[p])[:budget]
        want = {4 * p + j for p in top for j in range(4)} | set(range((t + 1) // 4 * 4, t + 1))
        assert set(got[t].tolist()) - {-1} == want


def test_hc_pre_gives_doubly_stochastic_comb_and_bounded_gates():
    n, d = 4, 16
    streams = _randn(7, n, d)
    post, comb, collapsed = mhc.hc_pre(streams, _randn((2 + n) * n, n * d) * 0.3,
                                       _randn((2 + n) * n), _randn(3).abs() + 0.5, 1e-5, 1e-6, 20)
    assert torch.allclose(comb.sum(-2), torch.ones(7, n), atol=1e-4)
    # 20 Sinkhorn steps end on a column pass: columns exact, rows close on peaky inputs
    assert torch.allclose(comb.sum(-1), torch.ones(7, n), atol=0.05)
    assert ((post > 0) & (post < 2)).all()
    assert collapsed.shape == (7, d)
    y = _randn(7, d)
    out = mhc.hc_post(streams, y, post, comb)
    ref = torch.einsum("tj,td->tjd", post, y) + torch.einsum("tij,tid->tjd", comb, streams)
    assert torch.allclose(out, ref, atol=1e-6)


def test_fused_moe_matches_per_token_loop_and_splits_across_expert_ranks():
    t, d, inter, e, k = 9, 6, 5, 5, 2
    x, w13, w2 = _randn(t, d), _randn(e, 2 * inter, d), _randn(e, d, inter)
    weights, ids = moe.route_topk(_randn(t, e), _randn(e), k, True, 2.5)
    assert torch.allclose(weights.sum(-1), torch.full((t,), 2.5))
    out = moe.fused_moe(x, w13, w2, weights, ids, swiglu_limit=1.5)
    ref = torch.zeros(t, d)
    for i in range(t):
        for j in range(k):
            gate, up = (w13[ids[i, j]] @ x[i]).chunk(2)
            act = F.silu(gate.clamp(max=1.5)) * up.clamp(-1.5, 1.5)
            ref[i] += weights[i, j] * (w2[ids[i, j]] @ act)
    assert torch.allclose(out, ref, atol=1e-5)
    halves = sum(moe.fused_moe(x, w13[s:s + 3], w2[s:s + 3], weights, ids, 1.5, expert_offset=s)
                 for s in (0, 3))
    assert torch.allclose(halves, out, atol=1e-6)

