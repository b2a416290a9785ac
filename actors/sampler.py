"""The engine's sampler: logits rows + SamplingInputs -> sampled token ids and logprobs.

Owns building `SamplingInputs` from per-request rows, moving them to the device in a few
packed copies, picking the ops a batch needs from the host-side numpy values (never a device
sync per row), and the logprobs of the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from glm53.kernels import ops

from .step import Logprobs, SamplingInputs, SamplingParams
from .transfers import to_device

# (params, seed, position of the output token being sampled, prompt ids, output ids so far,
#  ids banned from this draw)
SamplingRow = tuple[SamplingParams, int, int, Sequence[int], Sequence[int], Sequence[int]]


def _int64(seed: int) -> int:
    """Any Python int as the int64 with the same low 64 bits (seeds in int64 range unchanged)."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def _ragged(seqs: list[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated int64 ids [sum] and their [len(seqs)+1] offsets."""
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    ids = [np.asarray(s, np.int64) for s in seqs]
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), offsets


def build_sampling_inputs(rows: Sequence[SamplingRow],
                          token_bitmask: np.ndarray | None = None) -> SamplingInputs:
    """One `SamplingInputs` row per (params, seed, position, prompt_ids, output_ids, banned),
    and the rows' allowed-token bitmask [R, W] int32 if any row is constrained.

    The seed is the request's (the engine draws one for unseeded requests), wrapped to int64.
    Penalty context is carried only for rows that use penalties; the others get empty ranges.
    """
    params = [r[0] for r in rows]
    context = [(r[3], r[4]) if p.uses_penalties else ((), ()) for r, p in zip(rows, params,
                                                                              strict=True)]
    prompt_ids, prompt_offsets = _ragged([c[0] for c in context])
    output_ids, output_offsets = _ragged([c[1] for c in context])
    banned_ids, banned_offsets = _ragged([r[5] for r in rows])

    def column(name: str, dtype: type) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype)

    return SamplingInputs(
        temperature=column("temperature", np.float32),
        top_p=column("top_p", np.float32),
        top_k=column("top_k", np.int32),
        min_p=column("min_p", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        seeds=np.array([_int64(r[1]) for r in rows], np.int64),
        positions=np.array([r[2] for r in rows], np.int64),
        num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params],
                              np.int32),
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        output_ids=output_ids,
        output_offsets=output_offsets,
        banned_ids=banned_ids,
        banned_offsets=banned_offsets,
        token_bitmask=token_bitmask,
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """logits [R, V] with the tokens bitmask [R, W] int32 does not allow set to -inf (bit b of
    word w allows token 32 w + b; vocabulary rows past 32 W are not allowed). One copy of the
    packed mask to the device, unpacked there."""
    words = to_device(bitmask, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


def _device(floats: list[np.ndarray], ints: list[np.ndarray],
            device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 copies of `floats` and int64 copies of `ints` (1-D, any lengths) on the device, in
    one transfer (each copy outside the step's graph is a gap in the device's queue)."""
    i = np.concatenate([a.astype(np.int64) for a in ints] + [np.zeros(0, np.int64)])
    f = np.concatenate([a.astype(np.float32) for a in floats] + [np.zeros(0, np.float32)])
    packed = to_device(np.concatenate([i.view(np.uint8), f.view(np.uint8)]), device)
    return (list(packed[i.nbytes:].view(torch.float32).split([len(a) for a in floats])),
            list(packed[:i.nbytes].view(torch.int64).split([len(a) for a in ints])))


def gather_logprobs(logprobs: torch.Tensor, ids: torch.Tensor, k: int) -> Logprobs:
    """Numpy `Logprobs` of ids [R] under logprobs [R, V] (already log-softmaxed).

    Rank = 1 + the number of tokens with a strictly greater logprob; top-k sorted best first
    (tokens masked to -inf can fill it when fewer than k survive).
    """
    chosen = logprobs.gather(1, ids.unsqueeze(1))
    ranks = 1 + (logprobs > chosen).sum(dim=-1)
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return Logprobs(token_logprobs=chosen.squeeze(1).cpu().numpy(), ranks=ranks.cpu().numpy(),
                    top_ids=top_ids.cpu().numpy(), top_logprobs=top_lp.cpu().numpy())


class Sampler:
    """Samples one token per logits row; stateless, so one instance serves every step."""

    def __call__(
        self, logits: torch.Tensor, inputs: SamplingInputs, with_probs: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Logprobs | None] | tuple[torch.Tensor, Logprobs | None,
                                                      torch.Tensor]:
        """logits [R, V] -> ([R] int64 ids on logits' device, Logprobs or None), plus with
        `with_probs` the distribution each row was drawn from ([R, V]; one-hot for greedy
        rows), which speculative rejection sampling needs. `out` ([R] int64): the ids are
        written there (greedy: by the argmax itself) and it is what is returned.

        Penalties run only if a row uses them, temperature/truncation and noise only if a row
        is not greedy. Logprobs (numpy) come only if a row asks (num_logprobs >= 0), from
        log_softmax of the processed logits (penalised only, for greedy rows), with K = the
        largest request: rows asking fewer carry extra columns.
        """
        s, device = inputs, logits.device
        logits = logits.float()
        # parameters go to the device only for the ops that read them: an all-greedy step
        # (argmax) copies nothing
        if len(s.banned_ids):
            rows = np.repeat(np.arange(len(s.banned_offsets) - 1), np.diff(s.banned_offsets))
            index = to_device(np.stack([rows, s.banned_ids]), device)
            logits = logits.index_put((index[0], index[1]),
                                      torch.tensor(float("-inf"), device=device))
        if s.token_bitmask is not None:
            logits = apply_token_bitmask(logits, s.token_bitmask)
        if np.any((s.presence_penalty != 0) | (s.frequency_penalty != 0)
                  | (s.repetition_penalty != 1)):
            (presence, frequency, repetition), (
                prompt_ids, prompt_offsets, output_ids, output_offsets) = _device(
                [s.presence_penalty, s.frequency_penalty, s.repetition_penalty],
                [s.prompt_ids, s.prompt_offsets, s.output_ids, s.output_offsets], device)
            logits = ops.apply_penalties(logits, presence, frequency, repetition, prompt_ids,
                                         prompt_offsets, output_ids, output_offsets)
        if np.all(s.temperature == 0):
            processed = logits
            ids = logits.argmax(dim=-1) if out is None else torch.argmax(logits, -1, out=out)
        else:
            (temperature, top_p, min_p), (top_k, seeds, positions) = _device(
                [s.temperature, s.top_p, s.min_p], [s.top_k, s.seeds, s.positions], device)
            processed = ops.process_logits(logits, temperature, top_k, top_p, min_p)
            ids = ops.sample(processed, temperature, seeds, positions)
            if out is not None:
                ids = out.copy_(ids)
        logprobs = None
        if np.any(s.num_logprobs >= 0):
            logprobs = gather_logprobs(torch.log_softmax(processed, dim=-1), ids,
                                       int(s.num_logprobs.max()))
        if not with_probs:
            return ids, logprobs
        probs = torch.softmax(processed, dim=-1)
        greedy = np.flatnonzero(s.temperature == 0)
        if len(greedy):
            rows = to_device(greedy, device)
            probs[rows] = F.one_hot(ids[rows], probs.shape[-1]).to(probs.dtype)
        return ids, logprobs, probs
