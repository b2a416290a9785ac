"""The chunked KDA prefill kernel on real shapes, on a CUDA GPU (marker `gpu`).

32 and 64 heads of dk = dv = 128, single long sequences and a varlen batch with ragged lengths
(1 and 63 tokens among thousands), slots out of order, some sequences without initial state.
Checked against the token-by-token reference recurrence (fp32) and against fla's `chunk_kda`
when fla is importable.
Tolerances, relative error: fp32 inputs 5e-3 (tf32 tensor-core products in the chunk algebra);
bf16 inputs 1e-2 on outputs (rounded to bf16) and states (bf16 factors and bf16 state copies
feed the tensor-core products; the state itself accumulates in fp32); vs fla 2e-2 (both sides
carry bf16 roundings of their own).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import kda as ref_kda

from .triton_util import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
TOL = {torch.float32: 5e-3, torch.bfloat16: 1e-2}


def _inputs(lens, heads, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t, n, dk = sum(lens), len(lens), 128
    mixed = torch.randn(t, 3 * heads * dk, generator=gen).to(DEV, dtype)
    q, k, v = (c.view(t, heads, dk) for c in mixed.chunk(3, dim=-1))
    g = (-5 * torch.sigmoid(torch.randn(t, heads, dk, generator=gen))).to(DEV)
    beta = torch.sigmoid(torch.randn(t, heads, generator=gen)).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    state = (torch.randn(n + 2, heads, dk, dk, generator=gen) * 0.1).to(DEV)
    ids = torch.randperm(n + 2, generator=gen)[:n].to(DEV)
    init = torch.arange(n, device=DEV) % 2 == 1
    return q, k, v, g, beta, state, cu, ids, init


CASES = [(32, [4096]), (64, [4096]), (32, [2000, 1, 63, 4100]), (64, [2000, 1, 63, 4100]),
         (32, [16384])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,lens", CASES)
def test_chunk_matches_ref_recurrence(heads, lens, dtype):
    from glm53.kernels import kda_chunk

    q, k, v, g, beta, state, cu, ids, init = _inputs(lens, heads, dtype, len(lens) + heads)
    s_ref = state.clone()
    o_ref = ref_kda.kda_attention(q, k, v, g, beta, s_ref, cu, ids, init)
    s_ours = state.clone()
    o = kda_chunk.kda_chunk_attention(q, k, v, g, beta, s_ours, cu, ids, init)
    torch.cuda.synchronize()
    assert o.dtype == dtype
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(s_ours, s_ref) < TOL[dtype]
    untouched = torch.ones(state.shape[0], dtype=torch.bool, device=DEV)
    untouched[ids] = False
    assert torch.equal(s_ours[untouched], state[untouched])


def test_chunk_without_prefetch(monkeypatch):
    """The state pass's other load order (benchmarked as a tuning check) is the same math."""
    from glm53.kernels import kda_chunk

    monkeypatch.setattr(kda_chunk, "STATE_PREFETCH", False)
    q, k, v, g, beta, state, cu, ids, init = _inputs([2000, 1, 63, 700], 32, torch.bfloat16, 5)
    s_ref = state.clone()
    o_ref = ref_kda.kda_attention(q, k, v, g, beta, s_ref, cu, ids, init)
    o = kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu, ids, init)
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]
    assert rel_err(state, s_ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("gate", [-20.0, -1e-6])
def test_chunk_extreme_gates(gate):
    """Every step decays by e^-20 (products underflow) or not at all: still the recurrence."""
    from glm53.kernels import kda_chunk

    q, k, v, g, beta, state, cu, ids, init = _inputs([700, 64, 1], 32, torch.float32, 7)
    g = torch.full_like(g, gate)
    s_ref = state.clone()
    o_ref = ref_kda.kda_attention(q, k, v, g, beta, s_ref, cu, ids, init)
    o = kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu, ids, init)
    assert rel_err(o, o_ref) < TOL[torch.float32]
    assert rel_err(state, s_ref) < TOL[torch.float32]


@pytest.mark.parametrize("heads,lens", [(32, [4096]), (64, [2000, 1, 63, 4100])])
def test_chunk_matches_fla(heads, lens):
    fla_kda = pytest.importorskip("fla.ops.kda")
    from glm53.kernels import kda

    q, k, v, g, beta, state, cu, ids, init = _inputs(lens, heads, torch.bfloat16, 11)
    h0 = state[ids] * init.view(-1, 1, 1, 1).to(state.dtype)
    o_fla, ht = fla_kda.chunk_kda(
        *(x.contiguous().unsqueeze(0) for x in (q, k, v)), g.unsqueeze(0), beta.unsqueeze(0),
        scale=128 ** -0.5, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o = kda.kda_attention(q, k, v, g, beta, state, cu, ids, init)  # dispatches to the chunks
    assert rel_err(o, o_fla[0]) < 2e-2
    assert rel_err(state[ids], ht) < 2e-2


@pytest.mark.parametrize("bound", [-5.0, None])
@pytest.mark.parametrize("heads,lens", [(32, [4096]), (64, [2000, 1, 63, 4100])])
def test_gated_attention_matches_reference(heads, lens, bound):
    """Prefill with the gate computed inside fla's chunk kernels (`kda_gated_attention`; our
    chunked kernel after `kda_gate` without fla) vs the reference gate + token walk, from bf16
    logits as the layer's projection gives them; the host copy of cu_seqlens given."""
    from glm53.kernels import kda

    q, k, v, _, beta, state, cu, ids, init = _inputs(lens, heads, torch.bfloat16, 17)
    gen = torch.Generator().manual_seed(18)
    logits = torch.randn(q.shape[0], heads * 128, generator=gen).to(DEV, torch.bfloat16)
    dt_bias = (torch.randn(heads * 128, generator=gen) * 0.1).to(DEV)
    a_log = (torch.randn(heads, generator=gen) * 0.5).to(DEV)
    s_ref = state.clone()
    o_ref = ref_kda.kda_gated_attention(q, k, v, logits, dt_bias, a_log, bound, beta, s_ref,
                                        cu, ids, init)
    o = kda.kda_gated_attention(q, k, v, logits, dt_bias, a_log, bound, beta, state, cu, ids,
                                init, cu.cpu())
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]
    assert rel_err(state, s_ref) < TOL[torch.bfloat16]


def test_chunk_cuda_graph_replay():
    """No host sync inside: the chunked call captures into a CUDA graph and replays equal."""
    from glm53.kernels import kda_chunk

    q, k, v, g, beta, state, cu, ids, init = _inputs([300, 1, 64], 32, torch.bfloat16, 3)
    start = state.clone()
    o_eager = kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu, ids, init)
    s_eager = state.clone()
    state.copy_(start)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu, ids, init)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = kda_chunk.kda_chunk_attention(q, k, v, g, beta, state, cu, ids, init)
    state.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager)
    assert torch.equal(state, s_eager)
