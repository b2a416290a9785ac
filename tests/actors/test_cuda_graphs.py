"""The CUDA-graph decode path, emulated eagerly on CPU (capture=False): uniform steps padded to
a bucket over the static buffers must give the real sequences exactly what the unpadded eager
step gives, and every padding write must land in the pad slot or the null block 0."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.actors.caches import DSAState, KDAState
from glm53.actors.cuda_graphs import DecodeGraphs, GraphKey
from glm53.actors.graph_outputs import GraphOutputs
from glm53.actors.memory_plan import activation_bytes_per_token, graph_workspace
from glm53.actors.model_runner import ModelRunner
from glm53.actors.speculative.verify import SyntheticAcceptance
from glm53.actors.step import SamplingParams, StepInput
from glm53.kernels import ops
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.executor import InProcessExecutor, StepPipeline
from tests.tiny import TINY

# requests of different lengths finish at different steps: the batch shrinks into padding
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)
          for n in (7, 3, 9, 5, 3)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n).tolist() for n in (3, 9, 13, 5, 7)]


def _config(path: str, k: int, **kw) -> EngineConfig:
    spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
    return EngineConfig(model=path, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24,
                        **spec, **kw)


def _run(engine: LLMEngine) -> list[list[int]]:
    """Requests arrive two per step while others decode or finish (batch sizes change)."""
    results: dict[str, list[int]] = {}
    ids, pending = [], list(zip(_prompts(), PARAMS, strict=True))
    while pending or engine.has_unfinished:
        for _ in range(min(2, len(pending))):
            ids.append(engine.add_request(*pending.pop(0)))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [results[i] for i in ids]


def _states(caches) -> list[KDAState | DSAState]:
    return list(caches.layers) + ([caches.mtp] if caches.mtp is not None else [])


def _tensors(state: KDAState | DSAState) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(state).items() if isinstance(v, torch.Tensor)}


def _snapshot(caches) -> list[torch.Tensor]:
    return [t.clone() for s in _states(caches) for t in _tensors(s).values()]


def _restore(caches, saved: list[torch.Tensor]) -> None:
    live = [t for state in _states(caches) for t in _tensors(state).values()]
    for t, old in zip(live, saved, strict=True):
        t.copy_(old)


class TwinExecutor(InProcessExecutor):
    """Runs every step eagerly; a step the graphs take also runs padded from the same cache
    state, the two results are compared (outputs, and every cache byte of real state), and
    the padded run's output and caches carry on."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.graphs = self.runner.make_graphs(capture=False)
        self.padded_steps = 0
        self.table_widths_used: set[int] = set()

    def execute(self, step: StepInput):
        runner = self.runner
        key = self.graphs.bucket(step)
        if key is None:  # the runner runs without graphs here: keep their block tables current
            self.graphs.static.update_tables(step)
            return runner.execute(step)
        self.table_widths_used.add(key.blocks)
        before = _snapshot(runner.caches)
        eager = runner.execute(step)
        after_eager = _snapshot(runner.caches)
        _restore(runner.caches, before)
        poisoned = self._poison_padding()
        runner.graphs = self.graphs
        try:
            padded = runner.execute(step)
        finally:
            runner.graphs = None
        after_padded = _snapshot(runner.caches)
        for name in ("sampled", "num_accepted", "draft_ids"):
            a, b = getattr(eager, name), getattr(padded, name)
            assert (a is None and b is None) or np.array_equal(a, b), name
        np.testing.assert_allclose(padded.logprobs.top_logprobs, eager.logprobs.top_logprobs,
                                   rtol=0, atol=1e-5)
        self._check_caches(step, key, before, after_eager, after_padded, poisoned)
        return padded

    def _poison_padding(self) -> dict[tuple[int, str], torch.Tensor]:
        """Fills every cache row the padded rows may write (KDA states and open pool rows in
        the pad slot, latent rows in block 0) with a finite marker; returns them by (state,
        field). A pad row is deterministic, so without the marker it may rewrite the very
        bytes of the last padded step; and the eager twin, run without the marker, shows no
        real row reads them."""
        pad_slot = self.runner.plan.num_slots
        marked = {}
        for state in _states(self.runner.caches):
            for field, t in _tensors(state).items():
                per_slot = isinstance(state, KDAState) or field == "open_rows"
                if per_slot or field == "latent":
                    row = t[pad_slot if per_slot else 0]
                    row.fill_(0.375 if t.is_floating_point() else 0x30)  # 0x30: fp8 e4m3 0.5
                    marked[id(state), field] = row.clone()
        return marked

    def _check_caches(self, step, key, before, after_eager, after_padded, poisoned) -> None:
        b = key.batch
        pad_slot = self.runner.plan.num_slots
        block_size = self.runner.plan.block_size
        idle_slots = torch.tensor(np.setdiff1d(np.arange(pad_slot), step.state_ids))
        idle_blocks = torch.tensor(np.setdiff1d(np.arange(1, self.runner.plan.num_blocks),
                                                step.slot_mapping // block_size))
        padded_somewhere = False
        i = 0
        for state in _states(self.runner.caches):
            for field in _tensors(state):
                old, want, got = before[i], after_eager[i], after_padded[i]
                i += 1
                per_slot = isinstance(state, KDAState) or field == "open_rows"
                real = slice(0, pad_slot) if per_slot else slice(1, None)  # not pad / block 0
                # fp32 GEMMs over b rows round unlike over n rows (~1e-6), so real rows the
                # step wrote match closely; what the trunk did not write stays bit-identical
                if state is self.runner.caches.mtp and step.num_drafts is not None:
                    # the graphed drafter's pass 0 also runs the rejected rows, whose MTP
                    # cache rows are scratch until rewritten: drafts are compared instead
                    # (and test_graphed_drafts_equal_eager_drafts runs a whole engine on them)
                    continue
                torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
                if state is not self.runner.caches.mtp:  # the eager MTP drafts write ahead
                    idle = idle_slots if per_slot else idle_blocks
                    assert torch.equal(got[idle], old[idle])
                junk = got[pad_slot] if per_slot else got[0]  # where padding may write
                if (where := (id(state), field)) in poisoned:
                    padded_somewhere |= not torch.equal(junk, poisoned[where])
                assert torch.equal(want[pad_slot if per_slot else 0],
                                   old[pad_slot if per_slot else 0])  # eager never writes there
        if b > len(step.state_ids):
            assert padded_somewhere  # the padded rows ran, into the pad slot and block 0
            self.padded_steps += 1


@pytest.mark.parametrize("k", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_padded_graph_path_equals_eager(tiny, k):
    """Each graph step equals its eager twin, and the engine driven by the padded path
    (requests arriving and finishing, so buckets change; sequences outgrowing the one-block
    tables of the graphs for contexts up to one block) equals the plain engine."""
    plain = _run(LLMEngine(_config(tiny, k)))
    # buckets 2 and 4: single sequences and triples run padded
    block = EngineConfig(model=tiny).block_size
    # with drafts, graphs of at most 8 rows: verify steps of 2 sequences graphed, of 3-4 eager
    config = _config(tiny, k, cuda_graph_batch_sizes=(2,), cuda_graph_context_sizes=(block,),
                     cuda_graph_max_tokens=8 if k else 512)
    engine = LLMEngine(config, TwinExecutor(config))
    assert _run(engine) == plain
    assert engine.dead is None
    assert engine.executor.padded_steps > 0
    widths = engine.executor.graphs.table_widths
    assert widths[0] == 1 and len(widths) == 2
    used = engine.executor.table_widths_used
    # plain decoding runs both; with MTP's lookahead blocks every uniform step needs two
    assert used == set(widths) if not k else used <= set(widths)
    if k:
        assert engine.spec_stats.num_drafts > 0


class DraftRecorder(InProcessExecutor):
    """Records every step's drafts; `graphs` runs the padded path (emulated) throughout."""

    def __init__(self, config: EngineConfig, graphs: bool) -> None:
        super().__init__(config)
        self.drafts: list[list[int]] = []
        self.accepted_graph_runs = 0  # steps whose drafts came from the graph after acceptance
        if graphs:
            graphs = self.runner.graphs = self.runner.make_graphs(capture=False)
            run_accepted = graphs.run_accepted

            def counting(*args):
                drafts = run_accepted(*args)
                self.accepted_graph_runs += drafts is not None
                return drafts

            graphs.run_accepted = counting

    def execute(self, step: StepInput):
        out = self.runner.execute(step)
        if out.draft_ids is not None:
            self.drafts.append(out.draft_ids.tolist())
        return out


@pytest.mark.slow
@pytest.mark.parametrize("acceptance", [None, (1.0, 0.6, 0.3)])
def test_graphed_drafts_equal_eager_drafts(tiny, acceptance):
    """A whole engine run whose MTP drafts come from the graph after acceptance (pass 0 over
    every verified row, rejected ones too) drafts exactly what the eager proposer drafts at
    every step, so the scratch rows it leaves in the MTP caches are never read. The tiny
    model's own drafts are all rejected (its tokens then equal plain decoding); synthetic
    acceptance keeps 1-4 rows a step, at every kept length."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 7).tolist() for _ in range(3)]  # in lockstep: uniform
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        config = _config(tiny, 3, cuda_graph_batch_sizes=(2,))
        recorder = DraftRecorder(config, graphs)
        if acceptance is not None:
            recorder.runner.verify_drafts = SyntheticAcceptance(acceptance)
        runs[graphs] = LLMEngine(config, recorder).generate(prompts, params), recorder
    assert runs[True][0] == runs[False][0]
    if acceptance is None:
        assert runs[True][0] == LLMEngine(_config(tiny, 0)).generate(prompts, params)
    assert runs[True][1].drafts == runs[False][1].drafts
    assert runs[True][1].accepted_graph_runs >= 5
    assert any(d >= 0 for step in runs[True][1].drafts for row in step for d in row)


class LaunchRecorder(InProcessExecutor):
    """Overlapped execution recording each finished step: its input, whether it was still in
    flight after its launch returned, and its drafts; `graphs` runs the padded path
    (emulated) throughout."""

    def __init__(self, config: EngineConfig, graphs: bool) -> None:
        super().__init__(config)
        if graphs:
            self.runner.graphs = self.runner.make_graphs(capture=False)
        self.steps: list[tuple[StepInput, bool]] = []
        self.drafts: list[list[int]] = []
        self._thread = StepPipeline(self._finish, self.runner.launch)

    def _finish(self, launched):
        self.steps.append((launched.step, launched.output is None))
        out = self.runner.finish(launched)
        if out.draft_ids is not None:
            self.drafts.append(out.draft_ids.tolist())
        return out


@pytest.mark.slow
def test_steps_without_drafts_are_not_waited_for(tiny):
    """Adaptive draft length at width 0, overlapped: a graphed step in which no sequence
    verifies or proposes a draft writes its rows' MTP cache rows from its samples on the
    device (a cache-only pass) instead of being finished at launch, and the step after it
    fills its tokens on the device instead of settling them from acceptance. Drafts after a
    stretch without any equal the eager proposer's (the cache rows were written), with
    synthetic acceptance keeping some (output equal to plain decoding through the graphs:
    tests/actors/test_gpu_cuda_graphs.py, the engine: tests/raycluster/test_adaptive_drafts.py)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, 7).tolist() for _ in range(3)]  # in lockstep: uniform
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        config = _config(tiny, 3, cuda_graph_batch_sizes=(2,), adaptive_drafts=True,
                         async_scheduling=True)
        recorder = LaunchRecorder(config, graphs)
        recorder.runner.verify_drafts = SyntheticAcceptance((1.0, 0.6, 0.3))
        engine = LLMEngine(config, recorder)
        turns = itertools.cycle([0, 0, 0, 0, 3, 3, 3])
        engine.draft_policy.choose = lambda request_ids, turns=turns: next(turns)
        runs[graphs] = engine.generate(prompts, params), recorder
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].drafts == runs[False][1].drafts
    steps = runs[True][1].steps
    in_flight = [s for s, pending in steps if pending and s.num_drafts is not None]
    assert len(in_flight) >= 5 and not any(s.num_drafts.any() or s.propose.any()
                                           for s in in_flight)
    # the steps after them took their tokens from the device, not from acceptance
    filled = [s for s, _ in steps if s.num_drafts is not None and s.placeholder_rows is not None]
    assert len(filled) >= 5 and all(s.previous_seqs is None for s in filled)
    assert not any(pending for s, pending in runs[False][1].steps if s.num_drafts is not None)
    assert any(d >= 0 for step in runs[True][1].drafts for row in step for d in row)


