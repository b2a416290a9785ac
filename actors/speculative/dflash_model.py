"""The DFlash2 draft model (`DFlash2DraftModel`, Qwen3-style layers): config, modules, loading.

No embedding or head of its own: block tokens use the target's embed_tokens, draft logits its
lm_head. Target tap states -> fc -> hidden_norm give one context vector per committed position;
every layer projects those into its keys/values ("KV injection"). Block rows attend all block
rows (bidirectional) and the context within a backward window. Each sublayer is wrapped in a
grouped dynamic causal conv over the block rows. A candidate selector (top-k of the head's
logits re-ranked with low-rank transition codebooks) picks the draft path.

Under TP the layers are sharded like the target's: query and KV heads, and the MLP's
intermediate, split across the ranks (column-parallel q/k/v, gate/up; row-parallel o_proj and
down_proj, each followed by the target's all-reduce), so each rank keeps only its KV heads'
context ring. fc, the norms, the convs and the selector are replicated; every rank computes the
same drafts.
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

from ..layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..parallel import ParallelState, split


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


def grouped_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                      ctx_mask: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor
                      ) -> torch.Tensor:
    """Block rows attend the visible context and the whole block, in fp32, each query head its
    group's KV head (K/V are never repeated to the query heads). q: [N, B, heads, hd];
    ctx_k/ctx_v: [N, W, kv, hd] values, or an fp8 ring's rows [N, W, kv, hd + 4] uint8
    (dflash.ring_row), with ctx_mask [N, B, W] (True = visible); blk_k/blk_v: [N, B, kv, hd].
    Returns [N, B, heads, hd] in q's dtype.

    Live at once besides the inputs (forward_bytes_per_sequence counts it): one fp32
    [N, kv, W, hd] copy of the context keys, later of its values, and two [N, heads, B, W + B]
    fp32 scores (the masked scores and their softmax); fp8 rows are dequantised in that copy,
    which needs only their fp32 scales [N, W, kv] besides."""
    n, b, heads, hd = q.shape
    kv, w = ctx_k.shape[2], ctx_k.shape[1]
    g = heads // kv
    # query rows of one KV head together: [N, kv, g * B, hd] (one batched matmul per KV head,
    # no broadcast that would expand K/V)
    qg = q.float().view(n, b, kv, g, hd).permute(0, 2, 3, 1, 4).reshape(n, kv, g * b, hd)

    def kv_major(t: torch.Tensor) -> torch.Tensor:  # [N, L, kv, hd] -> fp32 [N, kv, L, hd]
        # one explicit copy in any dtype (`to` would alias an fp32 view, and matmul then copy)
        m, length = t.shape[:2]
        out = torch.empty(m, kv, length, hd, dtype=torch.float32, device=t.device)
        if t.dtype != torch.uint8:
            return out.copy_(t.transpose(1, 2))
        # fp8 rows: the copy converts the e4m3 codes, then one fp32 scale per row (exact:
        # a power of two) multiplies in place, as kernels' unpack_fp8 computes them
        codes, scale = ops.fp8_row_parts(t, hd)
        return out.copy_(codes.transpose(1, 2)).mul_(scale.transpose(1, 2))

    scores = torch.cat([qg @ kv_major(ctx_k).transpose(-1, -2),
                        qg @ kv_major(blk_k).transpose(-1, -2)], -1) / math.sqrt(hd)
    visible = F.pad(ctx_mask, (0, b), value=True)[:, None, None]  # [N, 1, 1, B, W + B]
    scores = scores.view(n, kv, g, b, w + b).masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, -1).view(n, kv, g * b, w + b)
    o = p[..., :w] @ kv_major(ctx_v) + p[..., w:] @ kv_major(blk_v)  # [N, kv, g * B, hd]
    return o.view(n, kv, g, b, hd).permute(0, 3, 1, 2, 4).reshape(n, b, heads, hd).to(q.dtype)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, ps: ParallelState) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.ps = cfg, ps
        # this rank's heads (all of them without TP)
        self.num_heads = split(cfg.num_heads, ps.tp_size, "draft num_attention_heads")
        self.num_kv_heads = split(cfg.num_kv_heads, ps.tp_size, "draft num_key_value_heads")
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = ColumnParallelLinear(h, cfg.num_heads * hd, ps)
        self.self_attn.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * hd, ps)
        self.self_attn.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * hd, ps)
        self.self_attn.o_proj = RowParallelLinear(cfg.num_heads * hd, h, ps)
        self.self_attn.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = ColumnParallelLinear(h, cfg.intermediate_size, ps)
        self.mlp.up_proj = ColumnParallelLinear(h, cfg.intermediate_size, ps)
        self.mlp.down_proj = RowParallelLinear(cfg.intermediate_size, h, ps)
        self.attention_conv = DynamicConv(cfg)
        self.mlp_conv = DynamicConv(cfg)

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context features c [T, H] at positions [T]: [T, kv, hd] each (this
        rank's KV heads)."""
        a, cfg, kv = self.self_attn, self.cfg, self.num_kv_heads
        k = a.k_norm(a.k_proj(c).view(-1, kv, cfg.head_dim))
        return rope(k, positions, cfg.rope_theta), a.v_proj(c).view(-1, kv, cfg.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """x: [N, B, H] block rows at positions [N, B]; ctx_k/v: [N, W, kv, hd] (this rank's
        KV heads) with ctx_mask [N, B, W] (True = visible). Returns [N, B, H]."""
        a, cfg = self.self_attn, self.cfg
        n, b, _ = x.shape
        u = self.input_layernorm(x)
        taps = self.attention_conv.kernels(u)
        z = DynamicConv.apply(u, taps[0])
        q = rope(a.q_norm(a.q_proj(z).view(n, b, self.num_heads, cfg.head_dim)), positions,
                 cfg.rope_theta)
        bk = rope(a.k_norm(a.k_proj(z).view(n, b, self.num_kv_heads, cfg.head_dim)),
                  positions, cfg.rope_theta)
        bv = a.v_proj(z).view(n, b, self.num_kv_heads, cfg.head_dim)
        o = grouped_attention(q, ctx_k, ctx_v, ctx_mask, bk, bv)
        # the conv is linear in its input: summing the ranks' partial sums first is exact
        o = self.ps.tp_all_reduce(a.o_proj(o.reshape(n, b, -1)))
        x = x + DynamicConv.apply(o, taps[1])
        u = self.post_attention_layernorm(x)
        taps = self.mlp_conv.kernels(u)
        z = DynamicConv.apply(u, taps[0])
        m = self.mlp.down_proj(ops.swiglu(self.mlp.gate_proj(z), self.mlp.up_proj(z), 1e30))
        return x + DynamicConv.apply(self.ps.tp_all_reduce(m), taps[1])


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
    def __init__(self, cfg: DFlashConfig, ps: ParallelState | None = None) -> None:
        super().__init__()
        ps = ps or ParallelState()
        self.config = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, ps) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.selector_rank else None

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank keeps in its context ring (all of them without TP)."""
        return self.layers[0].num_kv_heads

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Target tap states [T, n_taps * H] -> context features [T, H]."""
        return self.hidden_norm(self.fc(taps))


