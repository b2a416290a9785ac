"""Tilings keyed by compute capability: SM120 (RTX PRO 6000 Blackwell) gets its own where the
Hopper one does not fit its 99 KB of shared memory a block; Hopper's stays as it was.

The capability is faked: no GPU here. `scripts/kernel_build.py` (a slow test) builds what each
choice launches and checks it against the target's limits.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

from glm53.kernels import sparse_mla, utils  # noqa: E402

GPU = torch.device("cuda", 0)


@pytest.fixture
def compiled(monkeypatch):
    """Wrappers as on a GPU (not the interpreter), with the capability asked afresh."""
    monkeypatch.setattr(utils, "INTERPRET", False)
    utils.device_capability.cache_clear()
    yield
    utils.device_capability.cache_clear()


@pytest.mark.parametrize("capability,sm120", [((12, 0), True), ((12, 1), True), ((9, 0), False),
                                              ((10, 0), False), ((8, 9), False)])
def test_is_sm120_by_capability(compiled, capability, sm120):
    with mock.patch("torch.cuda.get_device_capability", return_value=capability) as ask:
        assert utils.is_sm120(GPU) is sm120
        utils.is_sm120(GPU)
    ask.assert_called_once_with(GPU)  # asked once per device: wrappers call it every step


def test_never_sm120_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(utils, "INTERPRET", True)
    with mock.patch("torch.cuda.get_device_capability", return_value=(12, 0)) as ask:
        assert not utils.is_sm120(GPU)
    ask.assert_not_called()


def test_attention_plan_hopper_unchanged_sm120_narrower():
    """Batch-1 decode at the model's widths (64 heads, 512 latent, 2051 rows)."""
    hopper = sparse_mla._attention_plan(1, 64, 2051, 512, False)
    assert hopper == sparse_mla._attention_plan(1, 64, 2051, 512, False, sm120=False)
    assert (hopper["BW"], hopper["warps"]) == (sparse_mla.ATTENTION_ROWS,
                                               sparse_mla.ATTENTION_WARPS) == (32, 4)
    sm120 = sparse_mla._attention_plan(1, 64, 2051, 512, False, sm120=True)
    assert (sm120["BW"], sm120["warps"]) == (16, 8)
    # the same split of the selection and of the latent columns
    assert {k: sm120[k] for k in ("BH", "BO", "HALVES", "splits", "grid_c")} == \
        {k: hopper[k] for k in ("BH", "BO", "HALVES", "splits", "grid_c")}
    # fp32 (the interpreter's path) keeps its own tiling either way
    assert sparse_mla._attention_plan(1, 64, 2051, 512, True, sm120=True) == \
        sparse_mla._attention_plan(1, 64, 2051, 512, True)


def test_quantised_cache_attention_is_refused_on_sm120(monkeypatch):
    """Its build does not fit SM120's shared memory (scripts/kernel_build.py): a clear error, not
    a launch failure."""
    monkeypatch.setattr(sparse_mla, "is_sm120", lambda device: True)
    with pytest.raises(NotImplementedError, match="fp8 latent rows does not fit an SM120"):
        sparse_mla.sparse_mla_attention(
            torch.zeros(1, 16, 512), torch.zeros(2, 8, 528, dtype=torch.uint8),
            torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 4, dtype=torch.long), 1 / 16, latent_format="fp8")
