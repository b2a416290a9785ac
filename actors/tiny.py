"""Tiny random GLM-5.3-Flash checkpoints in the release layout (for tests and `make serve`).

`tiny_text_config` gives release-style text fields at toy sizes; `write_tiny_checkpoint` builds
our model, fills it with seeded random values that are non-degenerate where the reference
initialiser uses constants (router bias, pooling gate/ape, hc base/scale, norms, A_log), and
writes `config.json`, `generation_config.json` and `model.safetensors` with checkpoint names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .loader import build_model
from .models.glm5_next import Glm5NextForCausalLM
from .weights import export_checkpoint


def tiny_text_config(num_layers: int = 5, mtp: bool = False, **overrides: Any) -> dict[str, Any]:
    """Release-style `text_config` at toy sizes (DSA iff layer % 4 == 3, first layer dense)."""
    layer_types = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                   for i in range(num_layers)]
    first_dense = overrides.pop("first_k_dense_replace", 1)
    text: dict[str, Any] = {
        "model_type": "glm5_next_text",
        "vocab_size": 272,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "layer_types": layer_types,
        "first_k_dense_replace": first_dense,
        "mlp_layer_types": ["dense" if i < first_dense else "sparse" for i in range(num_layers)],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 0,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 16,
        "index_kpool": 4,
        "index_kpool_compress": True,
        "index_kpool_always_select_tail": True,
        "index_share_for_mtp_iteration": True,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i for i, t in enumerate(layer_types) if t != "linear_attention"],
        },
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
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
        "mhc": True,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    text.update(overrides)
    return text


# a toy vision tower: transformers always builds one, so its oracle stays small; our engine
# serves language-only (out_hidden_size is the text model's hidden size)
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
    "intermediate_size": 64, "projection_intermediate_size": 64,
}


def placeholder_token_ids(vocab_size: int) -> dict[str, int]:
    """Image and video placeholder ids of a tiny config: they must lie inside the vocabulary;
    the top ids are unused by the tiny tokenizer."""
    names = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
             "video_start_token_id", "video_end_token_id")
    return {name: vocab_size - 1 - i for i, name in enumerate(names)}


def release_config(text: dict[str, Any], eos_token_ids: list[int], pad_token_id: int,
                   ) -> dict[str, Any]:
    """Wrap a text config into the release `config.json` (with a toy vision config so a
    transformers oracle builds a small tower; our engine serves language-only)."""
    text = {**text, "eos_token_id": eos_token_ids, "pad_token_id": pad_token_id}
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "vision_config": {**TINY_VISION_CONFIG, "out_hidden_size": text["hidden_size"]},
        **placeholder_token_ids(text["vocab_size"]),
        "tie_word_embeddings": False,
        "dtype": text["dtype"],
        "eos_token_id": eos_token_ids,
        "pad_token_id": pad_token_id,
    }


@torch.no_grad()
def randomize(model: Glm5NextForCausalLM, seed: int) -> None:
    """Seeded values with unit-scale activations and no constant-initialised parameters, drawn
    on the parameters' device (the rank-0 emulation fills ~85 GB on its GPU this way)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, device=device) * std + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith(("_trellis", "_suh", "_svh")):
            _randomize_exl3(p, leaf, gen)
        elif leaf.endswith(("_q", "_scale", "_zero")) and ".experts." in name:
            fan_in = model.config.hidden_size if leaf.startswith("w13") else (
                model.config.moe_intermediate_size)
            _randomize_int4(p, leaf, gen, fan_in)
        elif p.ndim == 1 and (leaf == "weight" or name.endswith("scale")):
            normal(p, 0.1, 1.0)  # norm weights, hc scale: around 1
        elif leaf in ("bias", "base", "e_score_correction_bias", "dt_bias", "A_log"):
            normal(p, 0.3)
        elif leaf in ("conv_weight", "index_kpool_compress_ape"):
            normal(p, 0.5)
        elif name == "embed_tokens.weight":
            normal(p, 1.0)
        else:  # matrices (and stacked experts): fan-in scaling keeps activations O(1)
            normal(p, 1.0 / math.sqrt(p.shape[-1]))


