"""Incremental detokenization (UTF-8 across token boundaries) and stop strings (no leaks)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.deployments.detokenizer import IncrementalDetokenizer, StopStrings
from glm53.deployments.tokenizer import decode


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def stream(tok, ids: list[int], splits: list[int]) -> list[str]:
    """Deltas of feeding `ids` in pieces of the given sizes (cycled), then flushing."""
    detok = IncrementalDetokenizer(tok)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = max(1, splits[k % len(splits)])
        out.append(detok.add(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(detok.flush())
    return out


def test_multibyte_char_is_held_until_complete(tok):
    ids = list("世".encode())  # three byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "世"]
    assert detok.flush() == ""


def test_invalid_bytes_give_replacement_only_where_final_text_has_them(tok):
    ids = [0xE4, 0xB8, ord("A"), 0xFF, 0xF0, 0x9F, 0x9A, 0x80, 0xE4]
    deltas = stream(tok, ids, [1])
    assert "".join(deltas) == decode(tok, ids) == "\ufffdA\ufffd🚀\ufffd"
    # a broken sequence is released once a later byte proves it broken, not before
    assert deltas[:3] == ["", "", "\ufffdA"]
    assert deltas[-1] == "\ufffd"  # the trailing incomplete byte only at the end


def test_special_tokens_and_skip_ids(tok):
    ids = [ord("a"), 266, ord("b"), 256]
    assert "".join(stream(tok, ids, [1])) == "a<think>b<|endoftext|>"
    detok = IncrementalDetokenizer(tok, skip_ids={256})
    assert detok.add(ids) + detok.flush() == "a<think>b"


BYTES = st.one_of(st.integers(0, 271), st.sampled_from(list("é世🚀".encode()) + [0x80, 0xFF]))


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(BYTES, max_size=40), splits=st.lists(st.integers(1, 4), min_size=1))
def test_stream_equals_decode_of_all(tok, ids, splits):
    assert "".join(stream(tok, ids, splits)) == decode(tok, ids)


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    s = StopStrings(stops)
    released = [s.process(p) for p in pieces]
    released.append(s.process("", final=True))
    return "".join(released), s.hit, released


def test_stop_string_split_across_pieces_never_leaks():
    text, hit, released = run_stops(["STOP"], ["abc S", "T", "O", "P tail"])
    assert (text, hit) == ("abc ", "STOP")
    assert released[:4] == ["abc ", "", "", ""]


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    text, hit, released = run_stops(["STOP"], ["abc ST", "x"])
    assert (text, hit) == ("abc STx", None)
    assert released[0] == "abc "


def test_the_stop_that_completes_first_wins():
    text, hit, _ = run_stops(["world", "lo w"], ["hello world"])
    assert (text, hit) == ("hel", "lo w")
    text, hit, _ = run_stops(["TSS", "S"], ["TSS"])
    assert (text, hit) == ("T", "S")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abST", max_size=30), cut=st.lists(st.integers(0, 30)),
       stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1,
                      max_size=3))
def test_stops_match_whole_text_semantics(text, cut, stops):
    points = sorted({c for c in cut if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)]
    out, hit, _ = run_stops(stops, pieces)
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    if found:  # the stop that completes first, as a token-by-token check sees it
        _, index, stop = min(found)
        assert (out, hit) == (text[:index], stop)
    else:
        assert (out, hit) == (text, None)


def test_random_model_like_stream_matches_decode(tok):
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(272) for _ in range(rng.randrange(30))]
        assert "".join(stream(tok, ids, [rng.randint(1, 3)])) == decode(tok, ids)
