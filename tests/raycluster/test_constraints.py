"""Output constraints in the engine (raycluster/constraints.py) on the tiny model: sampled
output always parses and validates against a JSON schema (nested objects, enums, arrays); a
speculative engine gives the same constrained output as a plain one; a thinking budget forces
the reasoning-end token; drafts the grammar refuses get masked verify rows."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from glm53.actors.step import SamplingParams, StructuredOutput
from glm53.deployments.tiny_tokenizer import SPECIAL_TOKEN_IDS
from glm53.deployments.tokenizer import decode
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.constraints import ConstraintError, OutputConstraints
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.scheduler import RequestRejectedError

THINK_END = SPECIAL_TOKEN_IDS["</think>"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "eel"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
GREEDY_JSON = SamplingParams(max_tokens=120, temperature=0.0, structured_output=JSON_SCHEMA)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _engine(tiny, tokenizer, k: int = 0, **kw) -> LLMEngine:
    spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
    config = EngineConfig(model=tiny, num_blocks=256, max_num_batched_tokens=64,
                          max_num_seqs=8, **spec, **kw)
    probe = LLMEngine(config)  # the model's vocabulary and eos ids
    constraints = OutputConstraints.from_tokenizer(
        tokenizer, probe.model_config.vocab_size, probe.eos_ids, THINK_END)
    return LLMEngine(config, probe.executor, constraints)


@pytest.fixture(scope="module")
def engine(tiny, tokenizer):
    return _engine(tiny, tokenizer)


def _prompts(tokenizer, n):
    return [tokenizer.encode(f"Describe pet {i} as JSON:", add_special_tokens=False)
            for i in range(n)]


def test_sampled_json_always_validates(engine, tokenizer):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                             structured_output=JSON_SCHEMA) for i in range(24)]
    outputs = engine.generate(_prompts(tokenizer, 24), params)
    for out in outputs:
        assert out[-1] in engine.eos_ids  # the grammar finished, then the model stopped
        value = json.loads(decode(tokenizer, out[:-1]))
        jsonschema.validate(value, SCHEMA)


def test_unconstrained_output_is_not_json(engine, tokenizer):
    """The check above can fail: the same tiny model without the grammar writes no JSON."""
    outputs = engine.generate(_prompts(tokenizer, 4),
                              SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    for out in outputs:
        with pytest.raises(ValueError):
            json.loads(decode(tokenizer, out))


@pytest.fixture(scope="module")
def plain_greedy(engine, tokenizer):
    """The plain engine's constrained greedy outputs: both draft samplings below must give
    these (deterministic, so computed once)."""
    prompts = _prompts(tokenizer, 4)
    return prompts, engine.generate(prompts, GREEDY_JSON)


@pytest.mark.parametrize("sampling", ["greedy", "probabilistic"])
def test_speculative_constrained_equals_plain(tiny, tokenizer, plain_greedy, sampling):
    prompts, plain = plain_greedy
    spec = _engine(tiny, tokenizer, k=3, draft_sampling=sampling)
    assert spec.generate(prompts, GREEDY_JSON) == plain
    assert spec.spec_stats.num_drafts > 0


def test_thinking_budget_forces_reasoning_end(engine, tokenizer):
    """Reasoning stops at the budget with `</think>`; the answer after it follows the grammar.
    min_tokens keeps the tiny model from ending its turn inside the reasoning, and yields to
    the grammar once the answer is complete (only a stop token is left then)."""
    regex = StructuredOutput("regex", "(yes|no)")
    for budget in (0, 3, 9):
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=budget, reasoning=True,
                                thinking_budget=budget, structured_output=regex,
                                min_tokens=budget + 6)
        (out,) = engine.generate(_prompts(tokenizer, 1), params)
        end = out.index(THINK_END)
        assert end == budget  # the tiny model never closes reasoning by itself
        assert decode(tokenizer, out[end + 1:-1]) in ("yes", "no")
        assert out[-1] in engine.eos_ids


def test_verify_rows_follow_the_drafts(engine, tokenizer):
    """Row j of a verify step is masked as after drafts[:j]; after a refused draft, rows are
    unconstrained; the matcher is unchanged afterwards."""
    constraint = engine.constraints.for_request(
        SamplingParams(structured_output=StructuredOutput("regex", "ab(c|d)")))
    a, b, c, x = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    words = constraint.words
    bitmask = np.full((5, words), -1, dtype=np.int32)

    def allowed(row):
        bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    constraint.fill(bitmask, 0, [a, b, x, c])
    assert allowed(0) == {a} and allowed(1) == {b}
    assert allowed(2) == {c, tokenizer.encode("d", add_special_tokens=False)[0]}
    assert len(allowed(3)) == 32 * words  # after the refused draft x
    bitmask[:] = -1
    constraint.fill(bitmask, 1, [])
    assert allowed(1) == {a}  # the drafts were rolled back


def test_bad_constraints_are_refused(engine, tokenizer):
    prompt = _prompts(tokenizer, 1)[0]
    with pytest.raises(ConstraintError, match="json schema"):
        engine.add_request(prompt, SamplingParams(
            structured_output=StructuredOutput("json_schema", "{not json")))
    with pytest.raises(ConstraintError, match="regex"):
        engine.add_request(prompt, SamplingParams(
            structured_output=StructuredOutput("regex", "(unclosed")))
    with pytest.raises(ValueError, match="needs a spec"):
        StructuredOutput("json_schema")
    bare = LLMEngine(engine.config, engine.executor)
    with pytest.raises(RequestRejectedError, match="output constraints"):
        bare.add_request(prompt, SamplingParams(structured_output=JSON_SCHEMA))