@pytest.mark.slow
def test_padded_graph_path_with_a_quantised_cache(tiny):
    """The graph path stores and reads fp8 latent rows exactly as the eager path does (padded
    rows land in block 0), with MTP drafts."""
    plain = _run(LLMEngine(_config(tiny, 3, kv_cache_dtype="fp8")))
    config = _config(tiny, 3, cuda_graph_batch_sizes=(2,), kv_cache_dtype="fp8")
    engine = LLMEngine(config, TwinExecutor(config))
    assert engine.executor.runner.caches.layers[3].latent.dtype == torch.uint8
    assert _run(engine) == plain


@pytest.mark.slow
def test_adaptive_draft_lengths_run_through_the_graph_path(tiny):
    """Adaptive draft length captures every verify width; uniform steps of each width run
    padded and equal their eager twins, and the output equals plain decoding."""
    prompts = _prompts()[:3]  # three requests in lockstep: bucket 4 pads one sequence
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = LLMEngine(_config(tiny, 0)).generate(prompts, params)
    config = _config(tiny, 3, cuda_graph_batch_sizes=(2,), adaptive_drafts=True)
    engine = LLMEngine(config, TwinExecutor(config))
    graphs = engine.executor.graphs
    assert graphs.widths == (1, 2, 3, 4)
    turns = itertools.cycle([3, 3, 2, 2, 1, 1, 0])  # each width verified after its proposal
    engine.draft_policy.choose = lambda request_ids: next(turns)
    used, bucket = set(), graphs.bucket

    def recording(step):
        key = bucket(step)
        used.add(None if key is None else key[1])
        return key

    graphs.bucket = recording
    assert engine.generate(prompts, params) == plain
    assert {1, 2, 3, 4} <= used
    assert engine.executor.padded_steps > 0


