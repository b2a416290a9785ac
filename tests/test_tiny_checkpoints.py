"""The session's tiny checkpoints (tests/tiny.py): each distinct spec is written once."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny import TINY, TinyCheckpoints


def test_a_spec_asked_again_gets_the_same_directory_without_a_rebuild(tmp_path: Path):
    tiny = TinyCheckpoints(tmp_path)
    first = tiny(seed=1, layers=4)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny(layers=4, seed=1) == first  # keyword order does not matter
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # another spec, including one with a list (a layer schedule), gets its own directory
    other = tiny(seed=1, layers=4, index_topk=8)
    schedule = ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
    listed = tiny(seed=1, layers=4, layer_types=schedule)
    assert len({first, other, listed}) == 3
    text = json.loads((listed / "config.json").read_text())["text_config"]
    assert text["layer_types"] == schedule


def test_the_session_checkpoint_is_the_standard_spec(tiny_checkpoint: Path,
                                                     tiny_checkpoints: TinyCheckpoints):
    assert tiny_checkpoints(**TINY) == tiny_checkpoint
    text = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == TINY["layers"]
    assert text["index_topk"] == TINY["index_topk"]
    assert text["num_nextn_predict_layers"] == 1  # the MTP layer
