"""benchmarks/mtp_cycle.py on CPU, over the tiny model with its MTP layer: one cycle does what
`ModelRunner.launch` does with the same verify step (same acceptance, emitted tokens, next
drafts and cache bytes), and `mtp_cycle_ms` runs its cycles (the KDA states advance; the
accepted counts are what acceptance allows). Times are not checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.caches import KDAState, ModelCaches
from glm53.actors.cuda_graphs import DecodeGraphs
from glm53.actors.model_runner import ModelRunner
from glm53.actors.speculative.verify import SyntheticAcceptance

BLOCK, K, SLOTS, BLOCKS, CTX = 16, 3, 4, 16, 40
ACCEPT = (1.0, 1.0, 0.0)  # two drafts accepted a cycle: commit and proposer see 3 rows


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ModelRunner:
    runner = ModelRunner(str(tiny_checkpoint), with_mtp=True, num_spec=K, num_blocks=BLOCKS,
                         num_slots=SLOTS, block_size=BLOCK)
    runner.allocate_caches(BLOCKS)
    runner.graphs = runner.make_graphs(capture=False)  # the graph path, emulated
    return runner


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    import mtp_cycle

    return mtp_cycle


def _tables(n: int) -> list[list[int]]:
    per = -(-CTX // BLOCK)
    return [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]


def _tensors(caches: ModelCaches) -> list[torch.Tensor]:
    return [t for state in (*caches.layers, caches.mtp) for t in vars(state).values()
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("n", [1, 2])
def test_cycle_is_what_the_runner_launches(runner, bench, n):
    rng = np.random.default_rng(n)
    vocab = runner.config.vocab_size
    step = bench.verify_step(0, CTX, np.array(_tables(n), np.int32), rng.integers(0, vocab, n),
                             rng.integers(0, vocab, (n, K)), BLOCK, delta=False)
    before = [t.clone() for t in _tensors(runner.caches)]
    runner.verify_drafts = SyntheticAcceptance(ACCEPT)
    replays = runner.graphs.num_replays
    out = runner.execute(step)
    assert runner.graphs.num_replays == replays + 1  # through the graphs, as on CUDA
    after = [t.clone() for t in _tensors(runner.caches)]
    for t, old in zip(_tensors(runner.caches), before, strict=True):
        t.copy_(old)
    cycle = bench.MTPCycle(runner.model, runner.caches, runner.config, n, K, ACCEPT)
    accepted, sampled, drafts = cycle.run(step)
    assert accepted.tolist() == out.num_accepted.tolist() == [2] * n
    assert np.array_equal(sampled, out.sampled)
    assert drafts.shape == (n, K) and (drafts >= 0).all()
    assert np.array_equal(drafts, out.draft_ids)
    for got, want in zip(_tensors(runner.caches), after, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("n", "acceptance"), [(1, None), (2, ACCEPT)])
def test_mtp_cycle_ms_runs_cycles(runner, bench, n, acceptance):
    cfg = runner.config
    caches = ModelCaches.allocate(cfg, BLOCKS, BLOCK, n + 1, runner.model.embed_tokens.weight.dtype,
                                  with_mtp=True, num_spec=K)
    kda = [s.recurrent for s in caches.layers if isinstance(s, KDAState)]
    steps = 2
    with torch.inference_mode():
        ms, split = bench.mtp_cycle_ms(runner.model, caches, cfg, n, CTX, _tables(n),
                                       num_spec=K, steps=steps, acceptance=acceptance)
    assert ms > 0
    assert all(split[k] > 0 for k in ("verify_sample_ms", "accept_ms", "commit_draft_ms"))
    assert split["verify_width"] == 1 + K and not split["cuda_graphs"]
    counts = split["accepted_drafts"]
    assert set(counts) <= set(range(K + 1)) and sum(counts.values()) == steps * n
    if acceptance is not None:
        assert counts == {2: steps * n} and split["acceptance"] == "synthetic 1,1,0"
    assert all(s[:n].abs().sum() > 0 for s in kda)  # committed states, from zero
    assert all(s[n:].abs().sum() == 0 for s in kda)  # the graphs' batch is n: nothing pads


def test_caches_without_room_for_the_drafts_are_refused(runner, bench):
    caches = ModelCaches.allocate(runner.config, BLOCKS, BLOCK, 2, torch.float32, with_mtp=True)
    with pytest.raises(ValueError, match="fewer than 3 drafts"):
        bench.MTPCycle(runner.model, caches, runner.config, 1, K)


def test_a_graph_after_acceptance_runs_as_many_passes_as_the_step_drafts(runner, bench):
    """The graphs after acceptance come in one variant per number of draft passes: fewer
    passes draft the first tokens of more (each pass reads only the ones before it), and a
    step that proposes nothing writes only what the first pass writes (the MTP cache rows of
    its rows), bit for bit."""
    n = 2
    rng = np.random.default_rng(7)
    vocab = runner.config.vocab_size
    step = bench.verify_step(0, CTX, np.array(_tables(n), np.int32), rng.integers(0, vocab, n),
                             rng.integers(0, vocab, (n, K)), BLOCK, delta=False)
    graphs = bench.MTPCycle(runner.model, runner.caches, runner.config, n, K).graphs
    before = [t.clone() for t in _tensors(runner.caches)]
    drafted, caches = {}, {}
    for proposed in (3, 2, 1, 0):
        for t, old in zip(_tensors(runner.caches), before, strict=True):
            t.copy_(old)
        graphs.static.update_tables(step)
        key = graphs.bucket(step)
        graphs.run(step, key)
        drafted[proposed] = graphs.run_accepted(key, np.array([3, 1]), np.array([5, 7]),
                                                proposed).numpy()
        caches[proposed] = [t.clone() for t in _tensors(runner.caches)]
    assert [drafted[p].shape for p in (3, 2, 1, 0)] == [(n, 3), (n, 2), (n, 1), (n, 0)]
    assert np.array_equal(drafted[3][:, :2], drafted[2])
    assert np.array_equal(drafted[3][:, :1], drafted[1])
    assert all(torch.equal(a, b) for a, b in zip(caches[1], caches[0], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(caches[2], caches[0], strict=True))
    with pytest.raises(ValueError, match="draft_passes"):
        DecodeGraphs(runner.model, runner.caches, pad_slot=SLOTS, max_blocks=4,
                           batch_sizes=(1,), widths=(1,), capture=False,
                           drafter=graphs.drafter)
