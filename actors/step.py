"""The data that crosses the actor boundary: SamplingParams, StepInput, StepOutput.

Plain dataclasses of ints and numpy arrays (picklable, no tensors): the engine builds one
StepInput per step, every rank receives the same one, rank 0 answers with a StepOutput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
STRUCTURED_KINDS = ("json", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (after reasoning, when the output starts in it).
    kind: "json" (any JSON object; spec unused), "json_schema" (spec: the schema as JSON text),
    "regex" (spec: the pattern), "grammar" (spec: EBNF in xgrammar's GBNF dialect)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"not {self.kind!r}")
        if self.kind != "json" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a spec")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules (OpenAI/vLLM semantics)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token (0 = sampled only)
    prompt_logprobs: int | None = None  # same for every prompt token after the first
    structured_output: StructuredOutput | None = None  # the engine masks tokens it forbids
    # the output starts inside the model's reasoning block (the prompt opened it): the
    # structured output applies after the reasoning-end token, and with thinking_budget the
    # engine forces that token once the reasoning holds thinking_budget tokens
    reasoning: bool = False
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
        for name in floats:  # NaN passes every comparison below as False, so say it here
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        checks = [
            # the sampler carries top_k and token counts as int32, seeds and token ids as int64
            (1 <= self.max_tokens <= INT32_MAX, f"max_tokens must be in [1, {INT32_MAX}]"),
            (self.top_k <= INT32_MAX, f"top_k must be <= {INT32_MAX}"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             "seed must fit in a signed 64-bit integer"),
            (all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "stop_token_ids must be token ids (>= 0)"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be in [0, 20]"),
            (self.thinking_budget is None or 0 <= self.thinking_budget <= INT32_MAX,
             f"thinking_budget must be in [0, {INT32_MAX}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass(frozen=True)
class SamplingInputs:
    """One row per logits row that samples a token (R rows), as numpy arrays.

    Penalty context is ragged: row r's prompt ids are prompt_ids[prompt_offsets[r]:
    prompt_offsets[r+1]] (likewise output ids); rows without penalties have empty ranges.
    `seeds` and `positions` (index of the output token being sampled) make each draw a pure
    function of the request, whatever else is in the batch.
    """

    temperature: np.ndarray  # [R] float32
    top_p: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] int32 (0 = off)
    min_p: np.ndarray  # [R] float32
    presence_penalty: np.ndarray  # [R] float32
    frequency_penalty: np.ndarray  # [R] float32
    repetition_penalty: np.ndarray  # [R] float32
    seeds: np.ndarray  # [R] int64
    positions: np.ndarray  # [R] int64
    num_logprobs: np.ndarray  # [R] int32, -1 = none
    prompt_ids: np.ndarray  # [sum] int64
    prompt_offsets: np.ndarray  # [R+1] int64
    output_ids: np.ndarray  # [sum] int64
    output_offsets: np.ndarray  # [R+1] int64
    # tokens that must not be sampled yet (eos / stop ids before min_tokens), ragged likewise
    banned_ids: np.ndarray  # [sum] int64
    banned_offsets: np.ndarray  # [R+1] int64
    # allowed tokens per row (structured output, thinking budget): bit b of word w allows
    # token 32 w + b (xgrammar's layout); None when no row is constrained (all bits set)
    token_bitmask: np.ndarray | None = None  # [R, ceil(V / 32)] int32


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: the processor's patches, and the consecutive prompt positions
    offset .. offset + num_tokens - 1 of its placeholders, which its embeddings replace."""

    pixel_values: np.ndarray  # [P, patch_dim] float32
    grid_thw: tuple[int, int, int]  # patches: (frames, rows, columns)
    offset: int
    num_tokens: int
    digest: str  # identity of the pixels (prefix caching keys image blocks by it)


@dataclass(frozen=True)
class StepImage:
    """An image some of whose placeholders a step computes: rows start..end-1 of its
    embeddings go to the step's flat token rows `rows`. The pixels come with every step that
    needs them, so a worker may recompute rather than remember; `key` (request id / image
    index) lets it keep the embeddings between the chunks of one prefill instead."""

    key: str
    image: ImageInput
    start: int
    end: int
    rows: np.ndarray  # [end - start] int64


@dataclass(frozen=True)
class StepInput:
    """Everything one forward step needs, for all ranks. T tokens, N sequences."""

    step_id: int
    request_ids: list[str]  # [N]
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    cu_seqlens: np.ndarray  # [N+1] int64
    block_tables: np.ndarray  # [N, max_blocks] int32 (null block 0 pads)
    slot_mapping: np.ndarray  # [T] int64
    state_ids: np.ndarray  # [N] int64
    sample_rows: np.ndarray  # [R] int64 token rows whose logits are sampled
    sample_seqs: np.ndarray  # [R] int64 sequence index of each sampled row
    sampling: SamplingInputs
    # prompt logprobs: token rows whose next-token logprob is reported, and the target ids
    prompt_logprob_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_logprob_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_logprob_seqs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_logprob_k: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # speculative decoding: sequence i's last num_drafts[i] tokens are drafts to verify
    # (draft_ids[i, :num_drafts[i]]); its sample rows are then all 1 + num_drafts[i] rows
    num_drafts: np.ndarray | None = None  # [N] int64
    draft_ids: np.ndarray | None = None  # [N, K] int64, -1 padded
    # for the MTP proposer: the prompt token after a chunk that does not sample (-1 otherwise),
    # and how many drafts each sequence wants for its next step
    next_tokens: np.ndarray | None = None  # [N] int64
    propose: np.ndarray | None = None  # [N] int64
    images: tuple[StepImage, ...] = ()  # image embeddings that replace placeholder rows
    # overlapped scheduling: token rows whose ids (-1 in token_ids) are samples of the step
    # executed just before this one, and those samples' rows in it (the worker keeps them on
    # the device, so the engine never waits for them)
    placeholder_rows: np.ndarray | None = None  # [P] int64
    placeholder_sources: np.ndarray | None = None  # [P] int64
    # overlapped speculative steps: the sequence of the step before that each sequence
    # continues (-1: none); its tokens and positions are settled by actors/overlap.py
    previous_seqs: np.ndarray | None = None  # [N] int64
    # what changed in the block tables the workers keep per state slot since the last step:
    # slots whose row is reset (a new owner), then (slot, column, block) entries set. None:
    # none kept by the sender; a worker that keeps them writes the whole block_tables rows
    block_table_resets: np.ndarray | None = None  # [S] int64
    block_table_updates: np.ndarray | None = None  # [D, 3] int64
    # KDA state copies (source slot, destination slot), applied in order before the forward:
    # a prefix-cache checkpoint saved from a sequence's slot, or restored into a new one
    state_copies: np.ndarray | None = None  # [C, 2] int64

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class Logprobs:
    """Logprobs of chosen tokens: [R] chosen logprob and rank, [R, K] top-K ids/logprobs."""

    token_logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class StepOutput:
    step_id: int
    sampled: np.ndarray  # [R] int64, one per sample row (StepInput.sample_seqs order)
    logprobs: Logprobs | None = None  # for sample rows (rows not asking have K = 0 / junk)
    prompt_logprobs: Logprobs | None = None  # for StepInput.prompt_logprob_rows
    num_accepted: np.ndarray | None = None  # [N] drafts accepted (speculative steps)
    draft_ids: np.ndarray | None = None  # [N, K] drafts for the next step, -1 padded
