"""Overlapped scheduling (EngineConfig.async_scheduling) against the synchronous engine, on a toy
executor (no model; thousands of steps in seconds) and on the tiny model: the same outputs, token
for token, under arrivals, stop tokens, max_tokens, aborts while a step is in flight, preemption
by a tight cache, seeded sampling and speculative decoding; and the host really runs ahead (step
N+1 is submitted before step N's result is read)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from glm53.actors.caches import CachePlan
from glm53.actors.config import ModelConfig
from glm53.actors.overlap import resolve_after
from glm53.actors.step import SamplingParams, StepInput, StepOutput
from glm53.actors.tiny import tiny_text_config
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.request import FinishReason

VOCAB = 40


class _Result:
    """What submit returns: the step already ran (as a device would, in order); reading the
    result is logged."""

    def __init__(self, log: list, out: StepOutput) -> None:
        self._log, self._out = log, out

    def result(self) -> StepOutput:
        self._log.append(("result", self._out.step_id))
        return self._out


class ToyExecutor:
    """A deterministic stand-in for the workers that reads its context only through what the
    step says: each token is written to the cache row its slot mapping names, and the next
    token is a hash of the context read back through the block table (plus the request's seed
    and output index when sampling). Placeholders are filled from the last step's samples, as
    the model runner does on the device. Speculative steps: drafts are verified against the
    toy's own choice, and new drafts are its choice, wrong at every other position of a
    `corrupt` request."""

    def __init__(self, num_blocks: int, block_size: int = 4, num_slots: int = 6) -> None:
        self.model_config = ModelConfig.from_hf(tiny_text_config(vocab_size=VOCAB))
        self.cache_plan = CachePlan(num_blocks=num_blocks, block_size=block_size,
                                    num_slots=num_slots, bytes_per_block=1, bytes_per_slot=1)
        self.cache = np.full(num_blocks * block_size, -1, np.int64)
        self.last_sampled: np.ndarray | None = None
        self.last_step: tuple[StepInput, StepOutput] | None = None
        self.log: list = []
        self.placeholder_steps = 0  # steps that continued the one before (overlapped)

    def submit(self, step: StepInput) -> _Result:
        self.log.append(("submit", step.step_id))
        return _Result(self.log, self.execute(step))

    def _next(self, step: StepInput, seq: int, row: int, sample_row: int) -> int:
        table, bs = step.block_tables[seq], self.cache_plan.block_size
        pos = np.arange(int(step.positions[row]) + 1)
        context = tuple(self.cache[table[pos // bs] * bs + pos % bs].tolist())
        assert min(context) >= 0, "read a cache row nothing wrote"
        s = step.sampling
        if s.temperature[sample_row] > 0:  # a pure function of (seed, output index)
            context += (int(s.seeds[sample_row]), int(s.positions[sample_row]))
        if s.repetition_penalty[sample_row] != 1:  # penalties read the outputs so far
            r = sample_row
            context += tuple(s.output_ids[s.output_offsets[r]:s.output_offsets[r + 1]])
        token = hash(context) % VOCAB
        banned = s.banned_ids[s.banned_offsets[sample_row]:s.banned_offsets[sample_row + 1]]
        while token in banned:  # stop tokens before min_tokens
            token = (token + 1) % VOCAB
        return token

    def execute(self, step: StepInput) -> StepOutput:
        if step.previous_seqs is not None:  # as the model runner does
            step = resolve_after(step, *self.last_step, self.cache_plan.block_size)
            self.placeholder_steps += 1
        out = self._run(step)
        self.last_step = (step, out)
        return out

    def _run(self, step: StepInput) -> StepOutput:
        tokens = step.token_ids.copy()
        if step.placeholder_rows is not None:
            tokens[step.placeholder_rows] = self.last_sampled[step.placeholder_sources]
            self.placeholder_steps += 1
        assert (tokens >= 0).all(), "a placeholder was not filled"
        self.cache[step.slot_mapping] = tokens
        sampled = np.array([self._next(step, int(q), int(r), i) for i, (q, r) in enumerate(
            zip(step.sample_seqs, step.sample_rows, strict=True))], np.int64)
        self.last_sampled = sampled if step.num_drafts is None else None
        if step.num_drafts is None:
            return StepOutput(step.step_id, sampled)
        return self._verify(step, sampled)

    def _verify(self, step: StepInput, sampled: np.ndarray) -> StepOutput:
        n, k = step.draft_ids.shape
        accepted = np.zeros(n, np.int64)
        drafts = np.full((n, k), -1, np.int64)
        row = 0
        for seq in dict.fromkeys(step.sample_seqs.tolist()):
            d = int(step.num_drafts[seq])
            while accepted[seq] < d and step.draft_ids[seq, accepted[seq]] == sampled[
                    row + accepted[seq]]:
                accepted[seq] += 1
            token = int(sampled[row + accepted[seq]])  # the target's token: drafts follow it
            for j in range(int(step.propose[seq])):
                token = hash((token, j)) % VOCAB
                wrong = "corrupt" in step.request_ids[seq] and j % 2
                drafts[seq, j] = (token + 1) % VOCAB if wrong else token
            row += 1 + d
        return StepOutput(step.step_id, sampled, num_accepted=accepted, draft_ids=drafts)

    def shutdown(self) -> None:
        pass


def _workload(seed: int, n: int = 14, max_tokens: int = 12, max_len: int = 32
              ) -> list[tuple[int, str, list[int], SamplingParams, int]]:
    """(arrival step, id, prompt, params, abort after this many tokens or 0); prompt +
    max_tokens reach max_len at most."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampled = rng.random() < 0.4
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 13))]
        limit = rng.randint(1, min(max_tokens, max_len - len(prompt)))
        params = SamplingParams(
            max_tokens=limit, temperature=0.7 if sampled else 0.0,
            seed=rng.randrange(1000) if sampled else None, ignore_eos=True,
            stop_token_ids=tuple(rng.sample(range(VOCAB), 2)) if rng.random() < 0.5 else (),
            min_tokens=rng.randint(0, limit // 2) if rng.random() < 0.3 else 0,
            repetition_penalty=1.2 if rng.random() < 0.1 else 1.0)
        abort = rng.randint(1, max_tokens // 3) if rng.random() < 0.25 else 0
        rid = f"r{i}" + ("-corrupt" if rng.random() < 0.5 else "")
        out.append((rng.randint(0, 10), rid, prompt, params, abort))
    return out


def _drive(engine: LLMEngine, workload) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Run the workload: arrivals by step count, aborts once a request has emitted its count;
    every request's tokens and finish reason, or for one that reached its abort count, its
    first that many tokens (a speculative step emits several: how many past the count arrive
    before the abort depends on how steps are grouped). Nothing may arrive after the end."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason | None] = {}
    pending = sorted(workload, key=lambda w: w[0])
    aborts = {rid: n for _, rid, _, _, n in workload if n}
    count = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= count:
            _, rid, prompt, params, _ = pending.pop(0)
            engine.add_request(prompt, params, rid)
            tokens[rid], reasons[rid] = [], None
        for out in engine.step():
            assert reasons[out.request_id] is None, f"{out.request_id} output after its end"
            tokens[out.request_id] += out.new_token_ids
            reasons[out.request_id] = reasons[out.request_id] or out.finish_reason
        for r in engine.scheduler.running:  # what the host does not know yet is a placeholder
            assert not r.num_placeholders or set(r.draft_ids) <= {-1}, r.request_id
        for rid, n in aborts.items():
            if reasons.get(rid) is None and len(tokens.get(rid, ())) >= n:
                assert engine.abort(rid) is not None
                reasons[rid] = FinishReason.ABORT
        count += 1
    return {rid: (tokens[rid][:aborts[rid]], "abort point")
            if len(tokens[rid]) >= aborts.get(rid, len(tokens[rid]) + 1)
            else (tokens[rid], reasons[rid]) for rid in tokens}


def _toy_engine(overlap: bool, num_blocks: int, num_spec: int = 0,
                max_model_len: int = 32) -> LLMEngine:
    spec = dict(speculative_method="mtp", num_speculative_tokens=num_spec) if num_spec else {}
    config = EngineConfig(model="toy", block_size=4, max_num_seqs=5, max_num_batched_tokens=20,
                          max_model_len=max_model_len, async_scheduling=overlap, **spec)
    return LLMEngine(config, ToyExecutor(num_blocks))


@pytest.mark.parametrize("num_spec", [0, 2])
def test_overlapped_engine_equals_the_synchronous_one_on_random_workloads(num_spec):
    """Speculative requests overlap only far from their end: they get longer outputs."""
    preemptions = placeholder_steps = 0
    stops = set()
    for seed in range(40):
        if num_spec:  # some reach max_model_len
            workload, num_blocks, max_len = _workload(seed, 14, 40, 44), 17 + seed % 8, 44
        else:  # tight caches: preemption is common
            workload, num_blocks, max_len = _workload(seed), 9 + seed % 8, 32
        sync = _drive(_toy_engine(False, num_blocks, num_spec, max_len), workload)
        engine = _toy_engine(True, num_blocks, num_spec, max_len)
        assert _drive(engine, workload) == sync, seed
        s = engine.scheduler
        assert s.blocks.num_free == s.blocks.num_usable and s.slots.num_free == s.slots.num_slots
        assert all(r.num_placeholders == 0 for r in s.requests.values())
        preemptions += engine.num_preemptions
        placeholder_steps += engine.executor.placeholder_steps
        stops |= {reason for _, reason in sync.values()}
    assert preemptions > 0 and stops >= {FinishReason.STOP, FinishReason.LENGTH, "abort point"}
    assert placeholder_steps > 0  # the steps really overlapped


def test_step_n_plus_1_is_submitted_before_step_n_is_read():
    """The host runs a step ahead: whenever a step follows another, it was submitted before
    the other's result was read (so the workers never wait for the engine's host work)."""
    engine = _toy_engine(True, num_blocks=64)
    for i in range(4):
        engine.add_request(list(range(1, 3 + i)), SamplingParams(max_tokens=6, temperature=0.0,
                                                                  ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    log = engine.executor.log
    submitted = [step_id for kind, step_id in log if kind == "submit"]
    assert len(submitted) > 6
    for step_id in submitted[1:]:
        assert log.index(("submit", step_id)) < log.index(("result", step_id - 1)), log
    assert log.count(("result", submitted[-1])) == 1  # the last one is read too (drained)


class _CountingExecutor:
    """The in-process executor with the runner's decode graphs emulated (capture=False), so
    uniform steps take the static-buffer path on CPU; counts steps with placeholders on each
    path, and speculative steps that continue the one before."""

    def __init__(self, config: EngineConfig) -> None:
        from glm53.raycluster.executor import InProcessExecutor

        self.inner = InProcessExecutor(config)
        self.runner = self.inner.runner
        self.runner.graphs = self.runner.make_graphs(capture=False)
        self.model_config, self.cache_plan = self.inner.model_config, self.inner.cache_plan
        self.filled = {"graph": 0, "eager": 0}
        self.continued = 0

    def _count(self, step: StepInput) -> None:
        if step.placeholder_rows is not None:
            self.filled["graph" if self.runner.graphs.bucket(step) else "eager"] += 1
        self.continued += step.previous_seqs is not None

    def execute(self, step: StepInput) -> StepOutput:
        return self.inner.execute(step)

    def submit(self, step: StepInput):
        self._count(step)
        return self.inner.submit(step)

    def shutdown(self) -> None:
        self.inner.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


def _tiny_workload(stops: dict[str, int] | None = None, lengths: tuple[int, int] = (3, 9)):
    rng = random.Random(1)
    out = []
    for i in range(7):
        sampled = i % 3 == 2
        params = SamplingParams(max_tokens=rng.randint(*lengths),
                                temperature=0.8 if sampled else 0,
                                seed=i if sampled else None, ignore_eos=True,
                                stop_token_ids=(stops[f"t{i}"],) if stops and f"t{i}" in stops
                                else ())
        prompt = [rng.randrange(272) for _ in range(rng.randint(1, 20))]
        out.append((i // 2, f"t{i}", prompt, params, 2 if i == 3 else 0))
    return out


@pytest.mark.parametrize("drafts", [None, "greedy", "probabilistic"])
def test_overlapped_engine_equals_the_synchronous_one_on_the_tiny_model(tiny, drafts):
    """Greedy and seeded requests, stop tokens, an abort while a step is in flight and a cache
    tight enough to preempt, without speculation and with MTP (greedy or sampled drafts): the
    same tokens and finish reasons. Without speculation the placeholders were filled on the
    device on both the eager and the graph path; with it, steps verified drafts the engine had
    not seen yet (speculating requests overlap only far from their end: longer outputs).

    Sampled drafts give the same distribution whenever they are verified, but not the same
    tokens: a request preempted (its drafts dropped) or left without token budget for its
    drafts at another step than in the synchronous run samples differently. That run gets a
    cache and budget where neither happens."""
    spec = dict(speculative_method="mtp", num_speculative_tokens=2,
                draft_sampling=drafts) if drafts else {}
    sampled_drafts = drafts == "probabilistic"

    def engine(overlap: bool) -> LLMEngine:
        config = EngineConfig(model=tiny, num_blocks=64 if sampled_drafts else 6 if drafts
                              else 5, max_num_seqs=4,
                              max_num_batched_tokens=64 if sampled_drafts else 16,
                              async_scheduling=overlap, **spec)
        return LLMEngine(config, _CountingExecutor(config))

    lengths = (12, 20) if drafts else (3, 9)
    probe = _drive(engine(False), _tiny_workload(lengths=lengths))  # 3rd tokens: stops
    stops = {rid: tokens[2] for rid, (tokens, _) in probe.items() if rid in ("t0", "t4")}
    sync = _drive(engine(False), _tiny_workload(stops, lengths))
    overlapped = engine(True)
    assert _drive(overlapped, _tiny_workload(stops, lengths)) == sync
    assert {reason for _, reason in sync.values()} >= {FinishReason.STOP, "abort point",
                                                      FinishReason.LENGTH}
    assert (overlapped.num_preemptions > 0) != sampled_drafts
    executor = overlapped.executor
    if drafts:
        assert executor.continued > 0
    else:
        assert executor.filled["graph"] > 0 and executor.filled["eager"] > 0, executor.filled
    overlapped.shutdown()


class _TableCheckingExecutor(ToyExecutor):
    """The toy, plus the workers' persistent block tables: each step's delta is applied, and
    the rows of its state slots must then hold exactly its block tables (zero-padded)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        from glm53.actors.cuda_graphs import StaticInputs

        self.static = StaticInputs(max_seqs=6, max_width=3, max_blocks=8, block_size=4,
                                   pad_slot=self.cache_plan.num_slots, device=torch.device("cpu"))
        self.resets = self.blocks_sent = 0

    def execute(self, step: StepInput) -> StepOutput:
        self.static.update_tables(step)
        self.resets += len(step.block_table_resets)
        self.blocks_sent += len(step.block_table_updates)
        want = np.zeros((len(step.state_ids), self.static.max_blocks), np.int64)
        want[:, :step.block_tables.shape[1]] = step.block_tables
        assert np.array_equal(self.static.tables[torch.from_numpy(step.state_ids)].numpy(),
                              want), step.step_id
        assert not self.static.tables[self.static.pad_slot].any()
        return super().execute(step)


@pytest.mark.parametrize("overlap", [False, True])
def test_block_table_deltas_keep_the_workers_rows_exact(overlap):
    """Slots change hands (finish, abort, preemption, re-admission) and requests gain blocks:
    the deltas the engine sends keep every row the workers read equal to the full table, and
    each block handed to a request crosses once."""
    for seed in range(20):
        config = EngineConfig(model="toy", block_size=4, max_num_seqs=5,
                              max_num_batched_tokens=20, max_model_len=32,
                              async_scheduling=overlap)
        engine = LLMEngine(config, _TableCheckingExecutor(9 + seed % 8))
        pool, allocate, allocated = engine.scheduler.blocks, engine.scheduler.blocks.allocate, []

        def counted(n: int, allocate=allocate, allocated=allocated) -> list[int]:
            ids = allocate(n)
            allocated.extend(ids)
            return ids

        pool.allocate = counted
        _drive(engine, _workload(seed))
        assert engine.executor.resets > 0 and engine.executor.blocks_sent == len(allocated)


def test_asyncio_front_streams_the_same_tokens_and_drains():
    """Through AsyncEngine (requests and aborts queued between steps, a consumer leaving
    early): the streams equal the synchronous engine's, and the engine ends with no step in
    flight and every resource free."""
    import asyncio

    from glm53.raycluster.engine import AsyncEngine

    prompts = [[1 + i, 2, 3 + i] for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = _toy_engine(False, 64).generate(prompts, params)
    engine = AsyncEngine(_toy_engine(True, 64))

    async def collect(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.new_token_ids]

    async def leave_early():
        stream = engine.generate([5, 5], SamplingParams(max_tokens=30, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()

    async def main():
        streams = await asyncio.gather(*map(collect, prompts), leave_early())
        for _ in range(100):  # the loop runs on until the abort and the last step are done
            if not engine.engine.has_unfinished:
                break
            await asyncio.sleep(0.01)
        return streams

    assert asyncio.run(main())[:5] == want
    core = engine.engine
    assert not core.has_unfinished and core.scheduler.blocks.num_free == (
        core.scheduler.blocks.num_usable)
