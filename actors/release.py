"""The official GLM-5.3-Flash `config.json` (glm53-model.md §1.1-1.4) and the seed's EXL3 variant.

For what needs the real model's shapes without its weights: the memory plan (memory_plan.py,
`glm53 plan-memory --release`), its tests, and the rank-0 benchmark, which builds the real
layout on one GPU with random weights. Values are the pinned release's ([ckpt] in the doc);
the real file's `quantization_config.modules_to_not_convert` (1509 names) is left out: the
engine never reads it (the checkpoint's `weight_scale_inv` tensors say which weights are FP8).
"""

from __future__ import annotations

from typing import Any

from .tiny import exl3_quantization_config

NUM_LAYERS = 45
EOS_TOKEN_IDS = [154820, 154827, 154829]  # end of text and two turn markers
PAD_TOKEN_ID = 154820


def _text_config() -> dict[str, Any]:
    """`text_config` (§1.2): 34 KDA + 11 DSA layers (DSA iff i % 4 == 3), 3 dense + 42 MoE."""
    layer_types = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                   for i in range(NUM_LAYERS)]
    return {
        "model_type": "glm5_next_text",
        "dtype": "bfloat16",
        "vocab_size": 154880,
        "hidden_size": 4096,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": layer_types,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (NUM_LAYERS - 3),
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
        "pad_token_id": PAD_TOKEN_ID,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def _vision_config() -> dict[str, Any]:
    """`vision_config` (§1.4); the engine serves the language tower only."""
    return {
        "model_type": "glm5_next_vision", "depth": 24, "hidden_size": 1024, "num_heads": 16,
        "intermediate_size": 4096, "image_size": 448, "patch_size": 14,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
        "projection_intermediate_size": 10240, "in_channels": 3, "attention_bias": True,
        "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
    }


def release_config() -> dict[str, Any]:
    """The official (block-FP8) release's `config.json` as a dict (a fresh copy per call)."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": 154854,
        "video_token_id": 154855,
        "image_start_token_id": 154830,
        "image_end_token_id": 154831,
        "video_start_token_id": 154832,
        "video_end_token_id": 154833,
        "eos_token_id": list(EOS_TOKEN_IDS),
        "pad_token_id": PAD_TOKEN_ID,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "text_config": _text_config(),
        "vision_config": _vision_config(),
    }


def exl3_release_config() -> dict[str, Any]:
    """The seed's EXL3 K4 checkpoint (exl3-dflash-spec.md §A.3): the release with routed experts
    as 4-bit MCG trellis codes, every other tensor as released."""
    return {**release_config(), "quantization_config": exl3_quantization_config()}


DFLASH2_RELEASE = "incoai/GLM-5.3-Flash-DFlash2"


def dflash2_release_config() -> dict[str, Any]:
    """The published DFlash2 drafter's `config.json` (`incoai/GLM-5.3-Flash-DFlash2`,
    exl3-dflash-spec.md §C.2): 5 sliding-window layers (window 2048) of hidden 4096, 8 KV
    heads of 128, block 8 (7 drafts), taps of target layers 5, 14, 24, 33, 42; bf16,
    1,171,080,448 parameters."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1048576,
        "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "is_causal": False,
        "num_target_layers": NUM_LAYERS, "vocab_size": 154880, "torch_dtype": "bfloat16",
        "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": PAD_TOKEN_ID,
        "tie_word_embeddings": False,
        "dflash_config": {"block_size": 8, "mask_token_id": 154856,
                          "target_layer_ids": [5, 14, 24, 33, 42], "conv_kernel_size": 2,
                          "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    }
