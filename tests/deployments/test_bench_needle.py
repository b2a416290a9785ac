"""`glm53 bench needle`: the haystack prompts (length, needle depth, edge depths, formats),
the scoring of crafted answers, and the command end to end on the tiny checkpoint, whose
random weights answer noise: the test checks the mechanics (every cell in the receipt, the
needle's ids where the receipt says, in the prompt the engine received), never a hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm53.deployments.cli import main
from glm53.deployments.needle import (
    NEEDLE,
    QUESTION,
    HaystackBuilder,
    holds_code,
    needle_codes,
    score_answer,
    split_reasoning,
)
from glm53.deployments.tokenizer import decode
from glm53.raycluster.api import LLMEngine

CODE = "40718263"


@pytest.fixture(scope="module")
def builder(tiny_tokenizer) -> HaystackBuilder:
    return HaystackBuilder(tiny_tokenizer)


@pytest.mark.parametrize("length", [300, 1000, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_lands_at_its_depth_in_a_prompt_of_the_asked_length(
        builder: HaystackBuilder, tiny_tokenizer, length: int, depth: float) -> None:
    prompt = builder.build(length, depth, CODE)
    sentence = max(builder.sentence_tokens)
    assert length - sentence <= len(prompt.ids) <= length
    start, end = prompt.needle
    assert decode(tiny_tokenizer, prompt.ids[start:end]) == NEEDLE.format(code=CODE)
    hay_start, hay_end = prompt.haystack
    filler = (hay_end - hay_start) - (end - start)
    assert abs((start - hay_start) - depth * filler) <= sentence  # within one filler sentence
    assert abs(prompt.needle_depth - depth) <= sentence / filler
    if depth == 0.0:
        assert start == hay_start  # before the first filler sentence
    if depth == 1.0:
        assert end == hay_end  # after the last one, right before the question
    text = decode(tiny_tokenizer, prompt.ids)
    assert text.startswith("[gMASK]<sop><|user|>\n")
    assert text.endswith(f"\n\n{QUESTION}<|assistant|>\n<think>") and prompt.opens_reasoning


def test_needle_placement_holds_for_a_merging_bpe_tokenizer() -> None:
    """The tiny tokenizer is one token per byte; a BPE with merges (trained here on the filler)
    joins characters across sentence edges, so token counts and spans come from offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from glm53.deployments.needle import FILLER
    from glm53.deployments.tiny_tokenizer import SPECIAL_TOKENS, chat_template

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(FILLER), NEEDLE, QUESTION], trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=chat_template())
    builder = HaystackBuilder(tokenizer)
    assert max(builder.sentence_tokens) < 30  # merged: far fewer tokens than bytes
    for depth in (0.0, 0.3, 1.0):
        prompt = builder.build(2000, depth, CODE)
        assert 2000 - max(builder.sentence_tokens) <= len(prompt.ids) <= 2000
        start, end = prompt.needle
        assert tokenizer.decode(prompt.ids[start:end]).strip() == NEEDLE.format(code=CODE)
        assert abs(prompt.needle_depth - depth) < 0.02


def test_prompt_formats_and_refusals(tiny_tokenizer) -> None:
    off = HaystackBuilder(tiny_tokenizer, thinking=False).build(400, 0.5, CODE)
    assert decode(tiny_tokenizer, off.ids).endswith("<think></think>")
    assert not off.opens_reasoning
    raw_builder = HaystackBuilder(tiny_tokenizer, chat=False)
    raw = raw_builder.build(400, 0.5, CODE)
    assert raw_builder.format == "raw" and not raw.opens_reasoning
    assert decode(tiny_tokenizer, raw.ids).endswith(f"\n\n{QUESTION}\nAnswer: ")
    with pytest.raises(ValueError, match="cannot hold the needle"):
        raw_builder.build(50, 0.5, CODE)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        raw_builder.build(400, 1.5, CODE)
    codes = needle_codes(6, seed=1)
    assert codes == needle_codes(6, seed=1) and len(set(codes)) == 6
    assert all(len(c) == 8 and c.isdigit() for c in codes)


