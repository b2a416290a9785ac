"""GLM-5.3-Flash text model (`Glm5NextForConditionalGeneration`, language tower) and its MTP layer.

The trunk is a stack of mHC decoder layers (KDA or KPool-DSA attention; dense or MoE FFN) over
`hc_mult` residual streams, run on a flat varlen batch with explicit caches. `forward` returns
the final-normed hidden states; `compute_logits` applies the untied lm_head to chosen rows.
"""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..caches import DSAState, KDAState, ModelCaches
from ..config import DENSE, KDA, ModelConfig
from ..forward_batch import DeferredStates, ForwardBatch
from ..layers.kda import KDAttention
from ..layers.linear import Linear, ParallelLMHead, VocabParallelEmbedding
from ..layers.mhc import HyperConnection
from ..layers.mla_dsa import DSAttention
from ..layers.moe import DenseFFN, MoE
from ..layers.norm import RMSNorm
from ..parallel import ParallelState
from .vision import VisionTower

# a block output not yet expanded into the streams: (y [T, D], post [T, n], comb [T, n, n])
Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def expand(streams: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The streams [T, n, D] with a pending block output expanded into them."""
    return ops.hc_post(streams, *pending)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.is_kda = cfg.layer_types[layer_id] == KDA
        self.self_attn = KDAttention(cfg, ps) if self.is_kda else DSAttention(cfg, ps)
        self.mlp = DenseFFN(cfg, ps) if cfg.mlp_layer_types[layer_id] == DENSE else MoE(cfg, ps)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, state: KDAState | DSAState,
                pending: Pending | None = None) -> tuple[torch.Tensor, Pending]:
        """streams: [T, n, D], and `pending`: the previous layer's FFN output not yet expanded
        into them. Returns this layer's (streams, pending): each site's expansion runs fused
        with the next site's projection (`HyperConnection.after`), the last one's in the
        model (`expand`)."""
        if pending is None:
            post, comb, x = self.attn_hc(streams, self.input_layernorm)
        else:
            streams, post, comb, x = self.attn_hc.after(streams, *pending, self.input_layernorm)
        y = self.self_attn(x, batch, state)
        streams, post, comb, x = self.ffn_hc.after(streams, y, post, comb,
                                                   self.post_attention_layernorm)
        return streams, (self.mlp(x), post, comb)


class MTPLayer(nn.Module):
    """Multi-token-prediction layer (checkpoint layer index = num_hidden_layers).

    A plain pre-norm residual block (no mHC) with its own DSA attention and MoE, fed by
    eh_proj([enorm(embed(next token)); hnorm(previous hidden)]). Shares embed_tokens and lm_head
    with the trunk.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = DSAttention(cfg, ps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MoE(cfg, ps)
        self.shared_head_norm = RMSNorm(d, eps)

    def forward(self, prev_hidden: torch.Tensor, next_embeds: torch.Tensor,
                batch: ForwardBatch, state: DSAState) -> torch.Tensor:
        """prev_hidden: [T, D] hidden after the final norm at position t (or the previous MTP
        output); next_embeds: [T, D] embedding of token t+1. Returns the MTP hidden [T, D]."""
        f = self._block_input(prev_hidden, next_embeds, batch)
        a = f + self.self_attn(self.input_layernorm(f), batch, state)
        return self.shared_head_norm(a + self.mlp(self.post_attention_layernorm(a)))

    def write_cache(self, prev_hidden: torch.Tensor, next_embeds: torch.Tensor,
                    batch: ForwardBatch, state: DSAState) -> None:
        """Only the cache rows `forward` writes for the batch's positions (same inputs), without
        its attention, MoE and output: a pass whose drafts nobody reads."""
        f = self._block_input(prev_hidden, next_embeds, batch)
        self.self_attn.write_cache(self.input_layernorm(f), batch, state)

    def _block_input(self, prev_hidden: torch.Tensor, next_embeds: torch.Tensor,
                     batch: ForwardBatch) -> torch.Tensor:
        # the embedding input is zeroed at sequence position 0 (as in the reference runtime)
        e = next_embeds.masked_fill((batch.positions == 0).unsqueeze(-1), 0.0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden)], dim=-1))


