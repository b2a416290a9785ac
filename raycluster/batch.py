"""SchedulerOutput -> StepInput: flat token ids, positions, block tables, slot mapping, state
slots, sampling arrays and logits rows, as numpy (a pure function of the scheduled requests)."""

from __future__ import annotations

import numpy as np

from glm53.actors.forward_batch import slot_mapping_for
from glm53.actors.sampler import build_sampling_inputs
from glm53.actors.step import StepInput

from .scheduler import SchedulerOutput


def _banned(request, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Stop tokens may not be drawn before min_tokens outputs exist."""
    params = request.params
    if len(request.output_ids) >= params.min_tokens:
        return ()
    return params.stop_token_ids + (() if params.ignore_eos else eos_ids)


def build_step_input(step_id: int, out: SchedulerOutput, block_size: int,
                     eos_ids: tuple[int, ...] = ()) -> StepInput:
    scheduled = out.scheduled
    lengths = np.array([s.num_tokens for s in scheduled], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_ids, positions = [], []
    for s in scheduled:
        start = s.request.num_computed_tokens
        token_ids.extend(s.request.token_ids(start, start + s.num_tokens))
        positions.append(np.arange(start, start + s.num_tokens, dtype=np.int64))
    pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    width = max((len(s.request.block_ids) for s in scheduled), default=1)
    tables = np.zeros((len(scheduled), width), dtype=np.int32)  # block 0 = null (padding)
    for i, s in enumerate(scheduled):
        tables[i, : len(s.request.block_ids)] = s.request.block_ids
    query_seq = np.repeat(np.arange(len(scheduled)), lengths)

    samplers = [i for i, s in enumerate(scheduled) if s.samples]
    sampling = build_sampling_inputs([
        (r.params, r.seed, len(r.output_ids), r.prompt_ids, r.output_ids, _banned(r, eos_ids))
        for r in (scheduled[i].request for i in samplers)
    ])

    pl_rows, pl_targets, pl_seqs, pl_k = [], [], [], []
    for i, s in enumerate(scheduled):
        r = s.request
        if r.params.prompt_logprobs is None:
            continue
        start = r.num_computed_tokens
        # positions p whose next token is a prompt token, not reported before (recompute)
        first = max(start, r.num_prompt_logprobs_done)
        last = min(start + s.num_tokens, len(r.prompt_ids) - 1)
        if last > first:
            pl_rows.append(cu[i] + np.arange(first, last) - start)
            pl_targets.append(np.asarray(r.prompt_ids[first + 1:last + 1], dtype=np.int64))
            pl_seqs.append(np.full(last - first, i))
            pl_k.append(np.full(last - first, r.params.prompt_logprobs))

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return StepInput(
        step_id=step_id,
        request_ids=[s.request.request_id for s in scheduled],
        token_ids=np.asarray(token_ids, dtype=np.int64),
        positions=pos,
        cu_seqlens=cu,
        block_tables=tables,
        slot_mapping=slot_mapping_for(pos, query_seq, tables, block_size),
        state_ids=np.array([s.request.state_slot for s in scheduled], dtype=np.int64),
        sample_rows=(cu[1:] - 1)[samplers].astype(np.int64),
        sample_seqs=np.asarray(samplers, dtype=np.int64),
        sampling=sampling,
        prompt_logprob_rows=cat(pl_rows, np.int64),
        prompt_logprob_targets=cat(pl_targets, np.int64),
        prompt_logprob_seqs=cat(pl_seqs, np.int64),
        prompt_logprob_k=cat(pl_k, np.int32),
    )