@pytest.mark.parametrize(("reply", "reasoning", "finish", "outcome", "reasoning_hit"), [
    (CODE, "", "stop", "hit", False),
    (f"The code is {CODE}.", f"I see {CODE}", "stop", "hit", True),
    ("40,718,263", "", "stop", "hit", False),
    ("40 718 263", "", "length", "hit", False),
    ("140718263", "", "stop", "miss", False),  # not the code: a longer number
    ("4071826", "", "stop", "miss", False),
    ("I cannot find it", CODE, "stop", "miss", True),
    ("", f"the code is {CODE} so", "length", "unanswered", True),  # reasoning ran out
    ("", "", "stop", "miss", False),
])
def test_scoring_of_crafted_answers(reply: str, reasoning: str, finish: str, outcome: str,
                                    reasoning_hit: bool) -> None:
    score = score_answer(reply, reasoning, CODE, finish)
    assert (score.outcome, score.hit, score.reasoning_hit) == (
        outcome, outcome == "hit", reasoning_hit)
    assert holds_code(f"x{CODE}y", CODE) and not holds_code(f"9{CODE}", CODE)


def test_reasoning_splits_at_the_end_marker() -> None:
    start, end = 1, 2
    assert split_reasoning([5, 6, end, 7], True, start, end) == ([5, 6], [7])
    assert split_reasoning([5, 6], True, start, end) == ([5, 6], [])  # never ended
    assert split_reasoning([start, 5, end, 7], False, start, end) == ([5], [7])
    assert split_reasoning([7, 8], False, start, end) == ([], [7, 8])


def test_bench_needle_end_to_end_on_the_tiny_model(tiny_checkpoint: Path, tiny_tokenizer,
                                                   tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    received: list[list[int]] = []
    add_request = LLMEngine.add_request

    def recording(self, prompt_ids, params, *args, **kwargs):
        received.append(list(prompt_ids))
        assert params.temperature == 0.0 and params.max_tokens == 3
        assert params.reasoning and params.thinking_budget == 1
        assert (self.config.speculative_method, self.config.num_speculative_tokens) == ("mtp", 1)
        assert self.config.enable_prefix_caching and self.config.max_num_seqs == 4
        return add_request(self, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    out = tmp_path / "needle.json"
    assert main(["bench", "needle", "--model", str(tiny_checkpoint), "--lengths", "230,300",
                 "--depths", "0,1", "--max-tokens", "3", "--max-num-seqs", "4",
                 "--speculative", "mtp:1", "--enable-prefix-caching", "--thinking-budget", "1",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "needle" and record["model"] == str(tiny_checkpoint)
    assert record["prompt_format"] == "chat" and record["total"] == 4
    assert record["config"]["speculative"]["method"] == "mtp"
    assert "model_manifest_digest" in record and record["commit"]
    rows = record["results"]
    assert [(r["length"], r["depth"]) for r in rows] == [(230, 0), (230, 1), (300, 0), (300, 1)]
    assert len(received) == 4
    for row, ids in zip(rows, received, strict=True):
        assert row["prompt_tokens"] == len(ids) <= row["length"]
        assert row["outcome"] in ("hit", "miss", "unanswered")
        assert 1 <= row["completion_tokens"] <= 3 and row["finish_reason"] in ("stop", "length")
        # the budget closed the reasoning after one token (unless the model stopped first)
        assert "</think>" in row["output"] or row["finish_reason"] == "stop"
        start, end = row["needle_tokens"]  # the engine saw the needle where the receipt says
        needle_ids = tiny_tokenizer.encode(NEEDLE.format(code=row["code"]),
                                           add_special_tokens=False)
        assert ids[start:end] == needle_ids
        assert row["needle_depth"] == row["depth"]
    table = capsys.readouterr().out
    assert "length \\ depth" in table and "needles recovered" in table


@pytest.mark.parametrize(("args", "message"), [
    (["--lengths", "5000"], "exceeds the model's context"),
    (["--lengths", "1000", "--max-model-len", "900"], "exceeds --max-model-len"),
    (["--lengths", "40"], "cannot hold the needle"),
])
def test_bench_needle_refuses_cells_it_cannot_run(tiny_checkpoint: Path, args: list[str],
                                                  message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "needle", "--model", str(tiny_checkpoint), *args])


@pytest.mark.parametrize("depths", ["1.5", "-0.1", "0.5,x"])
def test_bench_needle_refuses_depths_outside_zero_one(tiny_checkpoint: Path, depths: str,
                                                      capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "needle", "--model", str(tiny_checkpoint), "--lengths", "200",
              "--depths", depths])
    assert exc.value.code == 2 and "--depths" in capsys.readouterr().err