class Glm5NextForCausalLM(nn.Module):
    """Language tower of GLM-5.3-Flash (this rank's shard under `ps`); `with_mtp` adds the MTP
    layer, `with_vision` the vision tower (`visual`, replicated) whose image embeddings
    `forward` splices in place of the image placeholder tokens."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False,
                 ps: ParallelState | None = None, with_vision: bool = False) -> None:
        super().__init__()
        if with_mtp and not cfg.has_mtp:
            raise ValueError("the config declares no MTP layer (num_nextn_predict_layers == 0)")
        if with_vision and cfg.vision is None:
            raise ValueError("the config declares no vision tower (no vision_config)")
        if with_vision and cfg.vision.out_hidden_size != cfg.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={cfg.vision.out_hidden_size} is "
                             f"not the text hidden_size={cfg.hidden_size}")
        ps = ps or ParallelState()
        self.config, self.parallel = cfg, ps
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ps) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ps)
        self.mtp = MTPLayer(cfg, ps) if with_mtp else None
        self.visual = VisionTower(cfg.vision) if with_vision else None

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
                tap_layers: tuple[int, ...] = (),
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """token_ids: [T] -> final-normed hidden states [T, D]; with `tap_layers`, also the
        stream-averaged output of those layers, concatenated: [T, len(tap_layers) * D].
        image_embeds: (rows [M], embeddings [M, D]) replacing those rows' token embeddings
        (the image placeholders; the positions stay the tokens' own: the tower is NoPE)."""
        x = self.embed_tokens(token_ids)
        if image_embeds is not None:
            rows, embeds = image_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        taps, pending = {}, None
        for i, (layer, state) in enumerate(zip(self.layers, caches.layers, strict=True)):
            streams, pending = layer(streams, batch, state, pending)
            if i in tap_layers:  # the next layer expands it again, fused
                taps[i] = expand(streams, pending).mean(dim=1)
        hidden = self.norm(expand(streams, pending).mean(dim=1))
        if not tap_layers:
            return hidden
        return hidden, torch.cat([taps[i] for i in tap_layers], dim=-1)

    @torch.inference_mode()
    def commit_speculative(self, deferred: DeferredStates, caches: ModelCaches,
                           num_accepted: torch.Tensor) -> None:
        """After a verify step: KDA states of the verifying sequences advance past their
        accepted tokens only (num_accepted [M], one per deferred sequence, counted from its
        first token in the step)."""
        for layer, state in zip(self.layers, caches.layers, strict=True):
            if layer.is_kda:
                layer.self_attn.commit(deferred, state, num_accepted)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [R, D] -> logits [R, vocab] in fp32; with `out` ([R, vocab] fp32, the CUDA
        graphs' shared logits) the fp32 conversion writes there instead of a new tensor."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    @torch.inference_mode()
    def forward_mtp(self, prev_hidden: torch.Tensor, next_token_ids: torch.Tensor,
                    batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """One MTP draft pass: prev_hidden [T, D], next_token_ids [T] -> MTP hidden [T, D]."""
        if self.mtp is None or caches.mtp is None:
            raise RuntimeError("model or caches were built without the MTP layer")
        return self.mtp(prev_hidden, self.embed_tokens(next_token_ids), batch, caches.mtp)

    def write_mtp_cache(self, prev_hidden: torch.Tensor, next_token_ids: torch.Tensor,
                        batch: ForwardBatch, caches: ModelCaches) -> None:
        """The MTP caches `forward_mtp` would write for these rows (same arguments), and
        nothing else: what a step that drafts nothing still owes the MTP layer, whose later
        passes attend over every position."""
        if self.mtp is None or caches.mtp is None:
            raise RuntimeError("model or caches were built without the MTP layer")
        self.mtp.write_cache(prev_hidden, self.embed_tokens(next_token_ids), batch, caches.mtp)
