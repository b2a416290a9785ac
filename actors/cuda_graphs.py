"""CUDA graphs for uniform decode steps: the trunk forward + lm_head replayed from static buffers.

A step is *uniform* when every sequence brings the same number of query tokens w (w = 1 for
plain decode, 1 + k when every sequence verifies k drafts). Such a step is padded to the next
captured batch size b (a bucket) and copied into static device buffers that every graph reads
(one buffer of bytes, so a step costs one host-to-device copy; tokens still in flight are
filled in by the graph from the last step's samples on the device); the graph of (b, w) is
replayed, and the caller samples eagerly from the first rows.

Padding never touches real state: a padded sequence starts at position 0 in the caches' extra
state slot `pad_slot` (KDA state, short-conv window and indexer ring; no request owns it), its
block table is all null block 0, so its latent rows and closed pools land in block 0, which the
block pool never hands out and no real sequence reads (its block tables address only its own
blocks up to its position; table padding is masked by position).

Block tables are as wide in a graph as one of a few context sizes (`table_buckets`; the widest
is `max_blocks`, the longest sequence the caches can hold), and a step replays the graph of the
narrowest that holds its longest sequence: the kernels size their grids from shapes only and
read lengths from device tensors (no host sync on the CUDA path), so a graph as wide as the
whole context would launch the indexer's scoring and pool selection over every pool a 1M-token
table addresses for an 8K-token sequence. They live on the device, one row
per state slot, for as long as the slot's request runs: the engine sends only what changed
(a row reset when a slot changes hands, the blocks a request gained), every step, graph or
eager, applies it, and a graph gathers its rows by state slot as its first node. A step without
a delta (built by hand) has its whole tables written into its rows instead.

Eligibility (anything else runs eagerly): the runner is on CUDA without enforce_eager and
capture succeeded; every sequence computes w tokens with w = 1, or w = 1 + num_spec and every
sequence verifies exactly num_spec drafts; n <= the largest bucket b with b x w <= the graphs'
`max_tokens` (DEFAULT_MAX_GRAPH_TOKENS); the step's block tables fit max_blocks. Sampling
stays eager, so any sampling settings, non-sampling rows and prompt-logprob rows are fine (the
graph's logits cover every row).

A speculative step is decided on the host (acceptance reads the samples); what follows it, the
KDA commit of the accepted tokens and, with a greedy MTP drafter, the draft passes, is a second
graph per bucket and number of draft passes (`run_accepted`) that reads the verify graph's
outputs and one small static buffer of kept rows and emitted tokens: one launch instead of a
few hundred eager ones.

Every graph writes its outputs (hidden states, tap states, fp32 logits and, at w > 1, the KDA
layers' replay for the commit) into one set shared by all of them, sized by the largest graph
(graph_outputs.py): a run's outputs are valid until the next run, so the pool keeps only
scratch, which the smaller graphs reuse.

`capture=False` runs the same padded static-buffer forward eagerly (any device), into the same
shared outputs: CPU tests use it to check that padding changes nothing for the real sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .caches import ModelCaches
from .forward_batch import DeferredStates, ForwardBatch
from .graph_outputs import GraphOutputs
from .models.glm5_next import Glm5NextForCausalLM
from .step import StepInput
from .transfers import to_device

logger = logging.getLogger(__name__)

# rows (batch x width) of the largest graph captured by default: a wider step is compute-bound
# enough to launch eagerly, and every graph row costs memory (the shared outputs, with a verify
# width each KDA layer's replay: ~2.7 MiB a row for the real model at TP2, and the pool's
# scratch), so the cap, not the number of sequences times the verify width, sizes the graphs
DEFAULT_MAX_GRAPH_TOKENS = 512

# contexts (tokens) whose block-table widths are captured by default, besides the model's
# longest: a short sequence's step does not pay for scoring and selecting over the pools of a
# table as wide as the longest one
DEFAULT_CONTEXT_SIZES = (16384, 131072)

# decode batch sizes captured by default (those <= max_num_seqs, plus max_num_seqs itself)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def batch_buckets(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Ascending bucket sizes: `sizes` (default DEFAULT_BATCH_SIZES) capped at max_num_seqs,
    which is always a bucket so that every decode batch fits one."""
    sizes = DEFAULT_BATCH_SIZES if sizes is None else sizes
    if any(s < 1 for s in sizes):
        raise ValueError(f"graph batch sizes must be >= 1, got {sizes}")
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def table_buckets(max_blocks: int, block_size: int,
                  context_sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Ascending block-table widths (blocks) of the graphs: those of `context_sizes` tokens
    (default DEFAULT_CONTEXT_SIZES) narrower than max_blocks, and max_blocks itself."""
    sizes = DEFAULT_CONTEXT_SIZES if context_sizes is None else context_sizes
    if any(s < 1 for s in sizes):
        raise ValueError(f"graph context sizes must be >= 1 token, got {sizes}")
    widths = {-(-s // block_size) for s in sizes}
    return tuple(sorted({m for m in widths if m < max_blocks} | {max_blocks}))


class GraphKey(NamedTuple):
    """The graph serving a uniform step: its batch size, tokens per sequence and block-table
    width (blocks)."""
    batch: int
    width: int
    blocks: int


def uniform_width(step: StepInput) -> int | None:
    """w when every sequence computes exactly w tokens and, with drafts, verifies w - 1 of
    them (so all or none of its KDA states are deferred); None otherwise."""
    lengths = np.diff(step.cu_seqlens)
    if lengths.size == 0 or (lengths != lengths[0]).any():
        return None
    w = int(lengths[0])
    drafts = step.num_drafts if step.num_drafts is not None else np.zeros(len(lengths))
    return w if (drafts == w - 1).all() else None


@dataclass(frozen=True)
class _Graph:
    """A graph and its outputs: views of the first b * w rows of the shared GraphOutputs."""
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor  # [b * w, D]
    taps: torch.Tensor | None  # [b * w, n_taps * D]
    logits: torch.Tensor  # [b * w, V] fp32
    pending: dict[int, tuple[torch.Tensor, ...] | None]  # KDA layer id -> what `commit` reads


class StaticInputs:
    """The device buffers every graph reads, with two host mirrors (pinned on CUDA), the last
    step's samples, and the persistent block tables.

    A step of b sequences of w tokens (t = b w rows) is one copy of the first `layout(b,
    w).nbytes` bytes of `dev`: int64 token_ids, positions, query_seq, slot_mapping,
    fill_source [t] each, cu_seqlens [b + 1], state_ids [b], the block-table delta's slots,
    columns and blocks [u] each (u = TABLE_UPDATES_PER_SEQ b); then bool has_initial_state,
    defer_state [b] each and fill [t]. Each (b, w) has its own packed layout, which its
    graphs read, so a batch-1 step copies ~100 bytes whatever the largest graph.
    `samples` [max_samples] int64: the samples of the step before, which the runner's sampler
    writes (`samples_out`). The graph's first nodes (`prologue`) make row i's token
    samples[fill_source[i]] where fill[i] (a placeholder: overlapped scheduling) and set the
    delta's table entries, so a decode step needs no copy or index kernel of its own besides.
    `tables` [pad_slot + 1, max_blocks] int64: row s is the block table of the request in state
    slot s (the pad slot's row stays all null block 0); a step sends only its changes, not the
    1.6 MB of 64 sequences x 202K context: in the graph when they fit (`delta_in_graph`),
    else by `update_tables` before it.
    """

    # block-table entries a graphed step carries per sequence: a decode or verify step of w
    # <= block size tokens crosses at most one block boundary, MTP's lookahead one more
    TABLE_UPDATES_PER_SEQ = 2

    def __init__(self, max_seqs: int, max_width: int, max_blocks: int, block_size: int,
                 pad_slot: int, device: torch.device, max_samples: int | None = None) -> None:
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.block_size, self.pad_slot, self.device = block_size, pad_slot, device
        pin = device.type == "cuda"
        self.layouts: dict[tuple[int, int], StepLayout] = {}
        # (mirror, b, w) -> its fields as numpy arrays
        self.host_fields: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
        nbytes = self.layout(max_seqs, max_width).nbytes
        # two host mirrors, used in turn: a step is loaded while the one before it may still
        # be copying from its mirror (overlapped execution keeps at most two steps in flight)
        self.mirrors = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
                        for _ in range(2)]
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # what acceptance decided, for the graph after a verify step: kept rows and the token
        # emitted at the last of them [2, N_max] (two host mirrors too)
        self.accept_mirrors = [torch.zeros(2, max_seqs, dtype=torch.int64, pin_memory=pin)
                               for _ in range(2)]
        self.accept_dev = torch.ones(2, max_seqs, dtype=torch.int64, device=device)
        self.samples = torch.zeros(max_samples or max_seqs * max_width, dtype=torch.int64,
                                   device=device)
        self.tables = torch.zeros(pad_slot + 1, max_blocks, dtype=torch.int64, device=device)
        self.turn = 0

    def layout(self, b: int, w: int) -> StepLayout:
        """The packed layout of a step of b sequences of w tokens (made once per (b, w))."""
        if (b, w) not in self.layouts:
            t, u = b * w, self.TABLE_UPDATES_PER_SEQ * b
            self.layouts[b, w] = StepLayout.of(
                dict(token_ids=t, positions=t, query_seq=t, slot_mapping=t, fill_source=t,
                     cu_seqlens=b + 1, state_ids=b, table_slots=u, table_cols=u,
                     table_blocks=u),
                dict(has_initial_state=b, defer_state=b, fill=t))
        return self.layouts[b, w]

    def _fields(self, buffer: torch.Tensor, b: int, w: int) -> dict[str, torch.Tensor]:
        return self.layout(b, w).views(buffer)

    def views(self, b: int, w: int, m: int | None = None) -> tuple[torch.Tensor, ForwardBatch]:
        """(token ids [b*w], ForwardBatch of b sequences of w tokens) over the buffers; the
        block tables, m blocks wide (default max_blocks), are gathered from `tables` by state
        slot (a node of the graph)."""
        f = self._fields(self.dev, b, w)
        return f["token_ids"], ForwardBatch(
            positions=f["positions"],
            query_seq=f["query_seq"],
            cu_seqlens=f["cu_seqlens"],
            state_ids=f["state_ids"],
            has_initial_state=f["has_initial_state"],
            block_tables=self.tables[:, :m].index_select(0, f["state_ids"]),
            slot_mapping=f["slot_mapping"],
            defer_state=f["defer_state"] if w > 1 else None,
        )

    def prologue(self, b: int, w: int) -> None:
        """What a graph of (b, w) runs first: placeholder tokens take their samples (a gather
        and a select) and the step's block-table entries are set (padding entries write the
        pad slot's null block 0 again): three kernels."""
        f = self._fields(self.dev, b, w)
        ids = f["token_ids"]
        torch.where(f["fill"], self.samples[f["fill_source"]], ids, out=ids)
        self.tables[f["table_slots"], f["table_cols"]] = f["table_blocks"]

    def samples_out(self, n: int) -> torch.Tensor:
        """Where a step's n samples go ([n] int64, `Sampler(out=)`), for the next step's
        placeholders to read."""
        if n > self.samples.shape[0]:
            raise ValueError(f"{n} samples in a step, but room for {self.samples.shape[0]}")
        return self.samples[:n]

    def delta_in_graph(self, step: StepInput, b: int) -> bool:
        """Whether the graph of a b-sequence bucket applies `step`'s block-table delta (no row
        resets, at most TABLE_UPDATES_PER_SEQ b entries); else `update_tables` must."""
        updates, resets = step.block_table_updates, step.block_table_resets
        return (updates is not None and (resets is None or not len(resets))
                and len(updates) <= self.TABLE_UPDATES_PER_SEQ * b)

    def accepted(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept rows [b], token emitted at the last kept row [b]) of the last verify step."""
        return self.accept_dev[0, :b], self.accept_dev[1, :b]

    def load_accepted(self, kept: np.ndarray, emitted: np.ndarray, b: int) -> None:
        """Copy acceptance's result for n <= b sequences; padding keeps 1 row, token 0."""
        host = self.accept_mirrors[self.turn]
        values = host.numpy()
        n = len(kept)
        values[0, :b], values[1, :b] = 1, 0
        values[0, :n], values[1, :n] = kept, emitted
        self.accept_dev[:, :b].copy_(host[:, :b], non_blocking=True)

    def load_samples(self, sampled: torch.Tensor, b: int) -> None:
        """The result of a step that verified no drafts, from its samples on the device
        (sampled [n], one per sequence) without a trip to the host: every row kept, each
        sequence emitting its sample; padding keeps 1 row, token 0."""
        n = sampled.shape[0]
        self.accept_dev[0, :b] = 1
        self.accept_dev[1, :n] = sampled
        self.accept_dev[1, n:b] = 0

    def update_tables(self, step: StepInput) -> None:
        """Bring the rows of `step`'s state slots up to date: its delta (rows reset, then
        (slot, column, block) entries set) in one small copy, or without one its whole tables.
        Every step the runner executes comes here, so the rows never go stale."""
        if step.block_table_updates is None:
            rows = to_device(np.asarray(step.state_ids, np.int64), self.device)
            width = step.block_tables.shape[1]
            self.tables[rows] = 0
            self.tables[rows, :width] = to_device(step.block_tables.astype(np.int64),
                                                  self.device)
            return
        resets, updates = step.block_table_resets, step.block_table_updates
        if not len(resets) and not len(updates):
            return
        packed = to_device(np.concatenate([resets, updates.T.reshape(-1)]), self.device)
        r = len(resets)
        self.tables[packed[:r]] = 0
        slots, cols, blocks = packed[r:].view(3, -1)
        self.tables[slots, cols] = blocks

    def load(self, step: StepInput | None, b: int, w: int) -> None:
        """Copy `step` (n <= b sequences of w tokens; None = all padding) into the buffers,
        padded to b sequences that start at position 0 in the pad slot over the null block,
        with its placeholders and, if `delta_in_graph`, its block-table delta (`prologue`
        applies both): one copy."""
        n = 0 if step is None else len(step.state_ids)
        real = n * w
        host = self.mirrors[self.turn]
        key = (self.turn, b, w)
        if key not in self.host_fields:  # numpy views of the mirror, made once
            self.host_fields[key] = {name: v.numpy()
                                     for name, v in self._fields(host, b, w).items()}
        f = self.host_fields[key]
        self.turn ^= 1
        pad_pos = np.tile(np.arange(w, dtype=np.int64), b - n)
        f["token_ids"][real:] = 0
        f["positions"][real:] = pad_pos
        f["slot_mapping"][real:] = pad_pos % self.block_size  # block 0: the null block
        f["state_ids"][n:] = self.pad_slot
        f["query_seq"][:] = np.repeat(np.arange(b), w)
        f["cu_seqlens"][:] = np.arange(b + 1) * w
        f["has_initial_state"][:], f["defer_state"][:] = False, False
        f["fill"][:], f["fill_source"][:] = False, 0
        f["table_slots"][:], f["table_cols"][:], f["table_blocks"][:] = self.pad_slot, 0, 0
        if n:
            f["token_ids"][:real] = step.token_ids
            f["positions"][:real] = step.positions
            f["slot_mapping"][:real] = step.slot_mapping
            f["state_ids"][:n] = step.state_ids
            f["has_initial_state"][:n] = step.positions[step.cu_seqlens[:-1]] > 0
            if step.num_drafts is not None:
                f["defer_state"][:n] = step.num_drafts > 0
            if step.placeholder_rows is not None:
                f["fill"][step.placeholder_rows] = True
                f["fill_source"][step.placeholder_rows] = step.placeholder_sources
            if self.delta_in_graph(step, b):
                k = len(step.block_table_updates)
                f["table_slots"][:k], f["table_cols"][:k], f["table_blocks"][:k] = \
                    step.block_table_updates.T
        nbytes = self.layout(b, w).nbytes
        self.dev[:nbytes].copy_(host[:nbytes], non_blocking=True)


@dataclass(frozen=True)
class StepLayout:
    """Where each field of a step's inputs lies in a buffer of bytes: int64 fields first (8-byte
    aligned), then bool ones; `nbytes` in all."""
    int64: dict[str, tuple[int, int]]  # name -> (first element, size) in int64 elements
    bool_start: int  # byte offset of the bool fields
    bools: dict[str, tuple[int, int]]  # name -> (first byte after bool_start, size)
    nbytes: int

    @staticmethod
    def of(int64_sizes: dict[str, int], bool_sizes: dict[str, int]) -> StepLayout:
        def offsets(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
            out, start = {}, 0
            for name, size in sizes.items():
                out[name] = (start, size)
                start += size
            return out, start

        int64, n_int = offsets(int64_sizes)
        bools, n_bool = offsets(bool_sizes)
        return StepLayout(int64, 8 * n_int, bools, 8 * n_int + n_bool)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field as a tensor view of `buffer` (uint8, at least nbytes)."""
        ints = buffer[:self.bool_start].view(torch.int64)
        flags = buffer[self.bool_start:self.nbytes].view(torch.bool)
        return {**{k: ints[a:a + n] for k, (a, n) in self.int64.items()},
                **{k: flags[a:a + n] for k, (a, n) in self.bools.items()}}


# drafter(hidden [b*w, D], token_ids [b*w], batch, kept [b], emitted [b], passes) -> drafts
# [b, passes]: draft tokens after a uniform step from the device tensors alone (a graph
# replays it)
Drafter = Callable[[torch.Tensor, torch.Tensor, ForwardBatch, torch.Tensor, torch.Tensor, int],
                   torch.Tensor]


class DecodeGraphs:
    """Graphs (or, with capture=False, their eager emulation) of the trunk forward + lm_head
    for uniform steps of `widths` tokens per sequence and `batch_sizes` sequences (those of at
    most `max_tokens` rows: b x w) with block tables of `table_widths` blocks (default:
    table_buckets(max_blocks, block size)), and of what follows a speculative one once
    acceptance is known.

    run(step) returns (hidden [b*w, D], taps or None, logits [b*w, V] fp32), valid until the
    next run (every graph writes the same `outputs`); rows past the step's n*w are padding.
    After a run of a step whose sequences all verify drafts (w > 1) or all may draft (with a
    `drafter` of up to `draft_passes` passes), `run_accepted` replays the step's second graph:
    the KDA commit of the accepted tokens (w > 1) and as many draft passes as the step proposes
    drafts (none: only the MTP cache rows of the step's rows, which the first pass writes).
    Without it (an eager step) the KDA layers' pending tensors are those of the replayed graph,
    so `commit_speculative` works as after an eager forward.
    """

    def __init__(self, model: Glm5NextForCausalLM, caches: ModelCaches, *, pad_slot: int,
                 max_blocks: int, batch_sizes: tuple[int, ...], widths: tuple[int, ...],
                 tap_layers: tuple[int, ...] = (), capture: bool = True,
                 drafter: Drafter | None = None, draft_passes: int = 0,
                 table_widths: tuple[int, ...] | None = None,
                 max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS,
                 max_samples: int | None = None) -> None:
        if (drafter is None) != (draft_passes == 0):
            raise ValueError("a drafter needs draft_passes >= 1, and passes need a drafter")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model, self.caches, self.tap_layers = model, caches, tap_layers
        self.drafter, self.draft_passes = drafter, draft_passes
        self.batch_sizes, self.widths = batch_sizes, widths
        # width -> the batch sizes captured for it (b x w <= max_tokens)
        self.sizes = {w: tuple(b for b in batch_sizes if b * w <= max_tokens) for w in widths}
        rows = max((b * w for w, sizes in self.sizes.items() for b in sizes), default=1)
        self.table_widths = (table_buckets(max_blocks, caches.block_size)
                             if table_widths is None else table_widths)
        if self.table_widths[-1] != max_blocks or list(self.table_widths) != sorted(
                set(self.table_widths)):
            raise ValueError(f"table widths {self.table_widths} must ascend to max_blocks "
                             f"({max_blocks})")
        device = model.embed_tokens.weight.device
        self.static = StaticInputs(max(batch_sizes), max(widths), max_blocks, caches.block_size,
                                   pad_slot, device, max_samples)
        self.kda = {i: layer.self_attn for i, layer in enumerate(model.layers) if layer.is_kda}
        self.outputs = GraphOutputs.allocate(
            model.config, rows, n_taps=len(tap_layers),
            verify=any(w > 1 and sizes for w, sizes in self.sizes.items()),
            dtype=model.embed_tokens.weight.dtype, device=device, ps=model.parallel)
        self.graph_caches = self.outputs.caches(caches)  # KDA replays into `outputs`
        self.graphs: dict[GraphKey, _Graph] = {}  # empty when emulating
        # (key, passes) -> the graph after acceptance and its drafts [b, passes] (None
        # without a drafter)
        self.accepted_graphs: dict[tuple[GraphKey, int],
                                   tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.last: tuple[GraphKey, _Graph] | None = None  # emulation: the last run
        self.num_replays = 0  # steps served by a graph (or its emulation)
        if capture:
            self._capture_all(device)

    def bucket(self, step: StepInput) -> GraphKey | None:
        """The graph that serves `step`, or None (the step runs eagerly)."""
        w = uniform_width(step)
        n = len(step.state_ids)
        sizes = self.sizes.get(w)
        if not sizes or n > sizes[-1]:
            return None
        m = step.block_tables.shape[1]
        if m > self.static.max_blocks:
            return None
        return GraphKey(next(b for b in sizes if b >= n), w,
                        next(t for t in self.table_widths if t >= m))

    def run(self, step: StepInput, key: GraphKey,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's placeholder tokens are read from `static.samples` (the step before's
        samples: `StaticInputs.keep_samples`)."""
        b, w, m = key
        self.static.load(step, b, w)
        self.num_replays += 1
        if not self.graphs:  # emulation: the same padded forward, eagerly
            g = self._forward(b, w, m)
            self.last = key, g
            return g.hidden, g.taps, g.logits
        g = self.graphs[key]
        g.graph.replay()
        self._set_pending(g)
        return g.hidden, g.taps, g.logits

    def _set_pending(self, g: _Graph) -> None:
        """The KDA layers' pending tensors become `g`'s (what a commit after it reads)."""
        for i, attn in self.kda.items():
            attn.pending = g.pending[i]

    def has_accepted_graph(self, w: int) -> bool:
        """Whether a step of width w that speculates ends in `run_accepted` (a commit to
        replay, or drafts to make)."""
        return w > 1 or self.drafter is not None

    def run_accepted(self, key: GraphKey, kept: np.ndarray | None,
                     emitted: np.ndarray | torch.Tensor, drafts: int = 0,
                     ) -> torch.Tensor | None:
        """After `run(step, key)` of a speculative step of n sequences and acceptance on the
        host: commit the KDA states past the kept rows (kept [n], 1 + accepted drafts) and,
        with a drafter, draft from the token emitted at the last kept row (emitted [n]) as
        many tokens as the step proposes at most (`drafts`; 0 writes only the MTP caches of
        the step's rows). kept None: a step of width 1 that verified nothing, whose samples
        `emitted` ([n], on the device) are its tokens: no acceptance on the host, so the
        step need not be waited for. Returns the drafts [n, min(drafts, draft_passes)] on the
        device (valid until the next run), or None without a drafter."""
        b, w, m = key
        passes = 0 if self.drafter is None else min(drafts, self.draft_passes)
        if kept is None:
            if w != 1:
                raise ValueError(f"a step of width {w} verifies drafts: acceptance decides")
            self.static.load_samples(emitted, b)
        else:
            self.static.load_accepted(kept, emitted, b)
        if not self.graphs:
            if self.last is None or self.last[0] != key:
                raise RuntimeError(f"run_accepted{key} follows no run of that bucket")
            out = self._after_acceptance(b, w, m, self.last[1].hidden, passes)
        else:
            graph, out = self.accepted_graphs[(self._accepted_key(key), passes)]
            graph.replay()
        return None if out is None else out[:len(emitted)]

    def _accepted_key(self, key: GraphKey) -> GraphKey:
        """The bucket whose graph after acceptance serves `key`'s: its own when a drafter's
        passes read the block tables; without one, the commit reads none (and every graph's
        replay lies in the shared outputs), so one graph per (b, w) serves every table width."""
        return key if self.drafter is not None else key._replace(blocks=self.table_widths[-1])

    @torch.inference_mode()
    def _after_acceptance(self, b: int, w: int, m: int, hidden: torch.Tensor,
                          passes: int) -> torch.Tensor | None:
        ids, batch = self.static.views(b, w, m)
        kept, emitted = self.static.accepted(b)
        if w > 1:  # every sequence verified: all deferred, padding into the pad slot
            self.model.commit_speculative(
                DeferredStates(batch.cu_seqlens, batch.state_ids, batch.has_initial_state),
                self.caches, kept)
        return None if self.drafter is None else self.drafter(hidden, ids, batch, kept,
                                                              emitted, passes)

    @torch.inference_mode()
    def _forward(self, b: int, w: int, m: int) -> _Graph:
        """The padded forward of (b, w) over tables m blocks wide into the shared outputs: the
        KDA replay (w > 1) and the logits are written there by their producers, hidden and
        taps by one copy each."""
        self.static.prologue(b, w)
        ids, batch = self.static.views(b, w, m)
        out = self.model(ids, batch, self.graph_caches, self.tap_layers)
        hidden, taps = out if self.tap_layers else (out, None)
        t, o = b * w, self.outputs
        o.hidden[:t].copy_(hidden)
        if taps is not None:
            o.taps[:t].copy_(taps)
        self.model.compute_logits(hidden, out=o.logits[:t])
        return _Graph(None, o.hidden[:t], None if taps is None else o.taps[:t], o.logits[:t],
                      {i: attn.pending for i, attn in self.kda.items()})

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        """Capture every (b, w, table width), largest first, into one memory pool (smaller
        graphs reuse the larger ones' scratch). A warm-up run before each capture compiles the
        Triton kernels for its shapes; warm-ups and captures touch only the pad slot and
        block 0."""
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        keys = [GraphKey(b, w, m) for w in sorted(self.widths, reverse=True)
                for b in sorted(self.sizes[w], reverse=True)
                for m in sorted(self.table_widths, reverse=True)]
        for key in keys:
            b, w, m = key
            self.static.load(None, b, w)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward(b, w, m)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                g = self._forward(b, w, m)
            self.graphs[key] = _Graph(graph, g.hidden, g.taps, g.logits, g.pending)
            if self.has_accepted_graph(w) and self._accepted_key(key) == key:
                for passes in range(self.draft_passes + 1):
                    self.accepted_graphs[(key, passes)] = self._capture_accepted(
                        key, passes, g, pool, stream)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (batch sizes %s, widths %s, tables of %s blocks) "
                    "in %.1f s, %.0f MiB besides their %.0f MiB of shared outputs",
                    len(self.graphs), list(self.batch_sizes), list(self.widths),
                    list(self.table_widths), time.perf_counter() - start, used / 2**20,
                    self.outputs.nbytes / 2**20)

    def _capture_accepted(self, key: GraphKey, passes: int, g: _Graph, pool,
                          stream: torch.cuda.Stream,
                          ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """The graph after acceptance of bucket `key` with `passes` draft passes, reading the
        verify graph `g`'s outputs (its KDA pending tensors, its hidden states). Its warm-up
        commits and drafts padding only (the static inputs hold an all-padding step)."""
        device = g.hidden.device
        b, w, m = key
        self.static.load_accepted(np.zeros(0, np.int64), np.zeros(0, np.int64), b)
        self._set_pending(g)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._after_acceptance(b, w, m, g.hidden, passes)
        torch.cuda.current_stream(device).wait_stream(stream)
        self._set_pending(g)  # the warm-up's commit took them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            drafts = self._after_acceptance(b, w, m, g.hidden, passes)
        return graph, drafts
