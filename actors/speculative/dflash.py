"""DFlash proposer: one forward of the DFlash2 draft model yields up to block_size - 1 drafts.

Every kept row's target tap states become context features whose per-layer keys/values go into
a per-slot ring of the last `sliding_window` positions (the only draft state a sequence keeps:
5 x 2048 x 2 x 8 x 128 values for GLM's drafter, far below one KDA state; under TP each rank
keeps only its KV heads' part, as the draft's attention is sharded like the target's). The block
[new token, MASK x (B-1)] at the next positions then attends the ring and itself, and the
target's lm_head + the candidate selector pick the drafts (deterministic, so verification is
exact-match; see verify.py).

The ring is stored in the draft's dtype ("auto") or, with `draft_kv_cache_dtype` "fp8", as the
kernels' fp8 rows (kernels/ref/latent_quant.py): each (layer, K|V, position, KV head) row of
head_dim values is head_dim e4m3 codes and one fp32 power-of-two scale (the smallest 2^e with
absmax <= 448 x 2^e), 132 B for 128 values instead of 256 in bf16. Power-of-two scales make
the dequantisation exact in fp32; fp32 rather than bf16 scales (which would hold a power of two
exactly too and save 2 B a row, 1.5% of the ring) keep the row the latent cache's layout, with
its tested packer and reader. The attention dequantises rows to fp32, its compute dtype, in
the one kv-major copy it makes anyway (dflash_model.grouped_attention), so the fp8 ring adds
no transient beyond its scales. Verification stays exact: the ring only changes which drafts
are proposed, never what is accepted.
"""

from __future__ import annotations

import numpy as np
import torch

from glm53.kernels import ops

from ..models.glm5_next import Glm5NextForCausalLM
from ..step import StepInput
from .dflash_model import DFlashConfig, DFlashDraftModel

# drafting sequences per draft forward: a step with many resident requests drafts them in
# chunks, so the forward's transient (forward_bytes_per_sequence each) stays bounded
DRAFT_CHUNK = 8

# how the K/V ring is stored: "auto" in the draft's dtype, "fp8" as fp8 rows (module docstring)
DRAFT_KV_CACHE_DTYPES = ("auto", "fp8")


def ring_row(cfg: DFlashConfig, dtype: torch.dtype,
             draft_kv_cache_dtype: str = "auto") -> tuple[torch.dtype, int]:
    """(storage dtype, width) of one ring row of head_dim values: [head_dim] in `dtype`, or
    [head_dim + 4] uint8 (e4m3 codes, then the row's fp32 scale) for "fp8"."""
    if draft_kv_cache_dtype == "auto":
        return dtype, cfg.head_dim
    if draft_kv_cache_dtype == "fp8":
        width = ops.fp8_row_bytes(cfg.head_dim)
        if width != cfg.head_dim + 4:  # the layout scales every 128 values
            raise ValueError(f"an fp8 draft ring keeps one scale per head, which needs "
                             f"head_dim <= 128, not {cfg.head_dim}")
        return torch.uint8, width
    raise ValueError(f"draft_kv_cache_dtype {draft_kv_cache_dtype!r}: one of "
                     f"{', '.join(DRAFT_KV_CACHE_DTYPES)}")


def _row_bytes(cfg: DFlashConfig, dtype: torch.dtype, draft_kv_cache_dtype: str) -> int:
    storage, width = ring_row(cfg, dtype, draft_kv_cache_dtype)
    return width * torch.empty(0, dtype=storage).element_size()