class OutputRecorder(InProcessExecutor):
    """Runs the padded path (emulated) throughout, recording each graph run's bucket, its
    outputs and the KDA layers' pending replay tensors after it."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        graphs = self.runner.graphs = self.runner.make_graphs(capture=False)
        self.runs = []
        run = graphs.run

        def recording(step, key):
            hidden, taps, logits = run(step, key)
            pending = [t for attn in graphs.kda.values() for t in attn.pending or ()]
            self.runs.append((key, hidden, logits, pending))
            return hidden, taps, logits

        graphs.run = recording


def test_graphs_share_one_set_of_outputs(tiny):
    """Every bucket and width writes the same outputs, sized by the largest graph: runs of
    different buckets and widths return views from the first row of the same storage, a
    verify step's KDA replay (what `run_accepted` commits from) lies in them too, the engine's
    tokens stay those of plain decoding, and the outputs take exactly the bytes the memory
    plan counts for them."""
    config = _config(tiny, 3, cuda_graph_batch_sizes=(2,), adaptive_drafts=True)
    engine = LLMEngine(config, OutputRecorder(config))
    turns = itertools.cycle([3, 3, 0])  # widths 4 and 1
    engine.draft_policy.choose = lambda request_ids: next(turns)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompts in (_prompts()[:3], _prompts()[:1]):  # in lockstep: buckets 4, then 2
        plain = LLMEngine(_config(tiny, 0)).generate(prompts, params)
        assert engine.generate(prompts, params) == plain
    graphs, runs = engine.executor.runner.graphs, engine.executor.runs
    out = graphs.outputs
    assert {key[:2] for key, *_ in runs} >= {(2, 1), (4, 1), (2, 4), (4, 4)}
    replay = {t.untyped_storage().data_ptr() for r in out.replay.values() for t in vars(r).values()}
    assert len(replay) == 6 * len(graphs.kda)
    for (b, w, _), hidden, logits, pending in runs:
        assert hidden.data_ptr() == out.hidden.data_ptr() and hidden.shape[0] == b * w
        assert logits.data_ptr() == out.logits.data_ptr() and logits.shape[0] == b * w
        if w > 1:
            assert len(pending) == 6 * len(graphs.kda)
            assert {t.untyped_storage().data_ptr() for t in pending} == replay
    cfg, dtype = graphs.model.config, out.hidden.dtype
    rows = 4 * 4  # 4 slots x width 4
    assert out.hidden.shape[0] == out.logits.shape[0] == rows and out.taps is None
    per_row = GraphOutputs.bytes_per_row(cfg, n_taps=0, verify=True, dtype=dtype)
    assert out.nbytes == rows * per_row
    context = 512
    assert graph_workspace(cfg, num_slots=4, num_spec=3, max_model_len=context,
                           dtype=dtype) == out.nbytes + rows * activation_bytes_per_token(
                               cfg, context)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, but views and allocations (no launch)."""

    NO_LAUNCH = ("slice", "select", "t", "view", "split", "split_with_sizes", "unsqueeze",
                 "expand", "reshape", "_unsafe_view", "as_strided", "alias", "detach", "empty",
                 "empty_like")

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.NO_LAUNCH:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny4(tiny_checkpoints):
    """TINY without its last KDA layer (dense, KDA, KDA, DSA; MTP): each forward under the
    interpreted Triton kernels costs a quarter less, and two KDA layers still tell the per-layer
    counts apart."""
    return str(tiny_checkpoints(**{**TINY, "layers": 4}))


