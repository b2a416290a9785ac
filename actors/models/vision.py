"""GLM-5.3-Flash vision tower (`model.visual`): ViT blocks, the 2x2 patch merger and the
projector into the text hidden size, as transformers' Glm5NextVisionModel computes them.

Input: the processor's flat patches of one or more images, [P, C * T * ps * ps], each image's
patches in block-major order over spatial_merge_size^2 merge blocks, and each image's grid
(t, h, w) in patches. Output: one text-width embedding per merge block, images concatenated,
which replace the image placeholder embeddings of the prompt one for one. Attention is
non-causal within each frame (t slice) of an image and never across images.

Replicated on every TP rank (about 0.56 B parameters at release size): no collective is needed
and each rank splices the same rows into its own embedding output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig
from ..layers.norm import RMSNorm


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.attention_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seqlens: list[int]) -> torch.Tensor:
    """Non-causal attention within each segment of `seqlens` rows: q, k, v [P, H, D] -> [P, H, D].

    Consecutive segments of one length go as one [n, H, S, D] call: SDPA reaches its fused
    (flash / memory-efficient) kernels only with 4-D inputs, so per-segment 3-D calls ran the
    unfused math path."""
    out, start, i = [], 0, 0
    while i < len(seqlens):
        n = 1
        while i + n < len(seqlens) and seqlens[i + n] == seqlens[i]:
            n += 1
        s, end = seqlens[i], start + n * seqlens[i]
        qs, ks, vs = (t[start:end].view(n, s, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
                   .reshape(end - start, *q.shape[1:]))
        start, i = end, i + n
    return torch.cat(out)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqlens: list[int]) -> torch.Tensor:
        """x: [P, D]; cos/sin: [P, head_dim] fp32; seqlens: patches per attention segment."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [P, 1, head_dim]: every head alike
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        return self.proj(segment_attention(q, k, v, seqlens).reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The projector: proj -> LayerNorm -> exact GELU -> clamped SwiGLU, no biases but the
    LayerNorm's."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, i = cfg.out_hidden_size, cfg.projection_intermediate_size
        self.proj = nn.Linear(d, d, bias=False)
        self.post_projection_norm = nn.LayerNorm(d)
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel)
        self.shape = (cfg.in_channels, *kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [P, C*T*ps*ps] -> [P, hidden]."""
        x = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(pixels.shape[0], -1)


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch, in the processor's block-major order: [P, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(),
                           cols.reshape(blocks).transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m = cfg.spatial_merge_size
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, m, stride=m)
        self.merger = PatchMerger(cfg)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [P, 2] -> cos, sin [P, head_dim]: (h freqs | w freqs) twice. h and w each
        rotate head_dim / 2 dims with head_dim / 4 frequencies. (Computed per call, not a
        buffer: the loader materialises meta-built models without running initialisers.)"""
        device = self.downsample.weight.device
        half = self.config.head_dim // 2
        inv_freq = 1.0 / self.config.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
        freqs = (positions.to(device, torch.float32)[..., None] * inv_freq).flatten(1)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """pixels: [P, patch_dim], grid_thw: (t, h, w) per image (P = sum t*h*w) ->
        [P / merge^2, out_hidden_size]."""
        cfg, m = self.config, self.config.spatial_merge_size
        if sum(t * h * w for t, h, w in grid_thw) != pixels.shape[0]:
            raise ValueError("pixel rows do not match the image grids")
        cos, sin = self._rope(patch_positions(grid_thw, m))
        seqlens = [h * w for t, h, w in grid_thw for _ in range(t)]  # one segment per frame
        x = self.patch_embed(pixels)
        for block in self.blocks:
            x = block(x, cos, sin, seqlens)
        x = self.post_layernorm(x)
        # consecutive m*m patches form one merge block (block-major order)
        x = x.view(-1, m, m, cfg.hidden_size).permute(0, 3, 1, 2)
        x = self.downsample(x).view(-1, cfg.out_hidden_size)
        return self.merger(x)