def forward_bytes_per_sequence(cfg: DFlashConfig, dtype: torch.dtype, tp: int = 1,
                               draft_kv_cache_dtype: str = "auto") -> int:
    """Peak transient bytes one drafting sequence adds to a draft forward under TP `tp` (one
    layer is live at a time; kv = num_kv_heads / tp, heads = num_heads / tp, C = sliding_window
    + block_size): the ring gather [2, W, kv] rows (ring_row: hd values in `dtype`, or fp8
    rows and then, beside the copy below, their fp32 scales [W, kv]), one fp32 kv-major copy of
    the context keys or values [kv, W, hd] (dflash_model.grouped_attention), fp32 scores
    [heads, B, C] x 3 (two are live at once; the third covers the masks and block rows); then,
    after the layers, the head's logits [B - 1, vocab] fp32, its log-softmax and top-k input
    (x3; the two phases are not live together, so the sum bounds the peak). GLM's DFlash2 in
    bf16: 34.4 MiB at TP1, 23.4 MiB at TP2 (K/V repeated to every query head in fp32 took
    128.8 MiB; with the fp8 ring: 21.5 MiB at TP2). Measured on CPU (tests/actors/
    test_spec_memory.py): 95% of this, 92% with the fp8 ring."""
    w, b, hd = cfg.sliding_window, cfg.block_size, cfg.head_dim
    kv, heads = cfg.num_kv_heads // tp, cfg.num_heads // tp
    gather = 2 * w * kv * _row_bytes(cfg, dtype, draft_kv_cache_dtype)
    scales = w * kv * 4 if draft_kv_cache_dtype == "fp8" else 0
    attn = gather + scales + w * kv * hd * 4 + 3 * heads * b * (w + b) * 4
    return attn + 3 * (b - 1) * cfg.vocab_size * 4


