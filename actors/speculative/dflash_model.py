"""The DFlash2 draft model (`DFlash2DraftModel`, Qwen3-style layers): config, modules, loading.

No embedding or head of its own: block tokens use the target's embed_tokens, draft logits its
lm_head. Target tap states -> fc -> hidden_norm give one context vector per committed position;
every layer projects those into its keys/values ("KV injection"). Block rows attend all block
rows (bidirectional) and the context within a backward window. Each sublayer is wrapped in a
grouped dynamic causal conv over the block rows. A candidate selector (top-k of the head's
logits re-ranked with low-rank transition codebooks) picks the draft path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from glm53.kernels import ops

from ..layers.linear import Linear
from ..layers.norm import RMSNorm


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    vocab_size: int

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_hf(cls, raw: dict) -> DFlashConfig:
        """From a draft checkpoint's `config.json` dict (release.dflash2_release_config)."""
        d = raw["dflash_config"]
        if raw.get("is_causal", False):
            raise ValueError("DFlash2 drafts attend their block bidirectionally (is_causal false)")
        if d.get("conv_kernel_size", 2) != 2:
            raise ValueError("only 2-tap dynamic convs are implemented")
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
            num_kv_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 1e4),
            sliding_window=raw.get("sliding_window", 2048), block_size=d["block_size"],
            mask_token_id=d["mask_token_id"], target_layer_ids=tuple(d["target_layer_ids"]),
            conv_group_size=d.get("conv_group_size", 16),
            selector_rank=d.get("selector_rank", 0), selector_top_k=d.get("selector_top_k", 16),
            vocab_size=raw["vocab_size"])


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the last dim. x: [..., T, heads, hd]; positions: [..., T]."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = positions.float().unsqueeze(-1) * inv  # [..., T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).unsqueeze(-2), torch.cat([ang.sin()] * 2,
                                                                      -1).unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class DynamicConv(nn.Module):
    """Grouped 2-tap causal conv over block rows with per-row kernels: for stage s (0 = before
    the sublayer, 1 = after), row t: sum_tap (base[s, tap, c] + dyn[s, tap, t, c // G]) *
    z[t - tap], with z[-1] = 0."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.groups = cfg.hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, 2, cfg.hidden_size))
        self.kernel_projection = Linear(cfg.hidden_size, 2 * 2 * self.groups)
        self.group_size = cfg.conv_group_size

    def kernels(self, u: torch.Tensor) -> torch.Tensor:
        """u: [N, B, H] -> per-row taps [2 stages, 2 taps, N, B, H]."""
        n, b, _ = u.shape
        dyn = self.kernel_projection(u).view(n, b, 2, 2, self.groups).permute(2, 3, 0, 1, 4)
        dyn = dyn.repeat_interleave(self.group_size, dim=-1)
        return self.base_kernel[:, :, None, None, :] + dyn

    @staticmethod
    def apply(z: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """z: [N, B, H]; taps: [2, N, B, H] (this stage's)."""
        shifted = F.pad(z, (0, 0, 1, 0))[:, :-1]
        return taps[0] * z + taps[1] * shifted


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = Linear(h, cfg.num_heads * hd)
        self.self_attn.k_proj = Linear(h, cfg.num_kv_heads * hd)
        self.self_attn.v_proj = Linear(h, cfg.num_kv_heads * hd)
        self.self_attn.o_proj = Linear(cfg.num_heads * hd, h)
        self.self_attn.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = Linear(h, cfg.intermediate_size)
        self.mlp.up_proj = Linear(h, cfg.intermediate_size)
        self.mlp.down_proj = Linear(cfg.intermediate_size, h)
        self.attention_conv = DynamicConv(cfg)
        self.mlp_conv = DynamicConv(cfg)

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context features c [T, H] at positions [T]: [T, kv_heads, hd] each."""
        a, cfg = self.self_attn, self.cfg
        k = a.k_norm(a.k_proj(c).view(-1, cfg.num_kv_heads, cfg.head_dim))
        return rope(k, positions, cfg.rope_theta), a.v_proj(c).view(-1, cfg.num_kv_heads,
                                                                     cfg.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """x: [N, B, H] block rows at positions [N, B]; ctx_k/v: [N, W, kv, hd] with ctx_mask
        [N, B, W] (True = visible). Returns [N, B, H]."""
        a, cfg = self.self_attn, self.cfg
        n, b, _ = x.shape
        u = self.input_layernorm(x)
        taps = self.attention_conv.kernels(u)
        z = DynamicConv.apply(u, taps[0])
        q = rope(a.q_norm(a.q_proj(z).view(n, b, cfg.num_heads, cfg.head_dim)), positions,
                 cfg.rope_theta)
        bk = rope(a.k_norm(a.k_proj(z).view(n, b, cfg.num_kv_heads, cfg.head_dim)), positions,
                  cfg.rope_theta)
        bv = a.v_proj(z).view(n, b, cfg.num_kv_heads, cfg.head_dim)
        k = torch.cat([ctx_k, bk], dim=1).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 2)
        v = torch.cat([ctx_v, bv], dim=1).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 2)
        visible = torch.cat([ctx_mask, torch.ones(n, b, b, dtype=torch.bool, device=x.device)],
                            dim=-1)
        scores = torch.einsum("nbhd,nkhd->nhbk", q.float(), k.float()) / math.sqrt(cfg.head_dim)
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        o = torch.einsum("nhbk,nkhd->nbhd", torch.softmax(scores, -1), v.float()).to(x.dtype)
        x = x + DynamicConv.apply(a.o_proj(o.reshape(n, b, -1)), taps[1])
        u = self.post_attention_layernorm(x)
        taps = self.mlp_conv.kernels(u)
        z = DynamicConv.apply(u, taps[0])
        m = self.mlp.down_proj(ops.swiglu(self.mlp.gate_proj(z), self.mlp.up_proj(z), 1e30))
        return x + DynamicConv.apply(m, taps[1])


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.hidden_projection = Linear(cfg.hidden_size, cfg.selector_rank)
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.top_k = cfg.selector_top_k

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        """hidden: [N, R, H] final normed draft rows; logits: [N, R, V]; anchor: [N].
        Greedy walk: score_j = logprob_j + sum_k A[prev, k] g[k] B[cand_j, k]. Returns [N, R]."""
        unary, cand = torch.log_softmax(logits.float(), -1).topk(self.top_k, dim=-1)
        g = self.hidden_projection(hidden).float()
        prev = anchor
        out = []
        for r in range(hidden.shape[1]):
            a = self.predecessor_codebook[prev].float() * g[:, r]  # [N, rank]
            pair = torch.einsum("nk,njk->nj", a, self.successor_codebook[cand[:, r]].float())
            # stable argmax: ties resolve to the first (smaller-id-first within equal scores)
            prev = cand[:, r].gather(1, (unary[:, r] + pair).argmax(-1, keepdim=True))[:, 0]
            out.append(prev)
        return torch.stack(out, dim=1)


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.selector_rank else None

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Target tap states [T, n_taps * H] -> context features [T, H]."""
        return self.hidden_norm(self.fc(taps))


def draft_weight_bytes(cfg: DFlashConfig, dtype: torch.dtype) -> int:
    """Parameter bytes of the draft as `load_draft` allocates it (every tensor in `dtype`; the
    draft is replicated on every rank). Built on the meta device: no memory is used. GLM's
    DFlash2 in bf16: 1,171,080,448 parameters = 2.18 GiB."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = DFlashDraftModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_draft(path: str | Path, dtype: torch.dtype, device: torch.device | str
               ) -> DFlashDraftModel:
    """Strictly load a HF-layout DFlash2 draft checkpoint (single safetensors file)."""
    cfg = DFlashConfig.from_dir(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDraftModel(cfg).requires_grad_(False).eval()
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    files = sorted(Path(path).glob("*.safetensors"))
    seen = set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in the draft checkpoint")
                t = st.get_tensor(name)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise ValueError(f"draft tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(params[name].shape)}")
                params[name].data.copy_(t.to(params[name].dtype))
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in the draft checkpoint")
    return model
