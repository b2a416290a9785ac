"""The KLD core (actors/kld.py, actors/kld_run.py) on CPU: the math against a float64 hand
computation, the window prefill, cache ablation, teacher directories and receipts on the tiny
checkpoint. The CLI and the quantised-cache bounds: tests/deployments/test_kld_cli.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from glm53.actors import kld, kld_run
from glm53.actors.loader import load_model

WINDOW = 48


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (2, WINDOW))


@pytest.fixture(scope="module")
def teacher(tiny_checkpoint, windows, tmp_path_factory):
    out = tmp_path_factory.mktemp("kld") / "teacher"
    kld_run.capture(kld_run.RunConfig(str(tiny_checkpoint), "m0"), windows, out,
                    {"corpus_sha256": "c0"})
    return out


def test_kl_rows_match_a_float64_hand_computation():
    rng = np.random.default_rng(0)
    t, s = rng.normal(size=(5, 7)) * 3, rng.normal(size=(5, 7)) * 3
    t[1] = s[1]  # identical rows: exactly 0
    s[2, :] = t[2, :] + 5.0  # a shift: softmax-invariant, 0 up to rounding
    kl, agree = kld.kl_rows(torch.tensor(t, dtype=torch.float32),
                            torch.tensor(s, dtype=torch.float32), chunk=2)
    expected = []
    for ti, si in zip(t.astype(np.float32).astype(np.float64),
                      s.astype(np.float32).astype(np.float64), strict=True):
        lp = ti - math.log(sum(math.exp(x) for x in ti))
        lq = si - math.log(sum(math.exp(x) for x in si))
        expected.append(sum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True)))
    assert kl.dtype == torch.float64
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-12, atol=1e-14)
    assert kl[1] == 0.0 and abs(float(kl[2])) < 1e-6
    assert agree.tolist() == list(t.argmax(-1) == s.argmax(-1))
    assert torch.equal(kld.kl_rows(torch.tensor(t), torch.tensor(s), chunk=64)[0],
                       kld.kl_rows(torch.tensor(t), torch.tensor(s), chunk=1)[0])
    with pytest.raises(ValueError, match="not the same positions"):
        kld.kl_rows(torch.zeros(2, 3), torch.zeros(2, 4))


def test_summary_and_position_buckets():
    v = np.arange(100, dtype=np.float64)
    s = kld.summarise(v)
    assert s["count"] == 100 and s["mean"] == 49.5 and s["max"] == 99
    assert s["cvar95"] == np.mean(np.arange(95, 100)) and s["std"] == np.std(v, ddof=1)
    buckets = kld.by_position(np.ones((2, 70)) * np.arange(70))
    assert [b["positions"] for b in buckets] == [[0, 16], [16, 64], [64, 70]]
    assert buckets[0]["count"] == 32 and buckets[2]["mean"] == 66.5


def test_cut_windows():
    assert kld_run.cut_windows(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert kld_run.cut_windows(list(range(10)), 4, max_windows=1).shape == (1, 4)
    with pytest.raises(kld_run.KLDInputError, match="3 tokens, fewer than one window of 4"):
        kld_run.cut_windows([1, 2, 3], 4)


def test_chunked_prefill_reads_what_the_first_chunks_cached(model, windows):
    ids = windows[0].tolist()
    for dtype in ("auto", "fp8"):
        spec = kld.CacheSpec(dtype)
        whole = kld.window_logits(model, ids, spec)
        chunked = kld.window_logits(model, ids, spec, prefill_chunk=20)
        assert whole.shape == (WINDOW, model.config.vocab_size)
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def test_cache_mix_with_nothing_mixed_is_the_base_cache(model, windows):
    ids = windows[0].tolist()
    base = kld.window_logits(model, ids, kld.CacheSpec("bf16"))
    fp8 = kld.window_logits(model, ids, kld.CacheSpec("fp8"))
    none = kld.window_logits(model, ids, kld.CacheSpec("fp8", base_dtype="bf16", mix_parts=()))
    every = kld.window_logits(model, ids, kld.CacheSpec("fp8", base_dtype="bf16"))
    assert torch.equal(none, base) and torch.equal(every, fp8)
    assert not torch.equal(fp8, base)


def test_teacher_directory_and_identical_student(tiny_checkpoint, teacher, windows):
    manifest = kld_run.read_manifest(teacher)
    assert manifest["tokens_sha256"] == kld_run.tokens_sha256(windows)
    assert manifest["positions_per_window"] == WINDOW - 1 and len(manifest["files"]) == 2
    receipt = kld_run.score(teacher, kld_run.RunConfig(str(tiny_checkpoint), "m0"))
    assert receipt["kld"]["mean"] == 0.0 and receipt["kld"]["max"] == 0.0
    assert receipt["top1_agreement"] == 1.0 and receipt["positions"] == 2 * (WINDOW - 1)
    assert receipt["nll"]["teacher"] == receipt["nll"]["student"] > 0
    again = kld_run.score(teacher, kld_run.RunConfig(str(tiny_checkpoint), "m0"))
    assert json.dumps(again, sort_keys=True) == json.dumps(receipt, sort_keys=True)


def test_fp8_student_with_its_breakdown(tiny_checkpoint, teacher):
    receipt = kld_run.score(teacher, kld_run.RunConfig(str(tiny_checkpoint), "m0",
                                                       kv_cache_dtype="fp8"), breakdown=True)
    mean = receipt["kld"]["mean"]
    assert mean > 0 and receipt["top1_agreement"] < 1.0
    by_layer, by_part = receipt["breakdown"]["by_layer"], receipt["breakdown"]["by_part"]
    assert set(by_layer) == {"3"} and by_layer["3"] == pytest.approx(mean, rel=1e-9)
    assert by_part["latent"] > 0 and by_part["pool_keys"] > 0
    with pytest.raises(kld_run.KLDInputError, match="--kv-cache-dtype only"):
        kld_run.score(teacher, kld_run.RunConfig(str(tiny_checkpoint), "m0"), breakdown=True)


def test_mismatched_inputs_are_refused_naming_the_digests(tiny_checkpoint, teacher, tmp_path):
    cfg = kld_run.RunConfig(str(tiny_checkpoint), "m0")
    with pytest.raises(kld_run.KLDInputError, match="no teacher at .*glm53 kld capture"):
        kld_run.score(tmp_path, cfg)
    with pytest.raises(kld_run.KLDInputError, match="another model: sha256 m0, the student's m1"):
        kld_run.score(teacher, kld_run.RunConfig(str(tiny_checkpoint), "m1"))
    with pytest.raises(kld_run.KLDInputError, match="other inputs: corpus_sha256 c0, here c1"):
        kld_run.score(teacher, cfg, inputs={"corpus_sha256": "c1"})
    with pytest.raises(kld_run.KLDInputError, match="longer than the model's context"):
        kld_run.capture(cfg, np.zeros((1, 5000), np.int64), tmp_path / "t", {})
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in teacher.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    window = copy / "window-00001.safetensors"
    data = bytearray(window.read_bytes())
    data[-1] ^= 1
    window.write_bytes(bytes(data))
    with pytest.raises(kld_run.KLDInputError, match="window-00001.safetensors changed: sha256"):
        kld_run.score(copy, cfg)
