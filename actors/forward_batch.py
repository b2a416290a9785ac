"""ForwardBatch: the per-step metadata every layer reads (flat varlen batch over paged caches).

Tokens of all scheduled sequences are concatenated; sequence i owns rows
cu_seqlens[i]:cu_seqlens[i+1], resumes from `has_initial_state[i]` in state slot
`state_ids[i]`, and addresses its paged rows through `block_tables[i]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    query_seq: torch.Tensor  # [T] int64, batch row of each token
    cu_seqlens: torch.Tensor  # [N+1] int64
    state_ids: torch.Tensor  # [N] int64, KDA / open-pool state slot per sequence
    has_initial_state: torch.Tensor  # [N] bool, False for a sequence's first step
    block_tables: torch.Tensor  # [N, max_blocks] int64
    slot_mapping: torch.Tensor  # [T] int64, flat paged slot of each token

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        start_positions: list[int],
        num_tokens: list[int],
        state_ids: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Sequence i computes positions start_positions[i] .. + num_tokens[i] - 1."""
        positions = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(start_positions, num_tokens, strict=True)]
        ).astype(np.int64)
        query_seq = np.repeat(np.arange(len(num_tokens)), num_tokens)
        width = max(len(b) for b in block_tables)
        tables = np.zeros((len(block_tables), width), dtype=np.int64)
        for i, blocks in enumerate(block_tables):
            tables[i, : len(blocks)] = blocks
        if positions.size and (positions // block_size >= width).any():
            raise ValueError("a token position lies beyond its sequence's block table")
        slots = tables[query_seq, positions // block_size] * block_size + positions % block_size
        as_t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        return cls(
            positions=as_t(positions),
            query_seq=as_t(query_seq),
            cu_seqlens=as_t(np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64)),
            state_ids=as_t(np.asarray(state_ids, dtype=np.int64)),
            has_initial_state=as_t(np.asarray(start_positions) > 0),
            block_tables=as_t(tables),
            slot_mapping=as_t(slots.astype(np.int64)),
        )
