"""The fused KDA mixer (Triton, interpreter on CPU) vs the reference composition.

Checked per case: the normed output, the conv'd q/k/v, g and beta it hands to a deferred commit
(nothing when no sequence defers), every state slot and conv window afterwards (written ones
match, deferred and unused ones are bit-identical to before). Tolerance: fp32 relative error
1e-5 (same math, other summation order in the conv and the state products).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import kda_mixer as ref

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton


def _case(lens, init, defer, heads, dk, dv, width, seed):
    g = torch.Generator().manual_seed(seed)
    n_tok, n_seq, slots = sum(lens), len(lens), len(lens) + 3
    chans = heads * (2 * dk + dv)
    args = dict(
        pre=torch.randn(n_tok, 2 * chans, generator=g)[:, :chans],  # strided rows
        conv_weight=torch.randn(chans, width + 1, generator=g) * 0.5,
        conv_state=torch.randn(slots, chans, width, generator=g),
        gate_logits=torch.randn(n_tok, heads * dk, generator=g),
        dt_bias=torch.randn(heads * dk, generator=g) * 0.1,
        a_log=torch.randn(heads, generator=g) * 0.5,
        beta_logits=torch.randn(n_tok, heads, generator=g),
        out_gate=torch.randn(n_tok, heads, dv, generator=g),
        norm_weight=torch.randn(dv, generator=g),
        state=torch.randn(slots, heads, dk, dv, generator=g) * 0.2,
    )
    ids = torch.randperm(slots, generator=g)[:n_seq]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    meta = (cu, ids, torch.tensor(init), None if defer is None else torch.tensor(defer))
    return args, meta


def _run(fn, args, meta, lower_bound, **kw):
    a = args
    return fn(a["pre"], a["conv_weight"], a["conv_state"], a["gate_logits"], a["dt_bias"],
              a["a_log"], lower_bound, a["beta_logits"], a["out_gate"], a["norm_weight"], 1e-5,
              a["state"], *meta, **kw)


@pytest.mark.parametrize("lens,init,defer,heads,dk,dv,width,lower_bound", [
    # decode: one token each, a new sequence among resumed ones; both gate forms
    ([1, 1, 1, 1], [True, False, True, True], None, 3, 16, 16, 3, -5.0),
    ([1, 1, 1, 1], [True, False, True, True], None, 3, 16, 16, 3, None),
    # verification: 4 tokens each, two deferred; a new sequence of 2
    ([4, 4, 2, 4], [True, True, False, True], [True, False, False, True], 2, 16, 32, 3, -5.0),
    # chunked-prefill continuations shorter than the conv window; conv width 3 (W = 2)
    ([2, 1, 3], [True, True, False], None, 2, 32, 16, 2, -5.0),
    # long sequences: the separate kernels
    ([17, 20], [False, True], None, 2, 16, 16, 3, -5.0),
])
def test_kda_mixer_matches_reference(lens, init, defer, heads, dk, dv, width, lower_bound):
    from glm53.kernels import kda_mixer

    args, meta = _case(lens, init, defer, heads, dk, dv, width, len(lens))
    mine = {k: v.clone().to(DEVICE) for k, v in args.items()}
    before_state, before_conv = args["state"].clone(), args["conv_state"].clone()
    want = _run(ref.kda_mixer, args, meta, lower_bound)
    got = _run(kda_mixer.kda_mixer, mine, [None if t is None else t.to(DEVICE) for t in meta],
               lower_bound)
    assert (got[1] is None) == (want[1] is None) == (defer is None)
    pairs = [(got[0], want[0])] + (list(zip(got[1], want[1], strict=True)) if defer else [])
    for name, (a, b) in zip(("o", "q", "k", "v", "g", "beta")[:len(pairs)], pairs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, name
    assert rel_err(mine["state"], args["state"]) < 1e-5
    assert rel_err(mine["conv_state"], args["conv_state"]) < 1e-5
    ids, written = meta[1], torch.tensor([not d for d in (defer or [False] * len(lens))])
    untouched = torch.ones(before_state.shape[0], dtype=torch.bool)
    untouched[ids[written]] = False
    assert torch.equal(mine["state"].cpu()[untouched], before_state[untouched])
    assert torch.equal(mine["conv_state"].cpu()[untouched], before_conv[untouched])
    assert not torch.equal(mine["state"].cpu(), before_state)  # something was written


def test_decode_steps_take_the_fused_kernel(monkeypatch):
    """Decode-sized steps are one fused launch; prefill-sized ones take the separate kernels."""
    from glm53.kernels import kda_mixer

    grids = []
    kernel = kda_mixer.kda_mixer_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(kda_mixer, "kda_mixer_kernel", Spy())
    for lens in ([1, 1, 1], [17, 20]):
        args, meta = _case(lens, [True] * len(lens), None, 2, 16, 16, 3, 9)
        _run(kda_mixer.kda_mixer, {k: v.to(DEVICE) for k, v in args.items()},
             [None if t is None else t.to(DEVICE) for t in meta], -5.0)
    assert grids == [(2, 2, 3)]  # (V blocks of 8, heads, sequences)


@pytest.mark.parametrize("lens", [[4, 4, 2, 4], [17, 20]], ids=["fused", "separate"])
@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_replay_goes_into_given_tensors(lens, backend):
    """With replay_out (a CUDA graph's shared outputs) the replay is written into those very
    tensors, and everything equals the run that allocates its own."""
    from glm53.kernels import kda_mixer

    fn = ref.kda_mixer if backend == "ref" else kda_mixer.kda_mixer
    defer = [i % 2 == 0 for i in range(len(lens))]
    args, meta = _case(lens, [True] * len(lens), defer, 2, 16, 32, 3, 11)
    meta = [t.to(DEVICE) for t in meta]
    own, given = ({k: v.clone().to(DEVICE) for k, v in args.items()} for _ in range(2))
    want = _run(fn, own, meta, -5.0)
    outs = tuple(torch.full_like(t, float("nan")) for t in want[1])
    got = _run(fn, given, meta, -5.0, replay_out=outs)
    assert all(a is b for a, b in zip(got[1], outs, strict=True))
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(given["state"], own["state"])
    assert torch.equal(given["conv_state"], own["conv_state"])
