"""ForwardBatch: the per-step metadata every layer reads (flat varlen batch over paged caches).

Tokens of all scheduled sequences are concatenated; sequence i owns rows
cu_seqlens[i]:cu_seqlens[i+1], resumes from its state slot `state_ids[i]` unless this step
starts it at position 0, and addresses its paged rows through `block_tables[i]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def slot_mapping_for(positions: np.ndarray, query_seq: np.ndarray, block_tables: np.ndarray,
                     block_size: int) -> np.ndarray:
    """Flat paged slot of each token: block_tables[seq, pos // bs] * bs + pos % bs."""
    if positions.size and (positions // block_size >= block_tables.shape[1]).any():
        raise ValueError("a token position lies beyond its sequence's block table")
    blocks = block_tables[query_seq, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    query_seq: torch.Tensor  # [T] int64, batch row of each token
    cu_seqlens: torch.Tensor  # [N+1] int64
    state_ids: torch.Tensor  # [N] int64, KDA / open-pool state slot per sequence
    has_initial_state: torch.Tensor  # [N] bool, False when the step starts at position 0
    block_tables: torch.Tensor  # [N, max_blocks] int64
    slot_mapping: torch.Tensor  # [T] int64, flat paged slot of each token
    # [N] bool: sequences verifying drafts; their KDA state is written after acceptance
    defer_state: torch.Tensor | None = None
    # [N+1] int64 on the host (None where the step has none, e.g. a graph replay): chunked
    # prefill plans its chunks from it rather than reading cu_seqlens back from the device
    cu_seqlens_host: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def from_arrays(cls, positions: np.ndarray, cu_seqlens: np.ndarray, block_tables: np.ndarray,
                    slot_mapping: np.ndarray, state_ids: np.ndarray,
                    device: torch.device | str = "cpu",
                    num_drafts: np.ndarray | None = None) -> ForwardBatch:
        """From host arrays (positions [T], cu_seqlens [N+1], block_tables [N, B], ...)."""
        lengths = np.diff(cu_seqlens)
        first = positions[np.minimum(cu_seqlens[:-1], max(len(positions) - 1, 0))]

        def as_t(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(a, device=device)  # a copy: step arrays may be read-only

        return cls(
            positions=as_t(positions.astype(np.int64)),
            query_seq=as_t(np.repeat(np.arange(len(lengths)), lengths)),
            cu_seqlens=as_t(cu_seqlens.astype(np.int64)),
            state_ids=as_t(state_ids.astype(np.int64)),
            has_initial_state=as_t((first > 0) & (lengths > 0)),
            block_tables=as_t(block_tables.astype(np.int64)),
            slot_mapping=as_t(slot_mapping.astype(np.int64)),
            defer_state=(as_t(num_drafts > 0) if num_drafts is not None and num_drafts.any()
                         else None),
            cu_seqlens_host=torch.from_numpy(cu_seqlens.astype(np.int64)),
        )

    @classmethod
    def build(cls, start_positions: list[int], num_tokens: list[int], state_ids: list[int],
              block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> ForwardBatch:
        """Sequence i computes positions start_positions[i] .. + num_tokens[i] - 1."""
        positions = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(start_positions, num_tokens, strict=True)]
        ).astype(np.int64)
        query_seq = np.repeat(np.arange(len(num_tokens)), num_tokens)
        tables = np.zeros((len(block_tables), max(len(b) for b in block_tables)), np.int64)
        for i, blocks in enumerate(block_tables):
            tables[i, : len(blocks)] = blocks
        return cls.from_arrays(
            positions, np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64), tables,
            slot_mapping_for(positions, query_seq, tables, block_size),
            np.asarray(state_ids, dtype=np.int64), device)


@dataclass(frozen=True)
class DeferredStates:
    """The sequences of a verify step whose KDA states wait for acceptance (those verifying
    drafts), as the commit after acceptance reads them: M sequences."""

    cu_seqlens: torch.Tensor  # [M+1] int64, over their rows only
    state_ids: torch.Tensor  # [M] int64
    has_initial_state: torch.Tensor  # [M] bool
    # [R] int64, their rows among the step's rows; None when every row of the step is theirs
    rows: torch.Tensor | None = None

    @classmethod
    def of_step(cls, positions: np.ndarray, cu_seqlens: np.ndarray, state_ids: np.ndarray,
                num_drafts: np.ndarray, device: torch.device | str = "cpu") -> DeferredStates:
        """From the step's host arrays (positions [T], cu_seqlens [N+1], state_ids and
        num_drafts [N]), in one copy to the device: nothing is read back from it."""
        mine = num_drafts > 0
        starts, lengths = cu_seqlens[:-1][mine], np.diff(cu_seqlens)[mine]
        cu = np.concatenate([[0], np.cumsum(lengths)])
        every = bool(mine.all())
        rows = np.zeros(0, np.int64) if every else np.concatenate(
            [np.zeros(0, np.int64), *(np.arange(s, s + n) for s, n in zip(starts, lengths,
                                                                            strict=True))])
        m = int(mine.sum())
        packed = torch.from_numpy(np.concatenate(
            [cu, state_ids[mine], positions[starts] > 0, rows]).astype(np.int64)).to(device)
        parts = packed.split([m + 1, m, m, len(rows)])
        return cls(parts[0], parts[1], parts[2].bool(), None if every else parts[3])