EXL3_CODEBOOK_STD = 1.2441  # std of the MCG codebook over all states (exl3-dflash-spec §B.5)


def _randomize_exl3(p: torch.Tensor, leaf: str, gen: torch.Generator) -> None:
    """Random EXL3 codes (every int16 pattern is a valid trellis) and +-1 sign vectors with
    scales that give the decoded weights a 1/sqrt(fan-in) spread, as for dense matrices."""
    dev = gen.device
    if leaf.endswith("_trellis"):
        p.copy_(torch.randint(-2**15, 2**15, p.shape, generator=gen, dtype=torch.int32,
                              device=dev))
        return
    signs = torch.randint(0, 2, p.shape, generator=gen, device=dev) * 2 - 1
    magnitude = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=dev)
    if leaf.endswith("_suh"):  # input side: carries the codebook's and fan-in's scale
        fan_in = p.shape[-1] // 2 if leaf == "w13_suh" else p.shape[-1]
        magnitude = magnitude / (EXL3_CODEBOOK_STD * math.sqrt(fan_in))
    p.copy_(signs * magnitude)


def _randomize_int4(p: torch.Tensor, leaf: str, gen: torch.Generator, fan_in: int) -> None:
    """Random 4-bit codes with group scales giving a 1/sqrt(fan-in) spread: uniform codes
    0..15 have std 4.61, centred by a zero point of -7.5 scales."""
    dev = gen.device
    if leaf.endswith("_q"):
        p.copy_(torch.randint(0, 256, p.shape, generator=gen, dtype=torch.int32, device=dev))
        return
    scale = (1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=dev)) / (
        4.61 * math.sqrt(fan_in))
    p.copy_(scale if leaf.endswith("_scale") else -7.5 * scale)


def exl3_quantization_config(bits: int = 4, codebook: str = "mcg") -> dict[str, Any]:
    """The seed checkpoint's `quantization_config` (exl3-dflash-spec §A.3)."""
    return {"quant_method": "exl3", "version": "0.0.43", "bits": bits, "codebook": codebook,
            "scope": "glm53_routed_experts_only",
            "non_routed_dtype_policy": "official_source_native"}


def write_tiny_checkpoint(out_dir: str | Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Build, randomise and save a model for `config` (a release-style config.json dict)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config)
    model = build_model(cfg, with_mtp=cfg.has_mtp)
    randomize(model, seed)
    tensors = export_checkpoint(model)  # fp32-by-design parameters stay fp32 in the file
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
                  "do_sample": True, "temperature": 1.0, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def write_tiny_draft(out_dir: str | Path, target: ModelConfig, seed: int = 0,
                     block_size: int = 8) -> Path:
    """A tiny DFlash2 draft checkpoint (HF layout) matching `target`'s hidden size and
    vocabulary: 2 layers, a 16-token sliding window (so tests cross it), block_size drafts."""
    from .speculative.dflash_model import DFlashConfig, DFlashDraftModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    taps = [i for i in (1, target.num_hidden_layers - 2) if i < target.num_hidden_layers]
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "intermediate_size": 2 * target.hidden_size,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "layer_types": ["sliding_attention"] * 2, "sliding_window": 16, "is_causal": False,
        "num_target_layers": target.num_hidden_layers, "vocab_size": target.vocab_size,
        "tie_word_embeddings": False, "dtype": "float32",
        "dflash_config": {"block_size": block_size, "mask_token_id": target.vocab_size - 1,
                          "target_layer_ids": taps, "conv_kernel_size": 2,
                          "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model = DFlashDraftModel(DFlashConfig.from_dir(out))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("base_kernel"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + torch.tensor([1.0, 0.0])
                        .view(1, 2, 1))  # near identity: tap 0 ~ 1, tap 1 ~ 0
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out
