"""One MTP speculative decode cycle (issue 20: "the MTP3 cycle, verify width 4 + 3 draft
steps"), timed as `ModelRunner.launch` runs a step that verifies MTP drafts, with the runner's
own parts: the verify step of 1 + num_spec tokens per sequence through `DecodeGraphs` (widths
1 and 1 + num_spec, as a runner speculating with MTP captures them; CUDA graphs on CUDA, their
eager emulation elsewhere), the `Sampler` on every verify row, the samples on the host,
acceptance there (`accept_drafts`, or `SyntheticAcceptance` to fix the accepted length), then
the graph after acceptance: the KDA commit of the accepted tokens and `MTPProposer`'s greedy
passes (`draft_after_verify`) drafting num_spec tokens for the next cycle, whose verify step
they become.

Every cycle verifies at the same positions (ctx - 2 num_spec .. ctx - num_spec; the drafts'
rows end at ctx - 1, inside the tables), as `slice.engine_step_ms` decodes at one position:
the latent rows are overwritten, the KDA states carry on. The block tables reach the graphs'
persistent rows once; later cycles send an empty delta, as the engine's steady state does.
Random weights decide nothing here but which tokens are drafted: the result says which
acceptance the timed cycles had.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch

from glm53.actors.caches import ModelCaches, open_ring_size
from glm53.actors.config import ModelConfig
from glm53.actors.cuda_graphs import DecodeGraphs
from glm53.actors.forward_batch import slot_mapping_for
from glm53.actors.model_runner import logits_row_index, place_emitted
from glm53.actors.sampler import Sampler, build_sampling_inputs
from glm53.actors.speculative.mtp import MTPProposer
from glm53.actors.speculative.verify import SyntheticAcceptance, accept_drafts
from glm53.actors.step import SamplingParams, StepInput


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_step(step_id: int, ctx: int, tables: np.ndarray, last: np.ndarray,
                drafts: np.ndarray, block_size: int, delta: bool = True) -> StepInput:
    """The greedy verify step of one cycle: sequence i in state slot i brings its last token
    `last[i]` and its drafts `drafts[i]` at positions ctx - 2k .. ctx - k and asks for k new
    drafts. `delta`: the block tables already sit in the graphs' rows (an empty delta)."""
    n, k = drafts.shape
    w = 1 + k
    seqs = np.repeat(np.arange(n), w)
    positions = np.tile(np.arange(ctx - 2 * k, ctx - k + 1), n)
    empty = np.zeros(0, np.int64)
    return StepInput(
        step_id, [f"seq{i}" for i in range(n)],
        np.concatenate([last[:, None], drafts], axis=1).reshape(-1), positions,
        np.arange(n + 1, dtype=np.int64) * w, tables,
        slot_mapping_for(positions, seqs, tables, block_size), np.arange(n, dtype=np.int64),
        np.arange(n * w, dtype=np.int64), seqs,
        build_sampling_inputs([(SamplingParams(temperature=0.0), 0, ctx, (), (), ())] * (n * w)),
        num_drafts=np.full(n, k, np.int64), draft_ids=drafts.copy(),
        next_tokens=np.full(n, -1, np.int64), propose=np.full(n, k, np.int64),
        block_table_resets=empty if delta else None,
        block_table_updates=empty.reshape(0, 3) if delta else None)


