"""SchedulerOutput -> StepInput: flat token ids, positions, block tables, slot mapping, state
slots, sampling arrays and logits rows, as numpy (a pure function of the scheduled requests).

A token still in flight (a placeholder: the step before samples it, overlapped scheduling) goes
in as -1 with the previous step's sample row that holds it; the worker fills it on the device.
In a speculative engine the sequence names the previous step's sequence it continues instead,
and the worker settles its tokens and positions (actors/overlap.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from glm53.actors.forward_batch import slot_mapping_for
from glm53.actors.sampler import build_sampling_inputs
from glm53.actors.step import StepImage, StepInput

from .constraints import fold_banned
from .request import Request
from .scheduler import SchedulerOutput


def _banned(request, eos_ids: tuple[int, ...], n_out: int) -> tuple[int, ...]:
    """Stop tokens may not be drawn before min_tokens outputs exist."""
    params = request.params
    if n_out >= params.min_tokens:
        return ()
    return params.stop_token_ids + (() if params.ignore_eos else eos_ids)


def build_step_input(step_id: int, out: SchedulerOutput, block_size: int,
                     eos_ids: tuple[int, ...] = (), num_spec: int = 0,
                     max_model_len: int | None = None,
                     in_flight: Mapping[Request, tuple[int, int, int]] | None = None,
                     num_propose: int | None = None) -> StepInput:
    """With `num_spec` > 0 every sampling sequence samples each of its 1 + k verify rows (row j
    as output token len(output) + j, after the drafts before it) and asks the proposer for up
    to `num_propose` (default num_spec) drafts. `in_flight`: for each request with
    placeholders, its sequence index, first sample row and drafts verified in the step in
    flight (whose samples the placeholders are). A speculating sequence names the sequence it
    continues (`previous_seqs`: the worker settles it from that step's acceptance) unless
    neither step verifies a draft of it: then its one placeholder is that step's sample,
    filled on the device like a plain engine's, and the step need not wait for acceptance."""
    scheduled = out.scheduled
    lengths = np.array([s.num_tokens for s in scheduled], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_ids, positions, fill_rows, fill_sources = [], [], [], []
    previous_seqs = np.full(len(scheduled), -1, dtype=np.int64)
    for i, s in enumerate(scheduled):
        r = s.request
        start = r.num_computed_tokens
        token_ids.extend(r.token_ids(start, start + s.num_tokens))
        positions.append(np.arange(start, start + s.num_tokens, dtype=np.int64))
        # placeholders are at positions num_tokens .. num_tokens + num_placeholders - 1
        first = max(start, r.num_tokens)
        last = min(start + s.num_tokens, r.num_tokens + r.num_placeholders)
        if last > first:
            if in_flight is None or r not in in_flight:
                raise ValueError(f"request {r.request_id} has placeholders but no step in "
                                 f"flight samples them")
            seq, row, verified = in_flight[r]
            if verified or s.num_drafts:
                previous_seqs[i] = seq
                continue
            fill_rows.extend(range(cu[i] + first - start, cu[i] + last - start))
            base = row - r.num_tokens
            fill_sources.extend(range(base + first, base + last))
    pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    width = max((len(s.request.block_ids) for s in scheduled), default=1)
    tables = np.zeros((len(scheduled), width), dtype=np.int32)  # block 0 = null (padding)
    for i, s in enumerate(scheduled):
        table = s.request.block_table()
        tables[i, : len(table)] = table
    query_seq = np.repeat(np.arange(len(scheduled)), lengths)
    resets, updates = _block_table_delta(scheduled)

    sample_rows, sample_seqs, sampling_rows, constrained = [], [], [], []
    for i, s in enumerate(scheduled):
        if not s.samples:
            continue
        r, k = s.request, s.num_drafts
        if r.constraint is not None:
            constrained.append((r, len(sample_rows), r.draft_ids[:k]))
        for j in range(k + 1):
            n_out = len(r.output_ids) + r.num_placeholders + j
            sample_rows.append(cu[i + 1] - 1 - k + j)
            sample_seqs.append(i)
            # the output so far only matters to penalties (copying it is O(output) a row)
            seen = r.output_ids + r.draft_ids[:j] if r.params.uses_penalties else ()
            sampling_rows.append((r.params, r.seed, n_out, r.prompt_ids, seen,
                                  _banned(r, eos_ids, n_out)))
    bitmask = None
    if constrained:
        words = constrained[0][0].constraint.words
        bitmask = np.full((len(sample_rows), words), -1, dtype=np.int32)
        for r, first_row, drafts in constrained:
            r.constraint.fill(bitmask, first_row, drafts)
            for row in range(first_row, first_row + len(drafts) + 1):
                if banned := sampling_rows[row][5]:  # into the mask, where it may yield
                    fold_banned(bitmask[row], banned)
                    sampling_rows[row] = (*sampling_rows[row][:5], ())
    sampling = build_sampling_inputs(sampling_rows, bitmask)

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
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sample_seqs=np.asarray(sample_seqs, dtype=np.int64),
        sampling=sampling,
        prompt_logprob_rows=cat(pl_rows, np.int64),
        prompt_logprob_targets=cat(pl_targets, np.int64),
        prompt_logprob_seqs=cat(pl_seqs, np.int64),
        prompt_logprob_k=cat(pl_k, np.int32),
        placeholder_rows=np.asarray(fill_rows, dtype=np.int64) if fill_rows else None,
        placeholder_sources=np.asarray(fill_sources, dtype=np.int64) if fill_rows else None,
        block_table_resets=resets,
        block_table_updates=updates,
        previous_seqs=previous_seqs if (previous_seqs >= 0).any() else None,
        images=_images(scheduled, cu),
        **(_speculation(scheduled, num_spec, max_model_len,
                        num_spec if num_propose is None else num_propose) if num_spec else {}),
    )


def _images(scheduled, cu: np.ndarray) -> tuple[StepImage, ...]:
    """The images whose placeholders fall in each sequence's chunk, with the part of each that
    does (a chunk may end inside an image: the worker embeds the whole image and splices the
    rows of this chunk)."""
    out = []
    for i, s in enumerate(scheduled):
        start = s.request.num_computed_tokens
        end = start + s.num_tokens
        for k, image in enumerate(s.request.images):
            lo, hi = max(start, image.offset), min(end, image.offset + image.num_tokens)
            if lo < hi:
                out.append(StepImage(f"{s.request.request_id}/{k}", image, lo - image.offset,
                                     hi - image.offset, cu[i] + np.arange(lo, hi) - start))
    return tuple(out)


def _block_table_delta(scheduled) -> tuple[np.ndarray, np.ndarray]:
    """(state slots whose workers' row restarts, (slot, column, block) rows): each request's
    blocks past those its slot's row already holds (commit records them as sent)."""
    resets, updates = [], []
    for s in scheduled:
        r = s.request
        sent = r.num_blocks_sent
        if sent == 0:
            resets.append(r.state_slot)
        for col in range(sent, len(r.block_ids)):
            updates.append((r.state_slot, col, r.block_ids[col]))
    return (np.asarray(resets, dtype=np.int64),
            np.asarray(updates, dtype=np.int64).reshape(-1, 3))


def _speculation(scheduled, num_spec: int, max_model_len: int,
                 num_propose: int) -> dict[str, np.ndarray]:
    """Drafts to verify, the prompt token after each non-sampling chunk, and how many drafts
    each sequence may get next (none past max_model_len or max_tokens)."""
    n = len(scheduled)
    draft_ids = np.full((n, num_spec), -1, dtype=np.int64)
    next_tokens = np.full(n, -1, dtype=np.int64)
    propose = np.zeros(n, dtype=np.int64)
    for i, s in enumerate(scheduled):
        r = s.request
        draft_ids[i, : s.num_drafts] = r.draft_ids[: s.num_drafts]
        end = r.num_computed_tokens + s.num_tokens
        if not s.samples:
            next_tokens[i] = r.token_ids(end, end + 1)[0]
            continue
        room = min(max_model_len - end - 1, r.params.max_tokens - len(r.output_ids) - 1)
        propose[i] = max(0, min(num_propose, room))
    return {"num_drafts": np.array([s.num_drafts for s in scheduled], dtype=np.int64),
            "draft_ids": draft_ids, "next_tokens": next_tokens, "propose": propose}
