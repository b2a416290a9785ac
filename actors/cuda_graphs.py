"""CUDA graphs for uniform decode steps: the trunk forward + lm_head replayed from static buffers.

A step is *uniform* when every sequence brings the same number of query tokens w (w = 1 for
plain decode, 1 + k when every sequence verifies k drafts). Such a step is padded to the next
captured batch size b (a bucket) and copied into static device buffers that every graph reads
(one flat int64 buffer and one bool buffer, so a step costs one or two host-to-device copies);
the graph of (b, w) is replayed, and the caller samples eagerly from the first rows.

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
    """The device buffers every graph reads, with two host mirrors (pinned on CUDA), and the
    persistent block tables.

    int64 buffer: token_ids, positions, query_seq, slot_mapping [T_max] each, cu_seqlens
    [N_max + 1], state_ids [N_max]. bool buffer: has_initial_state, defer_state [N_max] each.
    `tables` [pad_slot + 1, max_blocks] int64: row s is the block table of the request in state
    slot s (the pad slot's row stays all null block 0); a step sends only its changes
    (`update_tables`), not the 1.6 MB of 64 sequences x 202K context.
    """

    def __init__(self, max_seqs: int, max_width: int, max_blocks: int, block_size: int,
                 pad_slot: int, device: torch.device) -> None:
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.block_size, self.pad_slot, self.device = block_size, pad_slot, device
        t, n = max_seqs * max_width, max_seqs
        sizes = dict(token_ids=t, positions=t, query_seq=t, slot_mapping=t, cu_seqlens=n + 1,
                     state_ids=n)
        pin = device.type == "cuda"
        total = sum(sizes.values())
        # two host mirrors, used in turn: a step is loaded while the one before it may still
        # be copying from its mirror (overlapped execution keeps at most two steps in flight)
        self.mirrors = [(torch.zeros(total, dtype=torch.int64, pin_memory=pin),
                         torch.zeros(2, n, dtype=torch.bool, pin_memory=pin)) for _ in range(2)]
        self.dev = torch.zeros(total, dtype=torch.int64, device=device)
        # what acceptance decided, for the graph after a verify step: kept rows and the token
        # emitted at the last of them [2, N_max] (two host mirrors too)
        self.accept_mirrors = [torch.zeros(2, n, dtype=torch.int64, pin_memory=pin)
                               for _ in range(2)]
        self.accept_dev = torch.ones(2, n, dtype=torch.int64, device=device)
        self.dev_flags = torch.zeros(2, n, dtype=torch.bool, device=device)
        self.tables = torch.zeros(pad_slot + 1, max_blocks, dtype=torch.int64, device=device)
        self.turn = 0
        self.offsets: dict[str, int] = {}
        start = 0
        for name, size in sizes.items():
            self.offsets[name] = start
            start += size

    def _host(self, host: torch.Tensor, name: str, size: int) -> np.ndarray:
        return host.numpy()[self.offsets[name]:self.offsets[name] + size]

    def _dev(self, name: str, size: int) -> torch.Tensor:
        return self.dev[self.offsets[name]:self.offsets[name] + size]

    def views(self, b: int, w: int, m: int | None = None) -> tuple[torch.Tensor, ForwardBatch]:
        """(token ids [b*w], ForwardBatch of b sequences of w tokens) over the buffers; the
        block tables, m blocks wide (default max_blocks), are gathered from `tables` by state
        slot (a node of the graph)."""
        t = b * w
        state_ids = self._dev("state_ids", b)
        return self._dev("token_ids", t), ForwardBatch(
            positions=self._dev("positions", t),
            query_seq=self._dev("query_seq", t),
            cu_seqlens=self._dev("cu_seqlens", b + 1),
            state_ids=state_ids,
            has_initial_state=self.dev_flags[0, :b],
            block_tables=self.tables[:, :m].index_select(0, state_ids),
            slot_mapping=self._dev("slot_mapping", t),
            defer_state=self.dev_flags[1, :b] if w > 1 else None,
        )

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

    def load(self, step: StepInput | None, b: int, w: int,
             fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Copy `step` (n <= b sequences of w tokens; None = all padding) into the buffers,
        padded to b sequences that start at position 0 in the pad slot over the null block;
        `fill` (device token rows, ids) then overwrites the step's placeholder tokens."""
        n = 0 if step is None else len(step.state_ids)
        t, real = b * w, n * w
        host, host_flags = self.mirrors[self.turn]
        self.turn ^= 1
        flags = host_flags.numpy()
        pad_pos = np.tile(np.arange(w, dtype=np.int64), b - n)
        token_ids, positions = self._host(host, "token_ids", t), self._host(host, "positions", t)
        slots = self._host(host, "slot_mapping", t)
        cu, state_ids = self._host(host, "cu_seqlens", b + 1), self._host(host, "state_ids", b)
        token_ids[real:] = 0
        positions[real:] = pad_pos
        slots[real:] = pad_pos % self.block_size  # block 0: the null block
        state_ids[n:] = self.pad_slot
        self._host(host, "query_seq", t)[:] = np.repeat(np.arange(b), w)
        cu[:] = np.arange(b + 1) * w
        flags[:, :b] = False
        if n:
            token_ids[:real] = step.token_ids
            positions[:real] = step.positions
            slots[:real] = step.slot_mapping
            state_ids[:n] = step.state_ids
            flags[0, :n] = step.positions[step.cu_seqlens[:-1]] > 0
            if step.num_drafts is not None:
                flags[1, :n] = step.num_drafts > 0
        self.dev.copy_(host, non_blocking=True)
        self.dev_flags.copy_(host_flags, non_blocking=True)
        if fill is not None:  # stream-ordered after the copy
            self._dev("token_ids", t)[fill[0]] = fill[1]


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
                 max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS) -> None:
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
                                   pad_slot, device)
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
            fill: tuple[torch.Tensor, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`fill`: (device token rows, ids) of the step's placeholder tokens."""
        b, w, m = key
        self.static.load(step, b, w, fill)
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
