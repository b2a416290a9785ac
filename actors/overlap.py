"""A speculative step scheduled before its predecessor's result (overlapped scheduling).

The engine builds step N+1 while step N verifies drafts, as if every draft of step N were
accepted: a sequence of step N+1 that continues sequence j of step N (`previous_seqs`) starts
with the last token step N emits for j, then verifies the drafts step N proposed for it, at
positions that assume all of step N's drafts were accepted. The worker, which has step N's
output, settles that before running the step: with a accepted of k_N drafts, the sequence's
tokens are step N's last emitted token and new drafts, and its positions, cache slots and
sampling positions move back by k_N - a. Nothing else depends on the acceptance: the engine
overlaps only steps whose draft counts, proposals and banned tokens cannot (engine.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .forward_batch import slot_mapping_for
from .step import StepInput, StepOutput


def resolve_after(step: StepInput, previous: StepInput, output: StepOutput,
                  block_size: int) -> StepInput:
    """`step` with the tokens and positions of its sequences that continue `previous`'s, from
    `output` (previous's result: samples with the emitted tokens first, accepted counts,
    drafts). `previous` is as it ran (itself resolved)."""
    links = step.previous_seqs
    tokens, positions = step.token_ids.copy(), step.positions.copy()
    draft_ids = step.draft_ids.copy()
    sample_positions = step.sampling.positions.copy()
    seqs, first_rows = np.unique(previous.sample_seqs, return_index=True)
    first_row = dict(zip(seqs.tolist(), first_rows.tolist(), strict=True))
    for i in np.flatnonzero(links >= 0):
        j = int(links[i])
        accepted = int(output.num_accepted[j])
        shift = accepted - int(previous.num_drafts[j])
        start, end = int(step.cu_seqlens[i]), int(step.cu_seqlens[i + 1])
        k = int(step.num_drafts[i])
        drafts = output.draft_ids[j, :k]
        if k != end - start - 1 or (drafts < 0).any():
            raise ValueError(f"sequence {i} of step {step.step_id} verifies {k} drafts in "
                             f"{end - start} tokens, but step {previous.step_id} proposed "
                             f"{int((output.draft_ids[j] >= 0).sum())}")
        tokens[start] = output.sampled[first_row[j] + accepted]
        tokens[start + 1:end] = drafts
        draft_ids[i, :k] = drafts
        positions[start:end] += shift
        sample_positions[step.sample_seqs == i] += shift
    query_seq = np.repeat(np.arange(len(step.state_ids)), np.diff(step.cu_seqlens))
    return dataclasses.replace(
        step, token_ids=tokens, positions=positions, draft_ids=draft_ids,
        slot_mapping=slot_mapping_for(positions, query_seq, step.block_tables, block_size),
        sampling=dataclasses.replace(step.sampling, positions=sample_positions),
        previous_seqs=None)
