"""ModelConfig: the GLM-5.3-Flash (`glm5_next`) text-tower configuration, read from `config.json`.

Accepts the release style (nested `text_config`, `linear_attn_config`, `layer_types` with
`deepseek_sparse_attention`, `mlp_layer_types`/`first_k_dense_replace`, `hc_*`, MTP fields,
`quantization_config`), the flat text-only style, and what transformers' `save_pretrained`
writes. The layer schedules follow the reference (transformers' Glm5Next): `layer_types`,
`mlp_layer_types` and `indexer_types` decide; legacy fields (`first_k_dense_replace`, the index
lists of `linear_attn_config`, the indexer pattern/frequency) count only where those lists are
absent, and a disagreement is logged. Values the engine does not implement raise
`UnsupportedConfigError` naming the field, instead of silently computing something else.
Derived values are properties; nothing is written back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

KDA = "kda"
DSA = "dsa"
DENSE = "dense"
MOE = "moe"

logger = logging.getLogger(__name__)

# the layer names transformers' Glm5Next builds: its own two, `full_attention` (which it maps to
# `indexed_attention`) and the legacy names its config remaps to them
_ATTN_TYPES = {
    "linear_attention": KDA,
    "mamba": KDA,
    "indexed_attention": DSA,
    "full_attention": DSA,
    "deepseek_sparse_attention": DSA,
    "qwen_sparse_attention": DSA,
}
_MLP_TYPES = {"dense": DENSE, "sparse": MOE}


class UnsupportedConfigError(ValueError):
    """A config value this engine cannot serve faithfully."""


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` (transformers' Glm5NextVisionConfig): the ViT, its patch merger and the
    projector into the text hidden size."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    projection_intermediate_size: int
    rms_norm_eps: float
    swiglu_limit: float
    rope_theta: float
    attention_bias: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, v: dict[str, Any]) -> VisionConfig:
        def get(key: str, default: Any) -> Any:
            value = v.get(key, default)
            return default if value is None else value

        _require(get("hidden_act", "silu") == "silu", "vision_config.hidden_act",
                 v.get("hidden_act"), "only silu is implemented")
        rope = get("rope_parameters", {})
        _require(rope.get("rope_type", "axial") == "axial", "vision_config.rope_parameters",
                 rope, "only the axial 2-D rope is implemented")
        sizes = {key: get(key, default) for key, default in (
            ("patch_size", 14), ("temporal_patch_size", 2))}
        for key, value in sizes.items():
            _require(isinstance(value, int), f"vision_config.{key}", value,
                     "a single integer (square patches)")
        hidden, heads = int(get("hidden_size", 1024)), int(get("num_heads", 16))
        _require(hidden % heads == 0 and (hidden // heads) % 4 == 0, "vision_config.num_heads",
                 heads, "the head dim must be a multiple of 4 (2-D rope over h and w)")
        return cls(
            depth=int(get("depth", 24)), hidden_size=hidden, num_heads=heads,
            intermediate_size=int(get("intermediate_size", 4096)),
            patch_size=sizes["patch_size"], temporal_patch_size=sizes["temporal_patch_size"],
            spatial_merge_size=int(get("spatial_merge_size", 2)),
            in_channels=int(get("in_channels", 3)),
            out_hidden_size=int(get("out_hidden_size", 1536)),
            projection_intermediate_size=int(get("projection_intermediate_size", 10240)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            attention_bias=bool(get("attention_bias", True)),
        )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA | DSA per trunk layer
    mlp_layer_types: tuple[str, ...]  # DENSE | MOE per trunk layer
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel: int
    linear_lower_bound: float | None  # None: softplus gate instead of the bounded sigmoid gate
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    vision: VisionConfig | None = None  # the checkpoint's vision tower (None: text-only)
    image_token_id: int = 154854  # the image placeholder (one per merged patch)
    fp8_block_size: tuple[int, int] | None = None  # official FP8 release: (128, 128) block scales
    # how the routed experts are held on the device: "dense" (the model dtype), "exl3" (the
    # checkpoint's EXL3 trellis codes, `exl3_bits` per weight, `exl3_codebook` 0 3INST / 1 MCG /
    # 2 MUL1) or "int4" (quantised while loading a dense or FP8 checkpoint)
    expert_format: str = "dense"
    exl3_bits: int = 0
    exl3_codebook: int = 0

    # ----- derived -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == DSA)

    @property
    def linear_dim(self) -> int:
        """Width of each of the KDA q, k, v projections (heads x head_dim)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def index_pool_budget(self) -> int:
        """Number of complete pools the indexer keeps per query (index_topk / index_kpool)."""
        return self.index_topk // self.index_kpool

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def mtp_layer_id(self) -> int:
        """Checkpoint layer index of the MTP layer (it sits on top of the trunk)."""
        return self.num_hidden_layers

    # ----- construction -----
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a `config.json` dict (release nested style or flat text-only style)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        text = config.get("text_config")
        if text is None:
            text = config  # flat style: text fields at the top level
        elif not isinstance(text, dict):
            raise UnsupportedConfigError("text_config must be an object")
        merged = {**text}
        for key in ("eos_token_id", "pad_token_id", "quantization_config", "dtype", "torch_dtype"):
            if key not in merged and key in config:
                merged[key] = config[key]
        vision = config.get("vision_config")
        if vision is not None and not isinstance(vision, dict):
            raise UnsupportedConfigError("vision_config must be an object")
        return cls._from_text(
            merged, vision=None if vision is None else VisionConfig.from_hf(vision),
            image_token_id=int(config.get("image_token_id", 154854)))

    @classmethod
    def _from_text(cls, t: dict[str, Any], vision: VisionConfig | None,
                   image_token_id: int) -> ModelConfig:
        def get(key: str, default: Any) -> Any:
            value = t.get(key, default)
            return default if value is None else value

        _require(get("qk_rope_head_dim", 0) == 0, "qk_rope_head_dim", t.get("qk_rope_head_dim"),
                 "GLM-5.3-Flash attention is NoPE; a rope dimension > 0 is not supported")
        n_heads = int(get("num_attention_heads", 64))
        _require(get("num_key_value_heads", n_heads) == n_heads, "num_key_value_heads",
                 t.get("num_key_value_heads"), "must equal num_attention_heads (MLA)")
        _require(get("scoring_func", "sigmoid") == "sigmoid", "scoring_func", t.get("scoring_func"),
                 "only sigmoid routing is implemented")
        _require(get("topk_method", "noaux_tc") == "noaux_tc", "topk_method", t.get("topk_method"),
                 "only noaux_tc routing is implemented")
        _require(get("n_group", 1) == 1 and get("topk_group", 1) == 1, "n_group/topk_group",
                 (t.get("n_group"), t.get("topk_group")), "grouped routing is not implemented")
        _require(get("hidden_act", "silu") == "silu", "hidden_act", t.get("hidden_act"),
                 "only silu is implemented")
        _require(get("index_kpool_always_select_tail", True) is True,
                 "index_kpool_always_select_tail", t.get("index_kpool_always_select_tail"),
                 "the open pool is always attended")
        _require(get("index_kpool_compress", True) is True, "index_kpool_compress",
                 t.get("index_kpool_compress"), "only softmax-weighted pooling is implemented")
        _require(get("mhc", True) is True, "mhc", t.get("mhc"),
                 "only the mHC residual is implemented")
        _require(get("attention_bias", False) is False, "attention_bias", t.get("attention_bias"),
                 "attention projections have no bias")
        _require(get("mla_use_nope", True) is True, "mla_use_nope", t.get("mla_use_nope"),
                 "attention is NoPE")

        num_layers = int(get("num_hidden_layers", 45))
        layer_types = _layer_types(t, num_layers)
        mlp_types = _mlp_layer_types(t, num_layers)
        _check_indexers(t, layer_types)

        linear = t.get("linear_attn_config") or {}
        lower_bound = linear.get("gate_lower_bound", t.get("linear_lower_bound", -5.0))
        if lower_bound is None and linear.get("safe_gate", True) and "linear_attn_config" in t:
            lower_bound = -5.0  # same default rule as the reference implementation

        index_topk = int(get("index_topk", 2048))
        index_kpool = int(get("index_kpool", 16))  # transformers' default; the release sets 4
        _require(index_kpool >= 1 and index_topk % index_kpool == 0, "index_topk/index_kpool",
                 (index_topk, index_kpool), "index_topk must be a positive multiple of index_kpool")
        n_experts = int(get("n_routed_experts", get("num_local_experts", 288)))
        top_k = int(get("num_experts_per_tok", 8))
        _require(0 < top_k <= n_experts, "num_experts_per_tok", top_k,
                 "must be in 1..n_routed_experts")

        eos = t.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = str(t.get("dtype") or t.get("torch_dtype") or "bfloat16")
        _require(dtype in ("bfloat16", "float16", "float32"), "dtype", dtype,
                 "expected bfloat16, float16 or float32")

        return cls(
            vocab_size=int(get("vocab_size", 154880)),
            hidden_size=int(get("hidden_size", 4096)),
            intermediate_size=int(get("intermediate_size", 12288)),
            moe_intermediate_size=int(get("moe_intermediate_size", 2048)),
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            num_attention_heads=n_heads,
            q_lora_rank=int(get("q_lora_rank", 1536)),
            kv_lora_rank=int(get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", 256)),
            v_head_dim=int(get("v_head_dim", 256)),
            index_n_heads=int(get("index_n_heads", 32)),
            index_head_dim=int(get("index_head_dim", 128)),
            index_topk=index_topk,
            index_kpool=index_kpool,
            linear_num_heads=int(linear.get("num_heads", get("linear_num_heads", 64))),
            linear_head_dim=int(linear.get("head_dim", get("linear_head_dim", 128))),
            linear_conv_kernel=int(
                linear.get("short_conv_kernel_size", get("linear_conv_kernel_dim", 4))),
            linear_lower_bound=None if lower_bound is None else float(lower_bound),
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=int(get("n_shared_experts", 1)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            hc_mult=int(get("hc_mult", 4)),
            hc_eps=float(get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(get("max_position_embeddings", 1048576)),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers", 0)),
            dtype=dtype,
            eos_token_ids=eos_ids,
            pad_token_id=t.get("pad_token_id"),
            vision=vision,
            image_token_id=image_token_id,
            **_quantization(t.get("quantization_config")),
        )


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise UnsupportedConfigError(f"unsupported config value {name}={value!r}: {why}")


def _layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    names = t.get("layer_types")
    listed = None if names is None else _checked_types(
        "layer_types", names, _ATTN_TYPES, num_layers)
    default = tuple(DSA if i % 4 == 3 else KDA for i in range(num_layers))
    return _schedule("layer_types", listed, "linear_attn_config.kda_layers/full_attn_layers",
                     _legacy_layer_types(t, num_layers), default)


def _mlp_layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    names = t.get("mlp_layer_types")
    listed = None if names is None else _checked_types(
        "mlp_layer_types", names, _MLP_TYPES, num_layers)
    first_dense = t.get("first_k_dense_replace")
    legacy = None if first_dense is None else _first_dense(int(first_dense), num_layers)
    return _schedule("mlp_layer_types", listed, "first_k_dense_replace", legacy,
                     _first_dense(3, num_layers))


def _first_dense(n: int, num_layers: int) -> tuple[str, ...]:
    return tuple(DENSE if i < n else MOE for i in range(num_layers))


def _checked_types(name: str, names: list[str], known: dict[str, str],
                   num_layers: int) -> tuple[str, ...]:
    """The per-layer list mapped to our kinds; refused where transformers cannot build it."""
    if len(names) != num_layers:
        raise UnsupportedConfigError(
            f"{name} has {len(names)} entries for num_hidden_layers={num_layers}")
    unknown = sorted({n for n in names if n not in known})
    if unknown:
        raise UnsupportedConfigError(f"unknown {name} {unknown}; known: {sorted(known)}")
    return tuple(known[n] for n in names)


def _schedule(name: str, listed: tuple[str, ...] | None, legacy_name: str,
              legacy: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """transformers' precedence: the per-layer list decides; a legacy field only stands in for
    a missing list (the reference then builds `default` instead, so that is said too)."""
    if listed is not None:
        if legacy is not None and legacy != listed:
            logger.warning("%s disagrees with %s; using %s, as transformers does",
                           name, legacy_name, name)
        return listed
    if legacy is not None:
        if legacy != default:
            logger.warning("no %s: the layers follow %s, where transformers would build its "
                           "default schedule", name, legacy_name)
        return legacy
    return default


def _legacy_layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...] | None:
    """The schedule of `linear_attn_config`'s 0-based `kda_layers`/`full_attn_layers`; None
    where they are absent or do not split the layers in two (e.g. 1-based lists)."""
    linear = t.get("linear_attn_config") or {}
    kda, full = linear.get("kda_layers"), linear.get("full_attn_layers")
    if kda is None and full is None:
        return None
    every = set(range(num_layers))
    kda = every - set(full) if kda is None else set(kda)
    full = every - kda if full is None else set(full)
    if kda & full or kda | full != every:
        logger.warning("linear_attn_config.kda_layers/full_attn_layers ignored: they are not a "
                       "0-based split of the %d layers", num_layers)
        return None
    return tuple(DSA if i in full else KDA for i in range(num_layers))


def _check_indexers(t: dict[str, Any], layer_types: tuple[str, ...]) -> None:
    """Every DSA layer must run its own indexer: the engine has no shared-indexer path.
    `indexer_types` decides, as in the reference; the pattern/frequency fields only without it."""
    derived = _derived_indexer_types(t, len(layer_types))
    listed = t.get("indexer_types")
    if listed is None:
        listed = derived or ["full"] * len(layer_types)
    elif derived is not None and list(derived) != list(listed):
        logger.warning("indexer_types disagrees with index_topk_pattern/index_topk_freq; using "
                       "indexer_types, as transformers does")
    if len(listed) < len(layer_types):
        raise UnsupportedConfigError(
            f"indexer_types has {len(listed)} entries for {len(layer_types)} layers")
    shared = [i for i, kind in enumerate(layer_types) if kind == DSA and listed[i] == "shared"]
    if shared:
        raise UnsupportedConfigError(
            f"indexer_types: DSA layers {shared} reuse a previous layer's selection ('shared'); "
            "only 'full' (every DSA layer runs its indexer) is implemented")


def _derived_indexer_types(t: dict[str, Any], num_layers: int) -> list[str] | None:
    """Glm5NextTextConfig's schedule from `index_topk_pattern` ("FS..." or a list) or
    `index_topk_freq`/`index_skip_topk_offset`; None where none of them is set."""
    pattern = t.get("index_topk_pattern")
    if isinstance(pattern, str):
        if set(pattern) - {"F", "S"}:
            raise UnsupportedConfigError(
                f"index_topk_pattern={pattern!r}: one letter per layer, F (full) or S (shared)")
        return ["full" if c == "F" else "shared" for c in pattern]
    if pattern is not None:
        return list(pattern)
    freq, offset = t.get("index_topk_freq"), t.get("index_skip_topk_offset")
    if freq is None and offset is None:
        return None
    freq = max(int(freq or 1), 1)
    offset = 2 if offset is None else int(offset)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
            for i in range(num_layers)]


EXPERT_FORMATS = ("dense", "exl3", "int4")
EXL3_CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
# the one scope our EXL3 path implements: routed experts quantised, everything else as released
EXL3_SCOPE = "glm53_routed_experts_only"


def _quantization(quant: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig fields for a `quantization_config` (block FP8 or EXL3 routed experts)."""
    if not quant:
        return {}
    method = quant.get("quant_method")
    if method == "fp8":
        return {"fp8_block_size": _fp8_block_size(quant)}
    if method == "exl3":
        return _exl3(quant)
    raise UnsupportedConfigError(
        f"quantization_config.quant_method={method!r}: only fp8 and exl3")


def _exl3(quant: dict[str, Any]) -> dict[str, Any]:
    scope = quant.get("scope", EXL3_SCOPE)
    if scope != EXL3_SCOPE:
        raise UnsupportedConfigError(
            f"quantization_config.scope={scope!r}: only {EXL3_SCOPE!r} (routed experts in EXL3, "
            "every other tensor as released)")
    bits = quant.get("bits")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise UnsupportedConfigError(
            f"quantization_config.bits={bits!r}: EXL3 needs an integer 1..8 bits per weight")
    codebook = quant.get("codebook", "mcg")
    if codebook not in EXL3_CODEBOOKS:
        raise UnsupportedConfigError(
            f"quantization_config.codebook={codebook!r}: one of {sorted(EXL3_CODEBOOKS)}")
    return {"expert_format": "exl3", "exl3_bits": bits,
            "exl3_codebook": EXL3_CODEBOOKS[codebook]}


def _fp8_block_size(quant: dict[str, Any]) -> tuple[int, int]:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedConfigError(f"quantization_config.fmt={fmt!r}: only e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedConfigError("quantization_config.activation_scheme: only dynamic")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedConfigError(
            f"quantization_config.weight_block_size={block!r}: block-scaled fp8 needs [rows, cols]")
    return int(block[0]), int(block[1])
