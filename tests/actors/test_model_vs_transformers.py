"""Our GLM-5.3-Flash forward vs transformers' Glm5Next on tiny random checkpoints (fp32).

Every checkpoint is written by our `make-tiny` and loaded by both implementations. Tolerance:
max |delta logit| <= 1e-4 (fp32; observed ~3e-5, the two differ only in summation order).
"""

from __future__ import annotations

import pytest
import torch

from glm53.actors.loader import load_model
from tests.naive_runner import SequenceRunner, generate

from .oracle import hf_greedy, hf_logits, load_hf

TOL = 1e-4

CONFIGS = {
    # contexts of 120 tokens vs a 2-pool budget: selection is really sparse
    "sparse": dict(layers=5, mtp=True, index_topk=8, seq_len=120),
    # 4 streams, MoE on 7 of 8 layers, two DSA layers
    "hc4_moe": dict(layers=8, hc_mult=4, n_routed_experts=16, num_experts_per_tok=4,
                    first_k_dense_replace=1, seq_len=72),
    # odd sizes everywhere: 3 streams, 3 heads, v != qk head dim, kpool 2, conv width 3,
    # a custom layer schedule and 3 dense layers
    "odd": dict(layers=6, hidden_size=72, hc_mult=3, num_attention_heads=3,
                num_key_value_heads=3, qk_nope_head_dim=12, v_head_dim=20, kv_lora_rank=24,
                q_lora_rank=40, index_head_dim=8, index_topk=6, index_kpool=2,
                intermediate_size=88, moe_intermediate_size=24, n_routed_experts=6,
                num_experts_per_tok=3, first_k_dense_replace=3,
                layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention",
                             "deepseek_sparse_attention", "linear_attention", "linear_attention"],
                linear_attn_config={"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 3,
                                    "gate_lower_bound": -5.0},
                seq_len=57),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tiny_checkpoints):
    spec = dict(CONFIGS[request.param])
    seq_len = spec.pop("seq_len")
    layers, mtp = spec.pop("layers"), spec.pop("mtp", False)
    if "layer_types" not in spec:
        spec["layer_types"] = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                               for i in range(layers)]
    first_dense = spec.get("first_k_dense_replace", 1)
    spec["mlp_layer_types"] = ["dense" if i < first_dense else "sparse" for i in range(layers)]
    path = tiny_checkpoints(seed=7, layers=layers, mtp=mtp, **spec)
    model = load_model(path, progress=False)
    hf = load_hf(path)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, model.config.vocab_size, (seq_len,), generator=gen).tolist()
    return model, hf, ids, hf_logits(hf, ids)


def _runner(model, n_seqs: int = 1, max_len: int = 256) -> SequenceRunner:
    runner = SequenceRunner(model, max_seqs=n_seqs, max_len=max_len)
    for i in range(n_seqs):
        runner.add(i)
    return runner


def test_sparse_selection_matters(case):
    """Contexts hold several times the pool budget, so dense attention would differ: the
    agreement below is on genuinely sparse selection."""
    model, _, ids, ref = case
    cfg = model.config
    assert len(ids) // cfg.index_kpool >= 4 * cfg.index_pool_budget
    indexers = [layer.self_attn.indexer for layer in model.layers if not layer.is_kda]
    budgets = [ix.pool_budget for ix in indexers]
    try:
        for ix in indexers:
            ix.pool_budget = len(ids)  # every complete pool selected = dense causal attention
        dense = _runner(model).step_logits({0: ids})
    finally:
        for ix, b in zip(indexers, budgets, strict=True):
            ix.pool_budget = b
    assert (dense - ref).abs().max().item() > 1e-3


def test_full_prompt_logits(case):
    model, _, ids, ref = case
    ours = _runner(model).step_logits({0: ids})
    assert (ours - ref).abs().max().item() <= TOL


def test_chunked_prefill_logits(case):
    model, _, ids, ref = case
    runner = _runner(model)
    outs, pos = [], 0
    for size in (5, 1, 13, 2, 30):  # awkward sizes crossing pool and block boundaries
        outs.append(runner.step_logits({0: ids[pos:pos + size]}))
        pos += size
    outs.append(runner.step_logits({0: ids[pos:]}))
    assert (torch.cat(outs) - ref).abs().max().item() <= TOL


def test_token_by_token_decode_logits(case):
    model, _, ids, ref = case
    runner = _runner(model)
    split = len(ids) // 3
    outs = [runner.step_logits({0: ids[:split]})]
    outs += [runner.step_logits({0: [t]}) for t in ids[split:]]
    assert (torch.cat(outs) - ref).abs().max().item() <= TOL


def test_mixed_flat_batch_matches_single_sequences(case):
    """Three sequences in one flat batch: one decoding, one mid-prefill, one starting."""
    model, hf, ids, ref = case
    other = ids[::-1][:40]
    ref_other = hf_logits(hf, other)
    runner = _runner(model, n_seqs=3)
    a = runner.step_logits({0: ids[:30], 1: other[:9]})
    assert (a[:30] - ref[:30]).abs().max().item() <= TOL
    assert (a[30:] - ref_other[:9]).abs().max().item() <= TOL
    b = runner.step_logits({1: other[9:40], 0: [ids[30]], 2: ids[:17]})
    assert (b[:31] - ref_other[9:40]).abs().max().item() <= TOL
    assert (b[31] - ref[30]).abs().max().item() <= TOL
    assert (b[32:] - ref[:17]).abs().max().item() <= TOL


def test_greedy_continuation_matches(case):
    model, hf, ids, _ = case
    prompt = ids[: len(ids) // 2]
    ours = generate(model, prompt, max_tokens=32, temperature=0.0)
    assert ours == hf_greedy(hf, prompt, 32)
    assert len(set(ours)) > 1  # a non-degenerate continuation