def ring_bytes_per_sequence(cfg: DFlashConfig, dtype: torch.dtype, tp: int = 1,
                            draft_kv_cache_dtype: str = "auto") -> int:
    """Device bytes of one sequence's draft state on one rank under TP `tp`, as DFlashProposer
    allocates it: the K/V ring [layers, 2, sliding_window, num_kv_heads / tp] of rows
    (ring_row: head_dim values in the draft's dtype, or fp8 rows of head_dim codes + a 4 B
    scale) plus its int64 positions [sliding_window]. GLM's DFlash2: in bf16 5 x 2 x 2048 x 8
    x 128 x 2 B + 16 KiB = 40.02 MiB at TP1, 20.02 MiB a rank at TP2; in fp8 5 x 2 x 2048 x 4
    x 132 B + 16 KiB = 10.33 MiB a rank at TP2. Fixed per sequence: it does not grow with the
    context."""
    w = cfg.sliding_window
    return (cfg.num_layers * 2 * w * (cfg.num_kv_heads // tp)
            * _row_bytes(cfg, dtype, draft_kv_cache_dtype) + w * 8)


class DFlashProposer:
    def __init__(self, target: Glm5NextForCausalLM, draft: DFlashDraftModel, num_slots: int,
                 num_spec: int, num_checkpoints: int = 0,
                 draft_kv_cache_dtype: str = "auto") -> None:
        """`num_slots` rings for the running sequences (by state slot id) and
        `num_checkpoints` more after them, holding the rings of the prefix cache's KDA state
        checkpoints (save / restore), stored as `draft_kv_cache_dtype` says (ring_row)."""
        cfg = draft.config
        if num_spec > cfg.block_size - 1:
            raise ValueError(f"DFlash block {cfg.block_size} drafts at most "
                             f"{cfg.block_size - 1} tokens, not {num_spec}")
        self.target, self.draft, self.num_spec = target, draft, num_spec
        self.tap_layers = cfg.target_layer_ids
        device = target.embed_tokens.weight.device
        storage, width = ring_row(cfg, draft.fc.weight.dtype, draft_kv_cache_dtype)
        self.fp8 = draft_kv_cache_dtype == "fp8"
        w = cfg.sliding_window
        self.num_slots = num_slots
        rows = num_slots + num_checkpoints
        # per slot (then per checkpoint) and layer: keys and values of the last W context
        # positions (this rank's KV heads), one row of `width` per head (zero rows read as 0)
        self.ring = torch.zeros(rows, cfg.num_layers, 2, w, draft.num_kv_heads, width,
                                dtype=storage, device=device)
        self.ring_pos = torch.full((rows, w), -1, dtype=torch.long, device=device)

    @property
    def state_bytes_per_sequence(self) -> int:
        """What one slot's ring holds (= ring_bytes_per_sequence, which the memory plan uses)."""
        return self.ring[0].numel() * self.ring.element_size() + self.ring_pos[0].numel() * 8

    @property
    def state_bytes(self) -> int:
        """Every slot's and checkpoint's ring: what this proposer allocated on the device."""
        return self.ring.numel() * self.ring.element_size() + self.ring_pos.numel() * 8

    # ----- prefix-cache checkpoints: the ring goes with the KDA state at a block boundary -----
    def save(self, slot: int, checkpoint: int) -> None:
        """Keep slot `slot`'s ring as checkpoint `checkpoint`'s (its positions are the
        sequence's, all before the checkpoint's: only kept rows are ever written)."""
        self._copy(slot, self.num_slots + checkpoint)

    def restore(self, checkpoint: int, slot: int) -> None:
        """Replace all of slot `slot`'s ring by checkpoint `checkpoint`'s, so a sequence
        resuming from a cached prefix drafts from that prefix's context and from nothing a
        previous occupant of the slot left behind."""
        self._copy(self.num_slots + checkpoint, slot)

    def _copy(self, src: int, dst: int) -> None:
        self.ring[dst].copy_(self.ring[src])
        self.ring_pos[dst].copy_(self.ring_pos[src])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [T, kv, hd] as the ring stores them: as they are, or fp8 rows."""
        if not self.fp8:
            return x
        return ops.pack_fp8(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    @torch.inference_mode()
    def propose(self, step: StepInput, hidden: torch.Tensor, kept: np.ndarray,
                next_tokens: np.ndarray, taps: torch.Tensor | None = None) -> np.ndarray:
        """taps: [T, n_taps * H] target tap states of the step's rows. Returns [N, num_spec]."""
        w = self.draft.config.sliding_window
        device = hidden.device
        n = len(kept)
        drafts = np.full((n, self.num_spec), -1, dtype=np.int64)
        starts = step.cu_seqlens[:-1]
        for i in range(n):  # write context K/V of the kept rows into the slot's ring
            if not kept[i]:
                continue
            slot = int(step.state_ids[i])
            rows = torch.arange(int(starts[i]), int(starts[i] + kept[i]), device=device)
            pos = torch.as_tensor(step.positions[rows.cpu().numpy()], device=device)
            if int(pos[0]) == 0:
                self.ring_pos[slot] = -1  # a new sequence in this slot
            c = self.draft.context(taps[rows])
            for layer_id, layer in enumerate(self.draft.layers):
                k, v = layer.context_kv(c, pos)
                self.ring[slot, layer_id, 0, pos % w] = self._rows(k)
                self.ring[slot, layer_id, 1, pos % w] = self._rows(v)
            self.ring_pos[slot, pos % w] = pos
        drafting = np.flatnonzero((step.propose > 0) & (kept > 0))
        for lo in range(0, drafting.size, DRAFT_CHUNK):
            part = drafting[lo:lo + DRAFT_CHUNK]
            drafts[part] = self._draft(step, part, kept, next_tokens)
        wanted = step.propose
        drafts[np.arange(self.num_spec)[None, :] >= wanted[:, None]] = -1
        return drafts

    def _draft(self, step: StepInput, drafting: np.ndarray, kept: np.ndarray,
               next_tokens: np.ndarray) -> np.ndarray:
        """One draft forward for the sequences `drafting` (indices into the step's sequences,
        at most DRAFT_CHUNK): their blocks attend their rings. Returns [len, num_spec]."""
        cfg, w = self.draft.config, self.draft.config.sliding_window
        device = self.ring.device
        starts = step.cu_seqlens[:-1]
        slots = torch.as_tensor(step.state_ids[drafting], device=device)
        last = torch.as_tensor(step.positions[starts[drafting] + kept[drafting] - 1],
                               device=device)
        b = cfg.block_size
        positions = last[:, None] + 1 + torch.arange(b, device=device)  # [N, B]
        ids = torch.full((len(drafting), b), cfg.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.as_tensor(next_tokens[drafting], device=device)
        x = self.target.embed_tokens(ids)
        ring_pos = self.ring_pos[slots]  # [N, W]
        visible = ((ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] <= last[:, None, None])
                   & (positions[:, :, None] - ring_pos[:, None, :] <= w - 1))
        for layer_id, layer in enumerate(self.draft.layers):
            # the gathered [N, 2, W, kv, width] rows are freed before the next layer gathers
            # its own (the attention dequantises fp8 rows)
            x = layer(x, positions, *self.ring[slots, layer_id].unbind(1), visible)
        h = self.draft.norm(x)[:, 1:]
        logits = self.target.compute_logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)
        anchor = ids[:, 0]
        chosen = (self.draft.candidate_selector(h, logits, anchor)
                  if self.draft.candidate_selector is not None else logits.argmax(-1))
        return chosen[:, : self.num_spec].cpu().numpy()
