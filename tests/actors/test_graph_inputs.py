"""What the decode graphs read, without a model: `StaticInputs` (a step's packed inputs, the
prologue that fills placeholders and sets the block-table delta, the persistent tables) and the
buckets a step is padded to (batch sizes, table widths, uniform widths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.cuda_graphs import StaticInputs, batch_buckets, table_buckets, uniform_width
from glm53.actors.step import StepInput


def test_static_buffers_hold_what_a_fresh_load_writes():
    """Loads of steps with more or fewer sequences and wider or narrower block tables, some all
    padding: after each, the device tensors a graph reads equal those of a fresh StaticInputs
    given only that step, in every tensor the graph reads (stale table entries are re-zeroed,
    not left behind)."""
    rng = np.random.default_rng(0)
    args = dict(max_seqs=6, max_width=2, max_blocks=9, block_size=4, pad_slot=7,
                device=torch.device("cpu"))
    kept = StaticInputs(**args)
    for i in range(40):
        b, w = int(rng.choice([1, 2, 4, 6])), int(rng.integers(1, 3))
        n = int(rng.integers(0, b + 1))
        width = int(rng.integers(1, 10))
        step = None if n == 0 and i % 2 else StepInput(
            i, [""] * n, rng.integers(0, 99, n * w), rng.integers(0, 30, n * w),
            np.arange(n + 1) * w, rng.integers(1, 50, (n, width)).astype(np.int32),
            rng.integers(0, 99, n * w), np.arange(n), np.arange(n), np.arange(n), None)
        fresh = StaticInputs(**args)
        for static in (kept, fresh):
            static.load(step, b, w)
            if step is not None:
                static.update_tables(step)
        (ids, batch), (ids_f, batch_f) = kept.views(b, w), fresh.views(b, w)
        assert torch.equal(ids, ids_f), i
        for name in ("positions", "query_seq", "cu_seqlens", "state_ids", "has_initial_state",
                     "block_tables", "slot_mapping", "defer_state"):
            got, want = getattr(batch, name), getattr(batch_f, name)
            assert (got is None and want is None) or torch.equal(got, want), (i, name)


def test_graph_prologue_fills_placeholders_and_sets_the_table_delta():
    """What a graph runs first (`prologue`, after a step's one copy): placeholder rows take
    samples[source], every other row keeps the token the step brought, and the block-table
    delta's entries are set when it fits the bucket (`delta_in_graph`), the pad slot's row
    staying all null block; a step without placeholders or delta after one with them changes
    nothing (no marks linger in the mirror used two loads ago). Each (b, w) reads its own
    packed layout. Samples beyond the buffer are refused."""
    rng = np.random.default_rng(1)
    static = StaticInputs(max_seqs=4, max_width=2, max_blocks=3, block_size=4, pad_slot=5,
                          device=torch.device("cpu"), max_samples=8)
    tables = torch.zeros_like(static.tables)
    for i in range(16):
        n, w = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        b = int(rng.choice([b for b in (1, 2, 4) if b >= n]))
        tokens = rng.integers(100, 200, n * w)
        rows = np.sort(rng.choice(n * w, int(rng.integers(0, n * w + 1)), replace=False))
        sources = rng.integers(0, 8, len(rows))
        marked = i % 3 != 2
        k = int(rng.integers(0, 2 * b + 2)) if marked else 0  # 2 b + 1: too many for the graph
        cells = rng.choice(5 * 3, k, replace=False)  # distinct (slot, column): not the pad's
        updates = np.stack([cells // 3, cells % 3, rng.integers(1, 50, k)], axis=1)
        step = StepInput(i, [""] * n, tokens, np.arange(n * w) + 1, np.arange(n + 1) * w,
                         np.ones((n, 1), np.int32), np.arange(n * w), np.arange(n),
                         np.arange(n), np.arange(n), None,
                         block_table_resets=np.zeros(0, np.int64), block_table_updates=updates,
                         placeholder_rows=rows if marked else None,
                         placeholder_sources=sources if marked else None)
        samples = torch.from_numpy(rng.integers(1000, 2000, 8))
        static.samples_out(8).copy_(samples)
        static.load(step, b, w)
        static.prologue(b, w)
        want = tokens.copy()
        if marked:
            want[rows] = samples.numpy()[sources]
        ids, _ = static.views(b, w)
        assert ids[:n * w].tolist() == want.tolist(), i
        assert not ids[n * w:].any()  # padding rows: token 0
        assert static.delta_in_graph(step, b) == (k <= 2 * b)
        if not static.delta_in_graph(step, b):  # the runner's way: before the graph
            static.update_tables(step)
        for slot, col, block in updates:
            tables[slot, col] = int(block)
        assert torch.equal(static.tables, tables), i
        assert static.layout(b, w).nbytes == 8 * (5 * b * w + 2 * b + 1 + 3 * 2 * b) \
            + 2 * b + b * w
    with pytest.raises(ValueError, match="room for 8"):
        static.samples_out(9)


def test_buckets_and_widths():
    assert table_buckets(100, 16) == (100,)  # 1600 tokens: shorter than every default size
    assert table_buckets(65536, 16) == (1024, 8192, 65536)  # 16K, 128K and 1M tokens
    assert table_buckets(10, 4, (5, 8, 9, 100)) == (2, 3, 10)
    with pytest.raises(ValueError, match=">= 1 token"):
        table_buckets(10, 4, (0,))
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert batch_buckets(8, (3, 16)) == (3, 8)
    with pytest.raises(ValueError):
        batch_buckets(8, (0, 4))

    def step(lengths, drafts=None) -> StepInput:
        cu = np.concatenate([[0], np.cumsum(lengths)])
        return StepInput(0, [], np.zeros(cu[-1]), np.zeros(cu[-1]), cu, np.zeros((2, 1)),
                         np.zeros(cu[-1]), np.zeros(len(lengths)), np.zeros(0), np.zeros(0),
                         None, num_drafts=None if drafts is None else np.array(drafts))

    assert uniform_width(step([1, 1, 1])) == 1
    assert uniform_width(step([1, 2])) is None  # mixed widths: eager
    assert uniform_width(step([3, 3], [2, 2])) == 3  # every sequence verifies 2 drafts
    assert uniform_width(step([3, 3], [2, 0])) is None  # a 3-token chunk without drafts
    assert uniform_width(step([3, 3])) is None
    assert uniform_width(step([1, 1], [0, 0])) == 1
