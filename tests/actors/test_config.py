"""ModelConfig.from_hf on the GLM-5.3-Flash release config (glm53-model.md §1) and its variants."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from glm53.actors.config import DENSE, DSA, KDA, MOE, ModelConfig, UnsupportedConfigError

NUM_LAYERS = 45
EOS_IDS = [154820, 154827, 154829]


def release_text_config() -> dict[str, Any]:
    """`text_config` with the release values of glm53-model.md §1.2."""
    layer_types = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                   for i in range(NUM_LAYERS)]
    return {
        "model_type": "glm5_next_text",
        "dtype": "bfloat16",
        "vocab_size": 154880,
        "hidden_size": 4096,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
        "first_k_dense_replace": 3,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 288,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "moe_router_dtype": "float32",
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0,
        "v_head_dim": 256,
        "head_dim": 0,
        "mla_use_nope": True,
        "attention_bias": False,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_kpool": 4,
        "index_kpool_compress": True,
        "index_kpool_always_select_tail": True,
        "index_share_for_mtp_iteration": True,
        "indexer_rope_interleave": True,
        "linear_attn_config": {
            "num_heads": 64,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i for i, t in enumerate(layer_types) if t != "linear_attention"],
        },
        "mhc": True,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 154820,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def release_config() -> dict[str, Any]:
    """Release `config.json` (§1.1): nested text/vision configs, top-level fp8 quantization."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "tie_word_embeddings": False,
        "image_token_id": 154854,
        "video_token_id": 154855,
        "image_start_token_id": 154830,
        "image_end_token_id": 154831,
        "video_start_token_id": 154832,
        "video_end_token_id": 154833,
        "eos_token_id": list(EOS_IDS),
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens"],
        },
        "text_config": release_text_config(),
        "vision_config": {
            "model_type": "glm5_next_vision", "depth": 24, "hidden_size": 1024, "num_heads": 16,
            "intermediate_size": 4096, "image_size": 448, "patch_size": 14,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
            "projection_intermediate_size": 10240, "in_channels": 3,
        },
    }


def flat_config(nested: dict[str, Any]) -> dict[str, Any]:
    """The text-only flat style: text fields at the top level, no vision tower."""
    top = {k: v for k, v in nested.items() if k not in ("text_config", "vision_config")}
    return {**top, **nested["text_config"]}


def test_release_config_parses_to_the_documented_schedule() -> None:
    raw = release_config()
    cfg = ModelConfig.from_hf(raw)
    assert len(cfg.layer_types) == NUM_LAYERS
    assert len(cfg.kda_layers) == 34
    assert len(cfg.dsa_layers) == 11
    assert cfg.dsa_layers == tuple(range(3, NUM_LAYERS, 4))
    assert cfg.layer_types[44] == KDA
    # the 0-based index lists of linear_attn_config agree with the schedule from layer_types
    linear = raw["text_config"]["linear_attn_config"]
    assert cfg.kda_layers == tuple(linear["kda_layers"])
    assert cfg.dsa_layers == tuple(linear["full_attn_layers"])
    assert cfg.mlp_layer_types.count(DENSE) == 3
    assert cfg.mlp_layer_types.count(MOE) == 42
    assert cfg.mlp_layer_types[:3] == (DENSE,) * 3


def test_release_config_derived_values() -> None:
    cfg = ModelConfig.from_hf(release_config())
    assert cfg.index_pool_budget == 512
    assert cfg.has_mtp
    assert cfg.mtp_layer_id == 45
    assert cfg.linear_dim == 8192
    assert cfg.qk_head_dim == 256
    assert cfg.softmax_scale == pytest.approx(256**-0.5)
    assert cfg.linear_conv_kernel == 4
    assert cfg.linear_lower_bound == -5.0
    assert cfg.fp8_block_size == (128, 128)  # read from the top-level quantization_config
    assert cfg.eos_token_ids == tuple(EOS_IDS)  # forwarded from the top level
    assert isinstance(cfg.eos_token_ids, tuple)
    assert cfg.pad_token_id == 154820
    assert cfg.has_vision is True
    assert cfg.dtype == "bfloat16"
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps) == (4, 20, 1e-6)


