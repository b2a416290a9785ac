"""The chunked KDA prefill kernel (`kernels/kda_chunk.py`) vs the token-by-token reference
recurrence of `kernels/ref/kda.py`, fp32, in the interpreter on CPU (or on a GPU).

Small awkward shapes: head dims 16 and 32 (also dk != dv), sequences of 1..130 tokens around the
chunk size (64) and the 16-token sub-chunks, some with initial states and some without, slots out
of order, q/k/v strided views of one wide row. Gates: mild, the bounded -5 sigmoid, very strong
(-20 per step: every decayed product underflows) and near zero (no decay at all).
Tolerance: relative error 1e-4 on outputs and states in the interpreter (fp32 everywhere; the
chunked sums reassociate the recurrence) and 5e-3 on a GPU (tf32 tensor-core products);
untouched slots bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import kda as ref

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton
TOL = 5e-3 if DEVICE == "cuda" else 1e-4

GATES = {
    "mild": lambda x: -0.1 * torch.sigmoid(x),
    "bounded": lambda x: -5 * torch.sigmoid(x),
    "strong": lambda x: -20 * torch.sigmoid(x + 4),  # mostly close to -20 per step
    "near_zero": lambda x: -1e-6 * torch.sigmoid(x),
}


def _case(lens, heads, dk, dv, gate, seed):
    """Inputs on the CPU: q/k/v as strided views of one wide row, state slots in shuffled
    order (two spare slots never used), every second sequence without an initial state."""
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)
    wide = torch.randn(t, heads * (2 * dk + dv) + 3, generator=gen)
    g = GATES[gate](torch.randn(t, heads, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(t, heads, generator=gen))
    state = torch.randn(n + 2, heads, dk, dv, generator=gen)
    ids = torch.randperm(n + 2, generator=gen)[:n]
    init = torch.arange(n) % 2 == 1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return wide, g, beta, state, cu, ids, init


def _views(wide, heads, dk, dv):
    t = wide.shape[0]
    q = wide[:, : heads * dk].view(t, heads, dk)
    k = wide[:, heads * dk: 2 * heads * dk].view(t, heads, dk)
    v = wide[:, 2 * heads * dk: 2 * heads * dk + heads * dv].view(t, heads, dv)
    return q, k, v


def _check(fn, lens, heads, dk, dv, gate, seed=0):
    wide, g, beta, state, cu, ids, init = _case(lens, heads, dk, dv, gate, seed)
    s_ref = state.clone()
    o_ref = ref.kda_attention(*_views(wide, heads, dk, dv), g, beta, s_ref, cu, ids, init)
    s_dev = state.to(DEVICE)
    o = fn(*_views(wide.to(DEVICE), heads, dk, dv), g.to(DEVICE), beta.to(DEVICE), s_dev,
           cu.to(DEVICE), ids.to(DEVICE), init.to(DEVICE))
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert rel_err(o, o_ref) < TOL
    assert rel_err(s_dev, s_ref) < TOL
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(s_dev.cpu()[untouched], state[untouched])


@pytest.mark.parametrize("lens,heads,dk,dv,gate", [
    ([1, 5, 63, 64, 65, 130], 2, 16, 16, "bounded"),
    ([130, 17, 64], 3, 32, 32, "strong"),
    ([65, 0, 40, 1], 2, 16, 32, "near_zero"),
    ([129, 3], 2, 32, 16, "mild"),
])
def test_chunk_matches_ref_recurrence(lens, heads, dk, dv, gate):
    from glm53.kernels import kda_chunk

    _check(kda_chunk.kda_chunk_attention, lens, heads, dk, dv, gate)


def test_chunk_without_prefetch(monkeypatch):
    """The state pass's other load order (a benchmarked tuning switch) is the same math."""
    from glm53.kernels import kda_chunk

    monkeypatch.setattr(kda_chunk, "STATE_PREFETCH", False)
    _check(kda_chunk.kda_chunk_attention, [70, 1, 64], 2, 16, 32, "bounded", seed=3)


def test_kda_attention_takes_the_chunk_path(monkeypatch):
    """Prefill-sized steps (>= CHUNK_MIN_TOKENS_PER_SEQ tokens per sequence on average) go
    through the chunked kernel, and still equal the reference; decode-sized ones do not."""
    from glm53.kernels import kda, kda_chunk

    calls = []
    chunked = kda_chunk.kda_chunk_attention

    def counting(*args):
        calls.append(args[0].shape[0])
        return chunked(*args)

    monkeypatch.setattr(kda_chunk, "kda_chunk_attention", counting)
    _check(kda.kda_attention, [70, 60], 2, 16, 16, "bounded", seed=1)
    assert calls == [130]
    _check(kda.kda_attention, [3, 1, 2], 2, 16, 16, "bounded", seed=2)
    assert calls == [130]
