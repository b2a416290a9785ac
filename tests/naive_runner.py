"""The naive reference loop: drive the model over explicit caches, without a scheduler.

Each sequence gets one state slot and a fixed run of paged blocks; the caller picks every
chunk. Tests use it as the reference the engine must reproduce token for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from glm53.actors.caches import ModelCaches
from glm53.actors.forward_batch import ForwardBatch
from glm53.actors.models.glm5_next import Glm5NextForCausalLM
from glm53.kernels import ops


@dataclass
class _Seq:
    slot: int
    blocks: list[int]
    num_computed: int = 0


class SequenceRunner:
    def __init__(self, model: Glm5NextForCausalLM, max_seqs: int, max_len: int,
                 block_size: int = 16) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.max_len = max_len
        dtype = model.embed_tokens.weight.dtype
        device = model.embed_tokens.weight.device
        self.caches = ModelCaches.allocate(
            cfg, num_blocks=max_seqs * self.blocks_per_seq, block_size=block_size,
            num_slots=max_seqs, dtype=dtype, device=device, with_mtp=model.mtp is not None,
            ps=model.parallel)
        self.free_slots = list(range(max_seqs))
        self.seqs: dict[int, _Seq] = {}

    def add(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if not self.free_slots:
            raise RuntimeError("no free sequence slot")
        slot = self.free_slots.pop(0)
        first = slot * self.blocks_per_seq
        self.seqs[seq_id] = _Seq(slot, list(range(first, first + self.blocks_per_seq)))

    def remove(self, seq_id: int) -> None:
        self.free_slots.append(self.seqs.pop(seq_id).slot)

    def _batch(self, chunks: dict[int, list[int]]) -> ForwardBatch:
        seqs = [self.seqs[i] for i in chunks]
        for seq, ids in zip(seqs, chunks.values(), strict=True):
            if seq.num_computed + len(ids) > self.max_len:
                raise ValueError(f"sequence exceeds max_len={self.max_len}")
        return ForwardBatch.build(
            start_positions=[s.num_computed for s in seqs],
            num_tokens=[len(ids) for ids in chunks.values()],
            state_ids=[s.slot for s in seqs],
            block_tables=[s.blocks for s in seqs],
            block_size=self.block_size,
            device=self.model.embed_tokens.weight.device,
        )

    @torch.inference_mode()
    def step(self, chunks: dict[int, list[int]],
             image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, ForwardBatch]:
        """Run the next tokens of each listed sequence (one forward over the flat batch);
        `image_embeds` (rows of the flat batch, embeddings) replace those rows' embeddings.

        Returns the final-normed hidden states [T, D] of every token, in `chunks` order, and
        the batch metadata used.
        """
        batch = self._batch(chunks)
        ids = torch.tensor([t for c in chunks.values() for t in c], dtype=torch.long,
                           device=batch.positions.device)
        hidden = self.model(ids, batch, self.caches, image_embeds=image_embeds)
        for seq_id, c in chunks.items():
            self.seqs[seq_id].num_computed += len(c)
        return hidden, batch

    def step_logits(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Like `step`, but return fp32 logits [T, vocab] of every token."""
        hidden, _ = self.step(chunks)
        return self.model.compute_logits(hidden)


def generate(
    model: Glm5NextForCausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: tuple[int, ...] = (),
    prefill_chunk: int | None = None,
) -> list[int]:
    """Generate up to `max_tokens` ids after `prompt_ids` (temperature 0 = greedy).

    Output token i is drawn with noise keyed by (seed, i), as the engine's sampler does.
    """
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    runner = SequenceRunner(model, max_seqs=1, max_len=len(prompt_ids) + max_tokens)
    runner.add(0)
    device = model.embed_tokens.weight.device
    chunk = prefill_chunk or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        hidden, _ = runner.step({0: prompt_ids[start:start + chunk]})
    out: list[int] = []
    temp = torch.tensor([temperature], device=device)
    truncation = (torch.zeros(1, dtype=torch.long, device=device),  # top_k off
                  torch.tensor([top_p], device=device), torch.zeros(1, device=device))  # min_p off
    seeds = torch.tensor([seed if seed is not None else random.randrange(2**62)], device=device)
    while len(out) < max_tokens:
        processed = ops.process_logits(model.compute_logits(hidden[-1:]), temp, *truncation)
        position = torch.tensor([len(out)], device=device)
        token = int(ops.sample(processed, temp, seeds, position)[0])
        out.append(token)
        if token in stop_ids or len(out) == max_tokens:
            break
        hidden, _ = runner.step({0: [token]})
    return out