def test_flat_style_equals_nested_style() -> None:
    nested = release_config()
    flat = flat_config(nested)
    assert "text_config" not in flat and "hidden_size" in flat
    from_nested = ModelConfig.from_hf(nested)
    from_flat = ModelConfig.from_hf(flat)
    assert from_flat.has_vision is False  # text-only
    assert from_flat == dataclasses.replace(from_nested, has_vision=False)


def test_nested_text_fields_win_over_top_level() -> None:
    raw = release_config()
    raw["text_config"]["eos_token_id"] = 7
    raw["text_config"]["dtype"] = "float32"
    raw["dtype"] = "bfloat16"
    cfg = ModelConfig.from_hf(raw)
    assert cfg.eos_token_ids == (7,)
    assert cfg.dtype == "float32"


@pytest.mark.parametrize("first_dense", [None, 0, 2])
def test_default_schedules_without_type_lists(first_dense: int | None) -> None:
    text = release_text_config()
    del text["layer_types"], text["mlp_layer_types"]
    text["num_hidden_layers"] = 10
    if first_dense is None:
        del text["first_k_dense_replace"]
    else:
        text["first_k_dense_replace"] = first_dense
    cfg = ModelConfig.from_hf({"text_config": text})
    assert cfg.layer_types == tuple(DSA if i % 4 == 3 else KDA for i in range(10))
    assert cfg.dsa_layers == (3, 7)
    n_dense = 3 if first_dense is None else first_dense
    assert cfg.mlp_layer_types == (DENSE,) * n_dense + (MOE,) * (10 - n_dense)


def _set(path: str, value: Any):
    """A mutation of the release config: set `path` (dot-separated, from the top level)."""
    def apply(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        node[leaf] = value
    return apply


def _layer_type(i: int, value: str):
    def apply(raw: dict[str, Any]) -> None:
        raw["text_config"]["layer_types"][i] = value
    return apply


def _drop_last_layer_type(raw: dict[str, Any]) -> None:
    raw["text_config"]["layer_types"].pop()


def _mlp_type(i: int, value: str):
    def apply(raw: dict[str, Any]) -> None:
        raw["text_config"]["mlp_layer_types"][i] = value
    return apply


UNSUPPORTED = {
    "rope": (_set("text_config.qk_rope_head_dim", 64), "qk_rope_head_dim"),
    "gqa": (_set("text_config.num_key_value_heads", 8), "num_key_value_heads"),
    "softmax_routing": (_set("text_config.scoring_func", "softmax"), "scoring_func"),
    "grouped_routing": (_set("text_config.n_group", 8), "n_group"),
    "topk_method": (_set("text_config.topk_method", "greedy"), "topk_method"),
    "shared_indexer": (_set("text_config.indexer_types", ["full", "shared"] * 5 + ["full"]),
                       "indexer_types"),
    "topk_not_pool_multiple": (_set("text_config.index_topk", 2050), "index_topk"),
    "unknown_layer_type": (_layer_type(5, "mamba"), "layer_types"),
    "layer_types_length": (_drop_last_layer_type, "layer_types"),
    "mlp_vs_first_k_dense": (_mlp_type(3, "dense"), "first_k_dense_replace"),
    "awq": (_set("quantization_config.quant_method", "awq"), "quant_method"),
    "fp8_e5m2": (_set("quantization_config.fmt", "e5m2"), "fmt"),
    "no_tail_pool": (_set("text_config.index_kpool_always_select_tail", False),
                     "index_kpool_always_select_tail"),
    "no_mhc": (_set("text_config.mhc", False), "mhc"),
    "rope_attention": (_set("text_config.mla_use_nope", False), "mla_use_nope"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_value_raises_naming_the_field(case: str) -> None:
    mutate, field = UNSUPPORTED[case]
    raw = release_config()
    ModelConfig.from_hf(copy.deepcopy(raw))  # the unmodified config is accepted
    mutate(raw)
    with pytest.raises(UnsupportedConfigError, match=field):
        ModelConfig.from_hf(raw)


def test_config_is_frozen() -> None:
    cfg = ModelConfig.from_hf(release_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert cfg.hidden_size == 4096
