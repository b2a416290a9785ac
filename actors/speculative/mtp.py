"""MTP proposer: the checkpoint's multi-token-prediction layer drafts k tokens per request.

Pass 0 runs the MTP layer over every row the target just computed and kept (its latent and
indexer caches must cover every position), each row fed the target's final hidden state and the
token that follows it; the last kept row of a drafting request yields draft 1. A step in which
no request drafts runs only the part of pass 0 that writes those cache rows (a few small
projections, not the layer's attention, MoE and the lm_head). Passes 1..k-1
feed the MTP layer its own output and the previous draft, one row per drafting request, at the
next positions. Greedy drafts (argmax, the default) are verified by exact match; probabilistic
drafts are drawn from the MTP distribution under the request's sampling settings, and their
distributions are kept (per request, until the next step) for the min(1, p/q) rule.
Rows written at positions that end up rejected are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from glm53.kernels import ops

from ..caches import ModelCaches
from ..forward_batch import ForwardBatch, slot_mapping_for
from ..models.glm5_next import Glm5NextForCausalLM
from ..step import StepInput
from .verify import DRAFT_SALT


class MTPProposer:
    def __init__(self, model: Glm5NextForCausalLM, caches: ModelCaches, num_spec: int,
                 probabilistic: bool = False) -> None:
        if model.mtp is None:
            raise ValueError("MTP speculation needs the model's MTP layer (with_mtp)")
        self.model, self.caches, self.num_spec = model, caches, num_spec
        self.probabilistic = probabilistic
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] of its drafts

    @torch.inference_mode()
    def propose(self, step: StepInput, hidden: torch.Tensor, kept: np.ndarray,
                next_tokens: np.ndarray, taps: torch.Tensor | None = None) -> np.ndarray:
        """Run the MTP passes of one step.

        hidden: [T, D] target hidden of the step's rows; kept: [N] rows of each sequence that
        stay (all, or 1 + accepted drafts); next_tokens: [N] token after each sequence's last
        kept row. Proposes step.propose[i] drafts for sequence i. Returns draft ids
        [N, num_spec], -1 where none.
        """
        token_ids, positions, cu_seqlens = step.token_ids, step.positions, step.cu_seqlens
        block_tables, state_ids, wanted = step.block_tables, step.state_ids, step.propose
        device = hidden.device
        n = len(kept)
        drafts = np.full((n, self.num_spec), -1, dtype=np.int64)
        rows = np.concatenate([np.arange(s, s + c) for s, c in zip(cu_seqlens[:-1], kept,
                                                                    strict=True)])
        if rows.size == 0:
            return drafts
        cu = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
        nxt = np.append(token_ids[1:], -1)[rows]
        nxt[cu[1:][kept > 0] - 1] = next_tokens[kept > 0]  # last kept row: the new token
        pos = positions[rows]
        seq_of_row = np.repeat(np.arange(n), kept)
        bs = self.caches.block_size
        batch = ForwardBatch.from_arrays(pos, cu, block_tables,
                                         slot_mapping_for(pos, seq_of_row, block_tables, bs),
                                         state_ids, device)
        prev, nxt = hidden[torch.tensor(rows, device=device)], torch.tensor(nxt, device=device)
        drafting = np.flatnonzero((wanted > 0) & (kept > 0))
        if drafting.size == 0:
            self.model.write_mtp_cache(prev, nxt, batch, self.caches)
            return drafts
        mtp_hidden = self.model.forward_mtp(prev, nxt, batch, self.caches)
        last = torch.tensor(cu[1:][drafting] - 1, device=device)
        h = mtp_hidden[last]
        draw = self._drawer(step, drafting, device)
        token, q = draw(self.model.compute_logits(h), 0)
        probs = [q]
        drafts[drafting, 0] = token.cpu().numpy()
        pos_last = pos[cu[1:][drafting] - 1]
        tables, slots = block_tables[drafting], state_ids[drafting]
        ones = np.arange(len(drafting) + 1, dtype=np.int64)
        for j in range(1, int(wanted[drafting].max())):
            p = pos_last + j
            b = ForwardBatch.from_arrays(
                p, ones, tables, slot_mapping_for(p, np.arange(len(drafting)), tables, bs),
                slots, device)
            h = self.model.forward_mtp(h, token, b, self.caches)
            token, q = draw(self.model.compute_logits(h), j)
            probs.append(q)
            drafts[drafting, j] = token.cpu().numpy()
        drafts[np.arange(self.num_spec)[None, :] >= wanted[:, None]] = -1
        self.draft_probs = ({} if not self.probabilistic else {
            step.request_ids[i]: torch.stack([p[n] for p in probs])
            for n, i in enumerate(drafting)})
        return drafts

    @torch.inference_mode()
    def draft_after_verify(self, hidden: torch.Tensor, token_ids: torch.Tensor,
                           batch: ForwardBatch, kept: torch.Tensor, emitted: torch.Tensor,
                           passes: int) -> torch.Tensor:
        """Greedy drafts after a uniform step of b sequences of w rows, from device tensors
        alone (no host sync: `DecodeGraphs` replays it as the graph after acceptance).

        Pass 0 runs every row, not only the kept ones: a row past a sequence's kept rows
        computes a position that ends up rejected, whose cache rows are rewritten before any
        query reads them (as the verify step's own are); the kept rows compute exactly what
        `propose` computes (attention is causal). Passes 1..passes-1 then run one row per
        sequence. hidden: [b*w, D] the target's final hidden states; token_ids: [b*w] the
        step's tokens; batch: the step's (padded) ForwardBatch; kept: [b] rows kept (1 +
        accepted drafts); emitted: [b] the token emitted at the last kept row; passes: 0 to
        num_spec, 0 writing pass 0's cache rows only (`write_mtp_cache`: a step that drafts
        nothing). Returns [b, passes] draft ids."""
        if not 0 <= passes <= self.num_spec:
            raise ValueError(f"{passes} draft passes: 0 to num_spec ({self.num_spec})")
        b = kept.shape[0]
        w = token_ids.shape[0] // b
        seq = torch.arange(b, device=kept.device)
        last = kept - 1
        nxt = token_ids.view(b, w).roll(-1, dims=1)  # each row fed the token after it
        nxt[seq, last] = emitted
        batch = replace(batch, defer_state=None)
        if passes == 0:
            self.model.write_mtp_cache(hidden, nxt.view(-1), batch, self.caches)
            return token_ids.new_empty((b, 0))
        h = self.model.forward_mtp(hidden, nxt.view(-1), batch, self.caches)
        h = h.view(b, w, -1)[seq, last]
        token = self.model.compute_logits(h).argmax(dim=-1)
        drafts = [token]
        first = batch.positions.view(b, w)[seq, last]
        tables, bs = batch.block_tables, self.caches.block_size
        cu = torch.arange(b + 1, device=kept.device)
        resumes = torch.ones(b, dtype=torch.bool, device=kept.device)
        for j in range(1, passes):
            p = first + j
            col = p // bs
            inside = col < tables.shape[1]  # beyond the table: into the null block 0
            block = tables[seq, col.clamp(max=tables.shape[1] - 1)].where(inside, 0)
            one = ForwardBatch(positions=p, query_seq=seq, cu_seqlens=cu,
                               state_ids=batch.state_ids, has_initial_state=resumes,
                               block_tables=tables, slot_mapping=block * bs + p % bs)
            h = self.model.forward_mtp(h, token, one, self.caches)
            token = self.model.compute_logits(h).argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _drawer(self, step: StepInput, drafting: np.ndarray, device: torch.device):
        """draw(logits [N, V], j) -> (draft tokens [N], their distributions [N, V] or None)."""
        if not self.probabilistic:
            return lambda logits, j: (logits.argmax(dim=-1), None)
        # each drafting sequence's sampling settings and keys: its last sample row's
        rows = np.array([np.flatnonzero(step.sample_seqs == i)[-1] for i in drafting])
        s = step.sampling

        def col(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(a[rows], dtype=dtype, device=device)

        temp, top_k, top_p, min_p = (col(s.temperature, torch.float32),
                                     col(s.top_k, torch.long), col(s.top_p, torch.float32),
                                     col(s.min_p, torch.float32))
        seeds = col(s.seeds, torch.long) ^ DRAFT_SALT
        base = col(s.positions, torch.long) + 1

        def draw(logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            processed = ops.process_logits(logits.float(), temp, top_k, top_p, min_p)
            token = ops.sample(processed, temp, seeds, base + j)
            q = torch.softmax(processed, dim=-1)
            greedy = temp == 0
            q[greedy] = F.one_hot(token[greedy], q.shape[-1]).to(q.dtype)
            return token, q

        return draw
