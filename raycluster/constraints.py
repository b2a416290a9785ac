"""Per-request output constraints: a grammar on the answer (xgrammar) and a thinking budget.

A constrained request's sample rows carry a bitmask of the tokens they may draw (32 tokens per
int32 word, xgrammar's layout), which the sampler applies to the logits before anything else.
Masks are filled on the host while the step is built, from the request's emitted tokens; a
verify step's row j also follows the drafts before it (accepted into the grammar matcher, then
rolled back), so a draft the grammar refuses meets a target row that cannot draw it and is
rejected. No mask needs anything from the device, so constraints add no host sync.

Reasoning: when the output starts inside the model's reasoning block (`params.reasoning`), the
grammar applies only after the reasoning-end token (`</think>`), and a thinking budget allows
only that token once the reasoning holds `thinking_budget` tokens.

Grammars come from xgrammar's compiler (its cache makes a repeated schema free). JSON is
compiled without free whitespace: a model may otherwise pad JSON with whitespace until
max_tokens, a known failure of grammar-constrained decoding. (xgrammar 0.2.9 lets strings
with maxLength hold raw control characters; use `pattern` for strict strings.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np
import xgrammar as xgr

from glm53.actors.step import SamplingParams, StructuredOutput

from .scheduler import RequestRejectedError

logger = logging.getLogger(__name__)


JSON_OBJECT = '{"type": "object"}'  # kind "json": OpenAI's JSON mode, any JSON object


class ConstraintError(RequestRejectedError):
    """A schema, pattern or grammar that cannot be compiled (the request is refused)."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def fold_banned(row: np.ndarray, banned: Sequence[int]) -> None:
    """Clear the banned tokens' bits in one mask row [W] (stop tokens before min_tokens),
    unless that leaves no token: a finished grammar allows only stop tokens, and stopping
    then beats an output that no longer matches."""
    ids = np.asarray(banned, dtype=np.int64)
    kept = row.view(np.uint32).copy()
    np.bitwise_and.at(kept, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
    if kept.any():
        row[:] = kept.view(np.int32)


class OutputConstraints:
    """The engine's grammar compiler and reasoning-end token; makes each request's
    `RequestConstraint`. Built by the serving layer, which owns the tokenizer:
    `OutputConstraints.from_tokenizer(tokenizer, vocab_size, stop_ids, reasoning_end_id)`."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, reasoning_end_id: int | None) -> None:
        self.vocab_size = tokenizer_info.vocab_size
        self.reasoning_end_id = reasoning_end_id
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_ids: Sequence[int],
                       reasoning_end_id: int | None) -> OutputConstraints:
        """tokenizer: a transformers tokenizer; vocab_size: the logits' width (the model's
        vocabulary, which may exceed the tokenizer's); stop_ids: the tokens that end an
        answer (a finished grammar allows only these)."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids))
        return cls(info, reasoning_end_id)

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by xgrammar); ConstraintError for a bad spec."""
        try:
            if structured.kind in ("json", "json_schema"):
                spec = structured.spec if structured.kind == "json_schema" else JSON_OBJECT
                json.loads(spec)  # a clear message for text that is not JSON
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if structured.kind == "regex":
                return self._compiler.compile_regex(structured.spec)
            return self._compiler.compile_grammar(structured.spec)
        except (RuntimeError, ValueError) as exc:
            raise ConstraintError(f"invalid {structured.kind.replace('_', ' ')}: "
                                  f"{str(exc).splitlines()[0][:300]}") from None

    def for_request(self, params: SamplingParams) -> RequestConstraint | None:
        """The request's constraint state, or None when nothing constrains it."""
        budget = params.thinking_budget if params.reasoning else None
        if params.structured_output is None and budget is None:
            return None
        if params.reasoning and self.reasoning_end_id is None:
            raise RequestRejectedError("this model has no reasoning-end token: structured "
                                       "output after reasoning and thinking budgets need one")
        matcher = None
        if params.structured_output is not None:
            matcher = xgr.GrammarMatcher(self.compile(params.structured_output))
        return RequestConstraint(matcher, mask_words(self.vocab_size), params.reasoning,
                                 budget, self.reasoning_end_id)


class RequestConstraint:
    """One request's grammar matcher and reasoning counters, advanced by emitted tokens."""

    def __init__(self, matcher: xgr.GrammarMatcher | None, words: int, in_reasoning: bool,
                 thinking_budget: int | None, reasoning_end_id: int | None) -> None:
        self.matcher = matcher
        self.words = words
        self.in_reasoning = in_reasoning
        self.reasoning_tokens = 0
        self.thinking_budget = thinking_budget
        self.reasoning_end_id = reasoning_end_id

    def fill(self, bitmask: np.ndarray, first_row: int, drafts: Sequence[int]) -> None:
        """bitmask[first_row + j] (int32 [R, W], rows preset to all ones) = the tokens allowed
        after the emitted output and drafts[:j], for j = 0..len(drafts). Rows after a draft
        the constraint refuses stay unconstrained: verification stops at that draft."""
        in_reasoning, n_reasoning = self.in_reasoning, self.reasoning_tokens
        accepted = 0
        try:
            for j in range(len(drafts) + 1):
                row = first_row + j
                if in_reasoning:
                    forced = (self.thinking_budget is not None
                              and n_reasoning >= self.thinking_budget)
                    if forced:
                        self._allow_only(bitmask[row], self.reasoning_end_id)
                elif self.matcher is not None and not self.matcher.is_terminated():
                    self.matcher.fill_next_token_bitmask(bitmask, row)
                if j == len(drafts):
                    break
                token = drafts[j]
                if in_reasoning:
                    if token == self.reasoning_end_id:
                        in_reasoning = False
                    elif forced:
                        break
                    else:
                        n_reasoning += 1
                elif self.matcher is not None:
                    if not self.matcher.accept_token(token):
                        break
                    accepted += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)

    def advance(self, token: int) -> None:
        """Follow one emitted token (drawn under this constraint's masks)."""
        if self.in_reasoning:
            if token == self.reasoning_end_id:
                self.in_reasoning = False
            else:
                self.reasoning_tokens += 1
        elif (self.matcher is not None and not self.matcher.is_terminated()
              and not self.matcher.accept_token(token)):
            # the masks allowed it, so the sampler and the grammar disagree
            logger.error("the grammar refused emitted token %d", token)

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: the output is complete (min_tokens yields)."""
        return self.matcher is not None and self.matcher.is_terminated()

    @staticmethod
    def _allow_only(row: np.ndarray, token: int) -> None:
        row[:] = 0
        row[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
