"""Checkpoints that transformers writes itself load here and compute what it computes.

Each config is made by `Glm5NextConfig(...)` with some optional fields set and the rest left at
transformers' defaults (which differ from the release in places, e.g. `index_kpool` 16), the
model is transformers' own with random weights, and `save_pretrained` writes both: so the
config.json carries what transformers adds (`mlp_layer_types` next to a `first_k_dense_replace`
it ignores, `indexer_types`, renamed layer types). fp32, max |delta logit| <= 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch

from glm53.actors.config import DENSE, DSA, KDA, MOE
from glm53.actors.loader import load_model
from tests.naive_runner import SequenceRunner

from .oracle import hf_logits, save_hf_checkpoint

TOL = 1e-4
SEQ_LEN = 80

# the sizes every case sets to stay tiny (>= 16 indexer heads: no index-score ties)
TINY = dict(vocab_size=256, pad_token_id=0, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, v_head_dim=16, index_n_heads=16, index_head_dim=16,
            linear_num_heads=2, linear_head_dim=16, max_position_embeddings=256)

CASES = {
    # every schedule left to transformers: 3 dense layers, DSA at 3, index_kpool 16
    "defaults": dict(num_hidden_layers=4, index_topk=32),
    # transformers ignores first_k_dense_replace and builds its default 3 dense layers
    "first_k_dense_disagrees": dict(num_hidden_layers=5, first_k_dense_replace=1,
                                    index_kpool=4, index_topk=8),
    # explicit lists in legacy and current names; every legacy field disagrees with them
    "explicit_schedules": dict(
        num_hidden_layers=6, first_k_dense_replace=2, index_kpool=4, index_topk=8,
        layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention",
                     "full_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "dense", "sparse", "sparse"],
        indexer_types=["full"] * 6, index_topk_freq=2,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 3,
                            "kda_layers": [0, 1, 2, 4, 5], "full_attn_layers": [3]}),
    # the softplus gate and other non-release options
    "softplus_gate_and_options": dict(
        num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, v_head_dim=20,
        index_kpool=2, index_topk=6, hc_mult=2, hc_sinkhorn_iters=7, hc_eps=1e-5,
        norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2, swiglu_limit=4.0,
        rms_norm_eps=1e-6,
        linear_attn_config={"num_heads": 3, "head_dim": 8, "gate_lower_bound": None,
                            "safe_gate": False}),
}

_KINDS = {"linear_attention": KDA, "indexed_attention": DSA, "dense": DENSE, "sparse": MOE}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint({**TINY, **CASES[request.param]}, path, seed=3)
    model = load_model(path, progress=False)
    ids = torch.randint(0, TINY["vocab_size"], (SEQ_LEN,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    return model, hf, ids


def test_layers_are_the_ones_transformers_built(case):
    model, hf, _ = case
    text = hf.config.text_config
    assert model.config.layer_types == tuple(_KINDS[t] for t in text.layer_types)
    assert model.config.mlp_layer_types == tuple(_KINDS[t] for t in text.mlp_layer_types)
    assert model.config.linear_lower_bound == text.linear_lower_bound


def test_prefill_and_decode_logits_match_transformers(case):
    model, hf, ids = case
    ref = hf_logits(hf, ids)
    assert ref.std().item() > 0.1  # random weights that give a real signal
    runner = SequenceRunner(model, max_seqs=1, max_len=SEQ_LEN)
    runner.add(0)
    split = 2 * SEQ_LEN // 3
    ours = [runner.step_logits({0: ids[:split]})]
    ours += [runner.step_logits({0: [t]}) for t in ids[split:]]
    assert (torch.cat(ours) - ref).abs().max().item() <= TOL


def test_disagreeing_legacy_fields_are_logged(tmp_path, caplog):
    save_hf_checkpoint({**TINY, **CASES["explicit_schedules"]}, tmp_path, seed=3)
    with caplog.at_level(logging.WARNING, logger="glm53.actors.config"):
        load_model(tmp_path, progress=False)
    logged = caplog.text
    for legacy in ("first_k_dense_replace", "kda_layers", "index_topk_freq"):
        assert legacy in logged