def _build(cfg: DFlashConfig, dtype: torch.dtype, device: torch.device | str,
           ps: ParallelState | None) -> DFlashDraftModel:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return DFlashDraftModel(cfg, ps).requires_grad_(False).eval()
    finally:
        torch.set_default_dtype(previous)


def draft_weight_bytes(cfg: DFlashConfig, dtype: torch.dtype,
                       ps: ParallelState | None = None) -> int:
    """Parameter bytes of this rank's draft as `load_draft` allocates it (every tensor in
    `dtype`). Built on the meta device: no memory is used. GLM's DFlash2 in bf16: 1,171,080,448
    parameters = 2.18 GiB on one rank; under TP2 each rank keeps half of the layers' attention
    and MLP matrices (964,689,920 / 2 + 206,390,528 replicated = 688,735,488: 1.28 GiB)."""
    return sum(p.numel() * p.element_size() for p in _build(cfg, dtype, "meta", ps).parameters())


def load_draft(path: str | Path, dtype: torch.dtype, device: torch.device | str,
               ps: ParallelState | None = None) -> DFlashDraftModel:
    """Strictly load a HF-layout DFlash2 draft checkpoint (safetensors files): this rank's
    shard of the TP-sharded matrices (linear.mark_shard), the rest whole."""
    model = _build(DFlashConfig.from_dir(path), dtype, device, ps)
    params = dict(model.named_parameters())
    files = sorted(Path(path).glob("*.safetensors"))
    seen = set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in the draft checkpoint")
                param, raw = params[name], st.get_slice(name)
                want = list(param.shape)
                dim, size = getattr(param, "shard_dim", None), getattr(param, "shard_size", 1)
                if dim is not None:
                    want[dim] *= size
                if list(raw.get_shape()) != want:
                    raise ValueError(f"draft tensor {name!r} has shape {tuple(raw.get_shape())}, "
                                     f"expected {tuple(want)}")
                if dim is None:
                    t = st.get_tensor(name)
                else:
                    part = want[dim] // size
                    lo = param.shard_rank * part
                    t = raw[(slice(None),) * dim + (slice(lo, lo + part),)]
                param.data.copy_(t.to(param.dtype))
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in the draft checkpoint")
    return model
