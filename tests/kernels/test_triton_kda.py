"""Triton KDA kernels vs `kernels/ref/kda.py` on small awkward shapes (fp32, interpreter on CPU).

Tolerance: fp32 relative error 1e-5 (outputs) and 1e-5 (states); conv windows exact.
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import kda as ref

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton
TOL = 1e-5


def _batch(lens, slots, init, gen=None):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    return (cu, torch.tensor(slots, device=DEVICE),
            torch.tensor(init, device=DEVICE))


@pytest.mark.parametrize("defer", [None, [True, False, False, True, False]])
def test_causal_conv1d_matches_ref(defer):
    """Several sequences (1..19 tokens, fewer than the window too), stale and fresh slots,
    rows strided like the q|k|v slice of a wider projection, optional deferred windows."""
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(1)
    lens, chans, width = [5, 2, 1, 19, 1], 37, 4
    cu, ids, init = _batch(lens, [3, 1, 0, 5, 2], [True, False, True, False, True], g)
    wide = torch.randn(sum(lens), chans + 3, generator=g)
    w = torch.randn(chans, width, generator=g)
    state = torch.randn(6, chans, width - 1, generator=g)
    dmask = None if defer is None else torch.tensor(defer)
    s_ref = state.clone()
    y_ref = ref.causal_conv1d(wide[:, :chans], w, s_ref, cu.cpu(), ids.cpu(), init.cpu(), dmask)
    s_dev = state.to(DEVICE)
    y = kda.causal_conv1d(wide.to(DEVICE)[:, :chans], w.to(DEVICE), s_dev, cu, ids, init,
                          None if dmask is None else dmask.to(DEVICE))
    assert rel_err(y, y_ref) < TOL
    assert torch.equal(s_dev.cpu(), s_ref)


def test_causal_conv1d_planes():
    """planes=3 (q|k|v for fla): the same values as [T, 3, C/3], each plane a dense [T, C/3]
    tensor. 3 planes of 20 channels lie inside one of the interpreter's 128-channel blocks;
    3 x 50 channels cross a block edge mid-plane."""
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(2)
    for chans in (60, 150):
        lens, width = [5, 1, 12], 4
        cu, ids, init = _batch(lens, [2, 0, 1], [True, False, True], g)
        x = torch.randn(sum(lens), chans, generator=g)
        w = torch.randn(chans, width, generator=g)
        state = torch.randn(3, chans, width - 1, generator=g)
        s_ref = state.clone()
        y_ref = ref.causal_conv1d(x, w, s_ref, cu.cpu(), ids.cpu(), init.cpu(), planes=3)
        s_dev = state.to(DEVICE)
        y = kda.causal_conv1d(x.to(DEVICE), w.to(DEVICE), s_dev, cu, ids, init, planes=3)
        assert y.shape == y_ref.shape == (sum(lens), 3, chans // 3)
        assert all(y[:, i].is_contiguous() for i in range(3))
        assert rel_err(y, y_ref) < TOL
        assert torch.equal(s_dev.cpu(), s_ref)
    with pytest.raises(ValueError, match="planes"):
        kda.causal_conv1d(x.to(DEVICE)[:, :59], w.to(DEVICE)[:59], s_dev[:, :59].contiguous(),
                          cu, ids, init, planes=3)


def test_gate_lower_bound_is_checked_by_the_reference():
    q = torch.randn(3, 2, 8)
    g = torch.full((3, 2, 8), -6.0)
    args = (q, q, q, g, torch.full((3, 2), 0.5), torch.zeros(1, 2, 8, 8),
            torch.tensor([0, 3]), torch.tensor([0]), torch.tensor([False]))
    with pytest.raises(ValueError, match="lower bound"):
        ref.kda_attention(*args, gate_lower_bound=-5.0)
    assert ref.kda_attention(*args).abs().sum() > 0  # unbounded: runs


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_matches_ref(lower_bound):
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(3)
    heads, dk = 3, 12
    logits = torch.randn(7, heads * dk, generator=g) * 8
    bias, a_log = torch.randn(heads * dk, generator=g), torch.randn(heads, generator=g)
    out = kda.kda_gate(logits.to(DEVICE), bias.to(DEVICE), a_log.to(DEVICE), lower_bound)
    assert rel_err(out, ref.kda_gate(logits, bias, a_log, lower_bound)) < TOL


@pytest.mark.parametrize("with_defer", [False, True])
def test_kda_attention_matches_ref_recurrence(with_defer):
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(4)
    lens, heads, dk, dv = [3, 0, 1, 21, 2], 3, 12, 10
    cu, ids, init = _batch(lens, [4, 0, 2, 1, 5], [True, False, False, True, True], g)
    t = sum(lens)
    # q, k, v as the strided views of one conv output, like the layer hands them over
    mixed = torch.randn(t, heads * (2 * dk + dv), generator=g)
    q = mixed[:, : heads * dk].view(t, heads, dk)
    k = mixed[:, heads * dk: 2 * heads * dk].view(t, heads, dk)
    v = mixed[:, 2 * heads * dk:].view(t, heads, dv)
    gate = -5 * torch.sigmoid(torch.randn(t, heads, dk, generator=g))
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    state = torch.randn(6, heads, dk, dv, generator=g)
    defer = torch.tensor([False, False, True, True, False]) if with_defer else None
    s_ref = state.clone()
    o_ref = ref.kda_attention(q, k, v, gate, beta, s_ref, cu.cpu(), ids.cpu(), init.cpu(), defer)
    dev = [x.to(DEVICE) for x in (mixed, gate, beta, state)]
    md, gd, bd, sd = dev
    qd = md[:, : heads * dk].view(t, heads, dk)
    kd = md[:, heads * dk: 2 * heads * dk].view(t, heads, dk)
    vd = md[:, 2 * heads * dk:].view(t, heads, dv)
    o = kda.kda_attention(qd, kd, vd, gd, bd, sd, cu, ids, init,
                          None if defer is None else defer.to(DEVICE))
    assert rel_err(o, o_ref) < TOL
    assert rel_err(sd, s_ref) < TOL
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[ids.cpu()] = False
    assert torch.equal(sd.cpu()[untouched], state[untouched])


def test_gated_rms_norm_matches_ref():
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(5)
    x, z = torch.randn(5, 3, 10, generator=g), torch.randn(5, 3, 10, generator=g)
    w = torch.randn(10, generator=g)
    out = kda.gated_rms_norm(x.to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-5)
    assert rel_err(out, ref.gated_rms_norm(x, z, w, 1e-5)) < TOL


def test_commit_kernels_match_ref():
    """After a verify step with deferred writes: replay the accepted prefixes (0..all tokens)
    into the conv windows and recurrent states."""
    from glm53.kernels import kda

    g = torch.Generator().manual_seed(6)
    lens, heads, dk, dv, chans = [4, 1, 5], 2, 12, 10, 19
    cu, ids, init = _batch(lens, [2, 0, 3], [True, False, True])
    acc = torch.tensor([2, 0, 5])
    t = sum(lens)
    q, k = torch.randn(t, heads, dk, generator=g), torch.randn(t, heads, dk, generator=g)
    v = torch.randn(t, heads, dv, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(t, heads, dk, generator=g))
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    state = torch.randn(4, heads, dk, dv, generator=g)
    x = torch.randn(t, chans, generator=g)
    conv = torch.randn(4, chans, 3, generator=g)
    s_ref, c_ref = state.clone(), conv.clone()
    ref.kda_commit(q, k, v, gate, beta, s_ref, cu.cpu(), ids.cpu(), init.cpu(), acc)
    ref.conv_commit(x, c_ref, cu.cpu(), ids.cpu(), init.cpu(), acc)
    s_dev, c_dev = state.to(DEVICE), conv.to(DEVICE)
    kda.kda_commit(*(a.to(DEVICE) for a in (q, k, v, gate, beta)), s_dev, cu, ids, init,
                   acc.to(DEVICE))
    kda.conv_commit(x.to(DEVICE), c_dev, cu, ids, init, acc.to(DEVICE))
    assert rel_err(s_dev, s_ref) < TOL
    assert torch.equal(c_dev.cpu(), c_ref)


@pytest.mark.parametrize("gate_in_kernel", [False, True])
@pytest.mark.parametrize("bound,safe", [(-5.0, True), (-8.0, False), (None, False)])
def test_fla_chunk_wrapper_slots_and_gate_path(bound, safe, gate_in_kernel):
    """The wrapper around fla's chunk_kda (CUDA-only; here with a stand-in that runs the
    reference recurrence from the initial states it is given): states come from and go back to
    the right slots, a fresh slot's stale contents (NaN here) never leak in, and the bounded
    gate asks for fla's safe_gate path only within fla's [-5, 0) range; the host copy of
    cu_seqlens reaches fla as the same object (fla caches its chunk plan by identity). With the
    gate in fla's kernel (`kda_gated_attention`), fla gets the raw logits, dt_bias, A_log and
    the bound, and the stand-in applies `kda_gate`'s formula (the GPU tests check fla's)."""
    from glm53.kernels import kda

    seen = {}

    def chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state,
              use_qk_l2norm_in_kernel, safe_gate, cu_seqlens, cu_seqlens_cpu,
              use_gate_in_kernel=False, dt_bias=None, A_log=None, lower_bound=None):
        seen.update(safe_gate=safe_gate, scale=scale, l2=use_qk_l2norm_in_kernel,
                    host=cu_seqlens_cpu, gate=use_gate_in_kernel, bound=lower_bound)
        if use_gate_in_kernel:
            assert g.shape == q.shape
            g = ref.kda_gate(g[0].flatten(1), dt_bias, A_log, lower_bound)[None]
        n = initial_state.shape[0]
        states = initial_state.clone()
        o = ref.kda_attention(q[0], k[0], v[0], g[0], beta[0], states, cu_seqlens,
                              torch.arange(n), torch.ones(n, dtype=torch.bool))
        return o[None], states

    gen = torch.Generator().manual_seed(5)
    lens, heads, dk = [70, 3, 66], 2, 8
    cu, ids, init = _batch(lens, [4, 1, 2], [True, False, True])
    cu, ids, init = cu.cpu(), ids.cpu(), init.cpu()
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, dk, generator=gen) for _ in range(3))
    logits = torch.randn(t, heads * dk, generator=gen)
    dt_bias, a_log = torch.randn(heads * dk, generator=gen), torch.randn(heads, generator=gen)
    g = ref.kda_gate(logits, dt_bias, a_log, bound)
    beta = torch.sigmoid(torch.randn(t, heads, generator=gen))
    state = torch.randn(6, heads, dk, dk, generator=gen)
    state[1] = float("nan")  # slot of the fresh sequence
    want_state = state.clone()
    want = ref.kda_attention(q, k, v, g, beta, want_state, cu, ids, init)
    cu_host = None if bound is None else cu.clone()
    if gate_in_kernel:
        got = kda._kda_chunk_fla(chunk, q, k, v, logits, beta, state, cu, ids, init, bound,
                                 cu_host, (dt_bias, a_log))
    else:
        got = kda._kda_chunk_fla(chunk, q, k, v, g, beta, state, cu, ids, init, bound, cu_host)
    assert seen.pop("host") is cu_host
    assert seen == dict(safe_gate=safe, scale=dk ** -0.5, l2=True, gate=gate_in_kernel,
                        bound=bound if gate_in_kernel else None)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < TOL
    assert torch.allclose(state[[4, 1, 2]], want_state[[4, 1, 2]], rtol=1e-5, atol=1e-6)
    assert torch.equal(state[[0, 3, 5]], want_state[[0, 3, 5]])  # other slots untouched
