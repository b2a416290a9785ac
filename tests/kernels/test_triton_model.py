"""The tiny model through the Triton kernels (interpreter on CPU) equals the reference path.

Two sequences prefilled together (lengths crossing the pool and block sizes), then two decode
steps, with `ops.use("triton")` against `ops.use("ref")`: fp32 logits within 1e-4 relative
error at every step (only summation orders differ).
"""

from __future__ import annotations

import pytest
import torch

from glm53.actors.loader import load_model
from glm53.kernels import ops
from tests.naive_runner import SequenceRunner

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints(seed=5, layers=4, index_topk=8)
    return load_model(path, progress=False, device=DEVICE)


def _run(model, backend):
    ops.use(backend)
    try:
        runner = SequenceRunner(model, max_seqs=2, max_len=40, block_size=8)
        runner.add(0)
        runner.add(1)
        gen = torch.Generator().manual_seed(0)
        prompts = {0: torch.randint(0, 272, (9,), generator=gen).tolist(),
                   1: torch.randint(0, 272, (14,), generator=gen).tolist()}
        logits = [runner.step_logits(prompts)]
        for _ in range(2):
            nxt = {i: [int(logits[-1][-1 if i else len(prompts[0]) - 1].argmax())]
                   for i in (0, 1)}
            logits.append(runner.step_logits(nxt))
            prompts = nxt
        return logits
    finally:
        ops.use("auto")


class _Count:
    """Stands in for a Triton kernel: counts its launches, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.slow
def test_tiny_model_triton_equals_reference(tiny, monkeypatch):
    """Also counts the mHC launches: the 23-token prefill runs each of the 8 sites' mixing
    pass and expansion apart; a 2-token decode step mixes only at the first site, every other
    expansion feeding the next site's projection (`hc_post_pre`), the last one alone."""
    from glm53.kernels import mhc

    counts = {name: _Count(getattr(mhc, name))
              for name in ("hc_mix_kernel", "hc_post_kernel", "hc_post_mix_kernel")}
    with torch.inference_mode():
        want = _run(tiny, "ref")
        for name, count in counts.items():
            monkeypatch.setattr(mhc, name, count)
        got = _run(tiny, "triton")
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-4
    assert {n: c.launches for n, c in counts.items()} == {
        "hc_mix_kernel": 8 + 2 * 1, "hc_post_kernel": 8 + 2 * 1, "hc_post_mix_kernel": 2 * 7}