@pytest.mark.slow
def test_shared_outputs_add_one_copy_per_graph(tiny4):
    """A verify graph's forward into the shared outputs (Triton kernels, interpreted) launches
    what the forward that allocates its own outputs launches, plus one copy (the hidden
    states): the in_proj GEMM of each KDA layer writes its replay rows (mm.out for linear),
    the fused mixer stores q, k, v, g, beta there (no copy, no new tensor), and the logits'
    copy into the outputs is their fp32 conversion (`.float()`: a launch in bf16, none in this
    fp32 model, hence two copies here); and the prologue (`StaticInputs.prologue`: placeholder
    tokens from the last step's samples, the block-table delta). Both give the same bits."""
    runner = ModelRunner(tiny4, num_slots=2, num_blocks=32, with_mtp=True, num_spec=3)
    runner.allocate_caches(32)
    graphs = runner.make_graphs(capture=False)
    assert graphs.widths == (1, 4)
    b, w, m, n_kda = 2, 4, graphs.table_widths[-1], len(graphs.kda)
    graphs.static.load(None, b, w)
    ids, batch = graphs.static.views(b, w, m)
    graphs.static.views = lambda b, w, m: (ids, batch)  # built once, outside the counts
    ops.use("triton")
    try:
        with OpCounter() as own:
            hidden = graphs.model(ids, batch, graphs.caches)
            logits = graphs.model.compute_logits(hidden)
        replay = {i: attn.pending for i, attn in graphs.kda.items()}
        with OpCounter() as shared:
            g = graphs._forward(b, w, m)
    finally:
        ops.use("auto")
    # the graph's prologue: the placeholders' gather from the samples and select, the block
    # tables' delta
    assert shared.ops - own.ops == Counter({"aten.mm.out": n_kda, "aten.copy_.default": 2,
                                            "aten.index.Tensor": 1, "aten.where.self_out": 1,
                                            "aten.index_put_.default": 1})
    assert own.ops - shared.ops == Counter({"aten.linear.default": n_kda, "aten.to.dtype": 1})
    assert torch.equal(g.hidden, hidden) and torch.equal(g.logits, logits)
    for i in graphs.kda:
        assert all(torch.equal(x, y) for x, y in zip(g.pending[i], replay[i], strict=True))