class MTPCycle:
    """The runner's parts for verify steps of `batch_size` sequences with `num_spec` MTP
    drafts over `caches` (the caches' last state slot is the graphs' pad slot, as the runner
    allocates one more than it hands out). `acceptance`: SyntheticAcceptance's probability
    per draft position, or None for the real rule (`accept_drafts`)."""

    def __init__(self, model, caches: ModelCaches, cfg: ModelConfig, batch_size: int,
                 num_spec: int, acceptance: tuple[float, ...] | None = None) -> None:
        if caches.mtp is None:
            raise ValueError("the MTP cycle needs caches allocated with the MTP layer")
        if caches.mtp.open_rows.shape[1] < open_ring_size(cfg, num_spec):
            raise ValueError(f"caches allocated for fewer than {num_spec} drafts (num_spec)")
        self.model, self.caches = model, caches
        self.device = next(model.parameters()).device
        self.proposer = MTPProposer(model, caches, num_spec)
        self.graphs = DecodeGraphs(
            model, caches, pad_slot=caches.layers[0].conv.shape[0] - 1,
            max_blocks=cfg.max_position_embeddings // caches.block_size,
            batch_sizes=(batch_size,), widths=(1, 1 + num_spec),
            capture=self.device.type == "cuda", drafter=self.proposer.draft_after_verify,
            draft_passes=num_spec)
        self.sampler = Sampler()
        self.verify = accept_drafts if acceptance is None else SyntheticAcceptance(acceptance)
        self.acceptance = "measured (accept_drafts: greedy drafts vs greedy target)" if (
            acceptance is None) else "synthetic " + ",".join(f"{p:g}" for p in acceptance)

    @torch.inference_mode()
    def run(self, step: StepInput,
            marks: list[float] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ModelRunner.launch of a verify step through the graphs: (accepted [N], sampled
        [R] with each sequence's emitted tokens in its first rows, next drafts [N, K]).
        Appends the host time after verify + sampling, acceptance, and the graph after
        acceptance (KDA commit + MTP drafts, to the host) to `marks`: each phase ends on the
        host (the samples and the drafts are copied there), so the split needs no extra wait."""
        self.graphs.static.update_tables(step)
        key = self.graphs.bucket(step)
        if key is None:
            raise ValueError("the verify step does not fit the graphs (tables too wide?)")
        rows = logits_row_index(np.concatenate([step.sample_rows, step.prompt_logprob_rows]),
                                self.device)
        _, _, all_logits = self.graphs.run(step, key)
        sampled, _ = self.sampler(all_logits[rows][:len(step.sample_rows)], step.sampling)
        sampled = sampled.cpu().numpy()
        if marks is not None:
            marks.append(time.perf_counter())
        num_accepted, emitted = self.verify(
            sampled, step.sample_seqs, step.num_drafts, step.draft_ids, None, None,
            step.sampling.seeds, step.sampling.positions)
        next_tokens = place_emitted(step, sampled, emitted)
        if marks is not None:
            marks.append(time.perf_counter())
        drafts = self.graphs.run_accepted(key, 1 + num_accepted, next_tokens,
                                          int(step.propose.max())).cpu().numpy()
        if marks is not None:
            marks.append(time.perf_counter())
        return num_accepted, sampled, drafts


def mtp_cycle_ms(model, caches: ModelCaches, cfg: ModelConfig, batch_size: int, ctx: int,
                 tables: list[list[int]], num_spec: int = 3, steps: int = 20,
                 acceptance: tuple[float, ...] | None = None) -> tuple[float, dict]:
    """(ms per MTP cycle of `batch_size` sequences at context `ctx`, what the cycle is made
    of). Sequence i runs in state slot i over `tables[i]`; each cycle verifies the drafts the
    last one proposed. The split (medians, ms) comes from the same cycles, whose phases each
    end on the host: `verify_sample_ms` (building the StepInput, loading
    and replaying the verify step's graph, sampling, up to the samples on the host),
    `accept_ms` (acceptance on the host), `commit_draft_ms` (the graph after acceptance: the
    KDA commit and num_spec MTP passes, the drafts to the host); with the acceptance rule and
    how many drafts the timed cycles accepted (sequences per count)."""
    if ctx <= 2 * num_spec:
        raise ValueError(f"context {ctx} leaves no room for the verify and draft rows")
    cycle = MTPCycle(model, caches, cfg, batch_size, num_spec, acceptance)
    rng = np.random.default_rng(0)
    table = np.array(tables, dtype=np.int32)
    state = dict(step=0, last=rng.integers(0, cfg.vocab_size, batch_size),
                 drafts=rng.integers(0, cfg.vocab_size, (batch_size, num_spec)))
    accepted: Counter[int] = Counter()

    def one(marks: list[float] | None = None, delta: bool = True) -> None:
        if marks is not None:
            marks.append(time.perf_counter())
        step = verify_step(state["step"], ctx, table, state["last"], state["drafts"],
                           caches.block_size, delta)
        num_accepted, sampled, drafts = cycle.run(step, marks)
        first = np.arange(batch_size) * (1 + num_spec)  # each sequence's first sample row
        state.update(step=state["step"] + 1, last=sampled[first + num_accepted], drafts=drafts)
        accepted.update(num_accepted.tolist())

    one(delta=False)  # warm-up: compiles, and writes the tables into the graphs' rows
    one()
    accepted.clear()
    device = cycle.device
    phases = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        marks: list[float] = []
        one(marks)
        phases.append(np.diff(marks))
    _sync(device)
    ms = (time.perf_counter() - start) / steps * 1e3
    split = [float(v) for v in np.median(np.array(phases), axis=0) * 1e3]
    return ms, dict(verify_sample_ms=split[0], accept_ms=split[1], commit_draft_ms=split[2],
                    verify_width=1 + num_spec, acceptance=cycle.acceptance,
                    accepted_drafts=dict(sorted(accepted.items())),
                    cuda_graphs=bool(cycle.graphs.graphs))
