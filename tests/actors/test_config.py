"""ModelConfig.from_hf on the GLM-5.3-Flash release config (glm53-model.md §1) and its variants."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import pytest

from glm53.actors import release
from glm53.actors.config import DENSE, DSA, KDA, MOE, ModelConfig, UnsupportedConfigError
from glm53.actors.release import EOS_TOKEN_IDS as EOS_IDS
from glm53.actors.release import NUM_LAYERS


def release_config() -> dict[str, Any]:
    """actors/release.py's config with the key the published file has and it leaves out."""
    raw = release.release_config()
    raw["quantization_config"]["modules_to_not_convert"] = ["lm_head",
                                                            "model.language_model.embed_tokens"]
    return raw


def release_text_config() -> dict[str, Any]:
    """`text_config` with the release values of glm53-model.md §1.2."""
    return release_config()["text_config"]


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
    assert from_flat == dataclasses.replace(from_nested, vision=None)


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


def _indexer_type(i: int, value: str):
    def apply(raw: dict[str, Any]) -> None:
        raw["text_config"]["indexer_types"] = ["full"] * NUM_LAYERS
        raw["text_config"]["indexer_types"][i] = value
    return apply


UNSUPPORTED = {
    "rope": (_set("text_config.qk_rope_head_dim", 64), "qk_rope_head_dim"),
    "gqa": (_set("text_config.num_key_value_heads", 8), "num_key_value_heads"),
    "softmax_routing": (_set("text_config.scoring_func", "softmax"), "scoring_func"),
    "grouped_routing": (_set("text_config.n_group", 8), "n_group"),
    "topk_method": (_set("text_config.topk_method", "greedy"), "topk_method"),
    "shared_indexer": (_indexer_type(7, "shared"), "indexer_types"),
    "shared_indexer_by_freq": (_set("text_config.index_topk_freq", 4), "indexer_types"),
    "shared_indexer_by_pattern": (_set("text_config.index_topk_pattern", "FFFS" * 11 + "F"),
                                  "indexer_types"),
    "indexer_pattern_letters": (_set("text_config.index_topk_pattern", "FX"),
                                "index_topk_pattern"),
    "topk_not_pool_multiple": (_set("text_config.index_topk", 2050), "index_topk"),
    # a type transformers accepts in a config but cannot run in Glm5Next
    "unknown_layer_type": (_layer_type(5, "sliding_attention"), "layer_types"),
    "layer_types_length": (_drop_last_layer_type, "layer_types"),
    "moe_mlp_type": (_mlp_type(3, "moe"), "mlp_layer_types"),  # transformers refuses it too
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


def test_listed_schedules_win_over_disagreeing_legacy_fields(caplog) -> None:
    """transformers builds from the lists and ignores the legacy fields: so do we, and say so."""
    raw = release_config()
    text = raw["text_config"]
    text["first_k_dense_replace"] = 1
    text["linear_attn_config"]["full_attn_layers"] = [0]
    text["linear_attn_config"]["kda_layers"] = list(range(1, NUM_LAYERS))
    text["indexer_types"] = ["full"] * NUM_LAYERS
    text["index_topk_freq"] = 4  # would make layer 3 share layer 1's selection
    with caplog.at_level(logging.WARNING, logger="glm53.actors.config"):
        cfg = ModelConfig.from_hf(raw)
    assert cfg == ModelConfig.from_hf(release_config())
    for legacy in ("first_k_dense_replace", "kda_layers", "index_topk_freq"):
        assert legacy in caplog.text


def test_legacy_layer_lists_stand_in_for_missing_layer_types(caplog) -> None:
    text = release_text_config()
    del text["layer_types"], text["mlp_layer_types"]
    text["num_hidden_layers"] = 6
    text["linear_attn_config"]["kda_layers"] = [0, 2, 3, 4]
    text["linear_attn_config"]["full_attn_layers"] = [1, 5]
    with caplog.at_level(logging.WARNING, logger="glm53.actors.config"):
        cfg = ModelConfig.from_hf({"text_config": text})
    assert cfg.dsa_layers == (1, 5)
    assert "default schedule" in caplog.text  # transformers would put DSA at layer 3


def test_one_based_layer_lists_are_ignored(caplog) -> None:
    text = release_text_config()
    del text["layer_types"], text["mlp_layer_types"]
    text["num_hidden_layers"] = 8
    text["linear_attn_config"]["kda_layers"] = [1, 2, 3, 5, 6, 7]
    text["linear_attn_config"]["full_attn_layers"] = [4, 8]
    with caplog.at_level(logging.WARNING, logger="glm53.actors.config"):
        cfg = ModelConfig.from_hf({"text_config": text})
    assert cfg.dsa_layers == (3, 7)  # transformers' default
    assert "ignored" in caplog.text


@pytest.mark.parametrize(("legacy", "ours"), [("mamba", KDA), ("deepseek_sparse_attention", DSA),
                                              ("qwen_sparse_attention", DSA),
                                              ("full_attention", DSA)])
def test_legacy_layer_type_names_map_as_in_transformers(legacy: str, ours: str) -> None:
    raw = release_config()
    raw["text_config"]["layer_types"][0] = legacy
    assert ModelConfig.from_hf(raw).layer_types[0] == ours


def test_absent_fields_take_transformers_defaults() -> None:
    """A field a config leaves out means what it means to transformers' Glm5NextTextConfig."""
    from transformers import Glm5NextTextConfig

    hf, ours = Glm5NextTextConfig(), ModelConfig.from_hf({})
    renamed = {"linear_conv_kernel": "linear_conv_kernel_dim"}
    # compared below as kinds / no effect on the logits / the serving dtype (HF: None = fp32)
    skipped = {"layer_types", "mlp_layer_types", "pad_token_id", "dtype"}
    checked = 0
    for f in dataclasses.fields(ModelConfig):
        name = renamed.get(f.name, f.name)
        if name in skipped or not hasattr(hf, name):
            continue
        assert getattr(ours, f.name) == getattr(hf, name), f.name
        checked += 1
    assert checked >= 28
    kinds = {"linear_attention": KDA, "indexed_attention": DSA, "dense": DENSE, "sparse": MOE}
    assert ours.layer_types == tuple(kinds[t] for t in hf.layer_types)
    assert ours.mlp_layer_types == tuple(kinds[t] for t in hf.mlp_layer_types)


def test_config_is_frozen() -> None:
    cfg = ModelConfig.from_hf(release_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert cfg.hidden_size == 4096