def test_graph_rows_are_capped(tiny):
    """Graphs of at most `cuda_graph_max_tokens` rows: each width keeps the batch sizes that
    fit, a wider step runs eagerly, and the shared outputs hold the largest graph's rows."""
    runner = ModelRunner(tiny, num_slots=4, num_blocks=32, with_mtp=True, num_spec=3,
                         cuda_graph_max_tokens=8)
    runner.allocate_caches(32)
    graphs = runner.make_graphs(capture=False)
    assert graphs.sizes == {1: (1, 2, 4), 4: (1, 2)}
    assert graphs.outputs.hidden.shape[0] == graphs.outputs.logits.shape[0] == 8

    def verify_step(n: int) -> StepInput:
        cu = np.arange(n + 1) * 4
        return StepInput(0, [""] * n, np.zeros(4 * n), np.zeros(4 * n), cu,
                         np.zeros((n, 1), np.int32), np.zeros(4 * n), np.arange(n),
                         np.arange(n), np.arange(n), None, num_drafts=np.full(n, 3))

    assert graphs.bucket(verify_step(2))[:2] == (2, 4)
    assert graphs.bucket(verify_step(3)) is None  # 12 rows: eager


def test_one_commit_graph_serves_every_table_width(tiny):
    """Without a drafter the graph after acceptance only commits KDA states (no block table
    read), so every table width shares the widest one's; greedy MTP drafts over the tables, so
    each width keeps its own."""
    def graphs(sampling: str) -> DecodeGraphs:
        runner = ModelRunner(tiny, num_slots=4, num_blocks=32, with_mtp=True, num_spec=3,
                             draft_sampling=sampling, cuda_graph_context_sizes=(16,))
        runner.allocate_caches(32)
        return runner.make_graphs(capture=False)

    commit_only, drafting = graphs("probabilistic"), graphs("greedy")
    narrow, widest = commit_only.table_widths
    assert commit_only.drafter is None and drafting.drafter is not None
    assert commit_only._accepted_key(GraphKey(2, 4, narrow)) == GraphKey(2, 4, widest)
    assert drafting._accepted_key(GraphKey(2, 4, narrow)) == GraphKey(2, 4, narrow)


def test_capture_failure_falls_back_to_eager(tiny, monkeypatch, caplog):
    runner = ModelRunner(tiny, num_slots=2, num_blocks=16)
    runner.enforce_eager = False  # as on CUDA

    def fail(capture: bool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "make_graphs", fail)
    runner.allocate_caches(16)
    assert runner.graphs is None
    assert "capture failed" in caplog.text
