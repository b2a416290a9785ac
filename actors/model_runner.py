"""ModelRunner: StepInput (host arrays) -> tensors -> model over the paged caches -> logits rows
-> sampler -> StepOutput. Owns the model shard, its caches and the sampler of one worker; every
rank runs the same forward (the collectives need all of them) and samples the same gathered logits;
only rank 0 answers with the StepOutput.

On CUDA, uniform decode / verify steps replay a captured graph of the forward + lm_head
(cuda_graphs.py); every other step, and every step under `enforce_eager`, runs eagerly."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from .caches import CachePlan, ModelCaches, copy_state_slots, plan_cache
from .cuda_graphs import DecodeGraphs, batch_buckets
from .forward_batch import ForwardBatch
from .loader import DTYPES, load_model
from .memory_plan import MemoryPlan, plan_memory
from .parallel import ParallelState
from .sampler import Sampler, gather_logprobs
from .speculative.dflash import DFlashProposer
from .speculative.dflash_model import load_draft
from .speculative.mtp import MTPProposer
from .speculative.verify import accept_drafts
from .step import StepInput, StepOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str | None = None,
                 block_size: int = 16, num_slots: int = 16, num_blocks: int | None = None,
                 cache_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 with_mtp: bool = False, progress: bool = False,
                 ps: ParallelState | None = None, num_spec: int = 0,
                 draft_model: str | None = None, draft_sampling: str = "greedy",
                 enforce_eager: bool = False,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None,
                 max_model_len: int | None = None,
                 quantize_experts: str | None = None,
                 max_num_batched_tokens: int = 2048, num_checkpoints: int = 0) -> None:
        """`block_size` counts logical tokens per block (latent rows per rank x DCP size).
        Speculation: `num_spec` drafts per step from the MTP layer (`with_mtp`) or from the
        DFlash draft checkpoint `draft_model` (replicated on every rank). CUDA graphs (unless
        `enforce_eager`) are captured for decode batches of `cuda_graph_batch_sizes` (capped
        at num_slots) with block tables wide enough for `max_model_len` (default: the
        model's context) tokens. `quantize_experts` ("int4") quantises the routed experts of a
        dense/FP8 checkpoint while loading.

        On CUDA without an explicit cache size, the memory plan (memory_plan.py) of the
        meta-built model is checked before anything is allocated, so a model that cannot fit
        is refused with the numbers; after loading, the KV pool gets the measured free memory
        under `gpu_memory_utilization` (which caps weights, caches, activations and graphs)
        less the plan's workspace estimate for what is allocated after the caches.
        `num_checkpoints` more state slots hold the engine's prefix-cache KDA checkpoints."""
        self.device = torch.device(device)
        self.ps = ps or ParallelState()
        if draft_sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"draft sampling {draft_sampling!r}: greedy or probabilistic")
        self.memory_plan: MemoryPlan | None = None
        sized = num_blocks is not None or cache_bytes is not None

        def check_memory(meta_model) -> None:
            if self.device.type != "cuda" or sized:
                return
            total = torch.cuda.mem_get_info(self.device)[1]
            self.memory_plan = plan_memory(
                meta_model, total, gpu_memory_utilization, block_size=block_size,
                num_slots=num_slots, num_spec=num_spec, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens).check()

        self.model = load_model(model_dir, with_mtp=with_mtp,
                                dtype=DTYPES[dtype] if dtype else None, device=self.device,
                                progress=progress, ps=self.ps,
                                quantize_experts=quantize_experts, check_memory=check_memory)
        self.config = self.model.config
        cache_dtype = self.model.embed_tokens.weight.dtype
        self.with_mtp, self.num_spec = with_mtp, num_spec
        self.draft_sampling = draft_sampling
        # the draft is loaded before the cache is sized, so its weights come out of the budget
        self.draft = (load_draft(draft_model, cache_dtype, self.device)
                      if draft_model and num_spec else None)
        if not sized:
            cache_bytes = self._free_memory_budget(gpu_memory_utilization)
        self.proposer: MTPProposer | DFlashProposer | None = None
        # what this rank could hold; ranks agree on the smallest before allocating
        # the budget also pays for the padding slot of the CUDA graphs (see allocate_caches);
        # the engine is told of num_slots
        self.plan: CachePlan = dataclasses.replace(
            plan_cache(self.config, block_size, num_slots + 1 + num_checkpoints, cache_dtype,
                       with_mtp, num_blocks=num_blocks, budget_bytes=cache_bytes, ps=self.ps,
                       num_spec=num_spec), num_slots=num_slots,
            num_checkpoints=num_checkpoints,
            memory_plan=self.memory_plan.describe() if self.memory_plan else None)
        self.caches: ModelCaches | None = None
        self.sampler = Sampler()
        # drafts -> (accepted counts, emitted tokens); a benchmark may put SyntheticAcceptance
        self.verify_drafts = accept_drafts
        self.graphs: DecodeGraphs | None = None
        self.enforce_eager = enforce_eager or self.device.type != "cuda"
        self.graph_batch_sizes = batch_buckets(num_slots, cuda_graph_batch_sizes)
        self.max_model_len = max_model_len or self.config.max_position_embeddings

    def allocate_caches(self, num_blocks: int) -> CachePlan:
        """Allocate the caches with `num_blocks` blocks (<= this rank's plan)."""
        if num_blocks > self.plan.num_blocks:
            raise ValueError(f"{num_blocks} blocks exceed this rank's budget "
                             f"({self.plan.num_blocks})")
        self.plan = dataclasses.replace(self.plan, num_blocks=num_blocks)
        # one slot more than the engine hands out: padded graph rows run in it
        self.caches = ModelCaches.allocate(
            self.config, num_blocks, self.plan.block_size,
            self.plan.num_slots + 1 + self.plan.num_checkpoints,
            self.model.embed_tokens.weight.dtype, self.device, self.with_mtp, self.ps,
            self.num_spec)
        if self.draft is not None:
            self.proposer = DFlashProposer(self.model, self.draft, self.plan.num_slots,
                                           self.num_spec)
        elif self.with_mtp and self.num_spec:
            self.proposer = MTPProposer(self.model, self.caches, self.num_spec,
                                        probabilistic=self.draft_sampling == "probabilistic")
        if not self.enforce_eager:
            try:
                self.graphs = self.make_graphs(capture=True)
            except Exception as exc:  # noqa: BLE001 - a path we cannot capture runs eagerly
                logger.warning("CUDA graph capture failed, running every step eagerly: %s: %s",
                               type(exc).__name__, exc)
                self.graphs = None
        return self.plan

    def make_graphs(self, capture: bool) -> DecodeGraphs:
        """Decode graphs over this runner's caches (capture=False: their eager emulation, for
        CPU tests). Widths: plain decode, and verify of num_spec drafts when speculating."""
        widths = (1, 1 + self.num_spec) if self.proposer is not None else (1,)
        max_blocks = min(-(-self.max_model_len // self.plan.block_size),
                         self.plan.num_blocks - 1)
        return DecodeGraphs(self.model, self.caches, pad_slot=self.plan.num_slots,
                            max_blocks=max_blocks, batch_sizes=self.graph_batch_sizes,
                            widths=widths, tap_layers=getattr(self.proposer, "tap_layers", ()),
                            capture=capture)

    def _free_memory_budget(self, utilization: float) -> int:
        if self.device.type != "cuda":
            raise ValueError("on CPU give the cache size explicitly (num_blocks or cache_bytes)")
        free, total = torch.cuda.mem_get_info(self.device)
        # what the process may still take under the utilisation cap after the weights (and a
        # draft), less what is allocated after the caches (activations, graph pool)
        return int(utilization * total) - (total - free) - self.memory_plan.workspace_bytes

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput | None:
        """Run one step; rank 0 returns the StepOutput, other ranks None. Every rank samples
        (the gathered logits are identical), so acceptance, the KDA commit and the MTP drafts
        agree everywhere without a broadcast."""
        if step.state_copies is not None:
            copy_state_slots(self.caches, step.state_copies)
        n_sample = len(step.sample_rows)
        rows = logits_row_index(np.concatenate([step.sample_rows, step.prompt_logprob_rows]),
                          self.device)
        key = self.graphs.bucket(step) if self.graphs is not None else None
        if key is not None:
            batch = None  # built only if a verify step must commit its KDA states
            hidden, taps, all_logits = self.graphs.run(step, key)
            logits = all_logits[rows]
        else:
            batch = self._batch(step)
            hidden, taps = self._forward(step, batch)
            logits = self.model.compute_logits(hidden[rows])
        draft_probs = self._draft_probs(step)
        if draft_probs is None:
            sampled, logprobs = self.sampler(logits[:n_sample], step.sampling)
            probs = None
        else:
            sampled, logprobs, probs = self.sampler(logits[:n_sample], step.sampling,
                                                    with_probs=True)
        sampled = sampled.cpu().numpy()
        num_accepted = drafts = None
        if step.num_drafts is not None:
            num_accepted, emitted = self.verify_drafts(
                sampled, step.sample_seqs, step.num_drafts, step.draft_ids, probs, draft_probs,
                step.sampling.seeds, step.sampling.positions)
            row = 0  # the engine reads each sequence's emitted tokens from its sample rows
            for seq, tokens in zip(dict.fromkeys(step.sample_seqs.tolist()), emitted,
                                   strict=True):
                sampled[row:row + len(tokens)] = tokens
                row += 1 + int(step.num_drafts[seq])
            if logprobs is not None and probs is not None:  # rejection may change tokens
                logprobs = gather_logprobs(torch.log(probs),
                                           torch.tensor(sampled, device=self.device),
                                           int(step.sampling.num_logprobs.max()))
            if step.num_drafts.any():  # the verifying sequences' KDA states were deferred
                self.model.commit_speculative(
                    batch if batch is not None else self._batch(step), self.caches,
                    torch.tensor(1 + num_accepted, device=self.device))
            if self.proposer is not None:
                drafts = self._propose(step, hidden, taps, num_accepted, emitted)
        if self.ps.rank != 0:
            return None
        prompt_logprobs = None
        if len(step.prompt_logprob_rows):
            prompt_logprobs = gather_logprobs(
                torch.log_softmax(logits[n_sample:], dim=-1),
                torch.tensor(step.prompt_logprob_targets, device=self.device),
                int(step.prompt_logprob_k.max()))
        return StepOutput(step.step_id, sampled, logprobs, prompt_logprobs, num_accepted, drafts)

    def _batch(self, step: StepInput) -> ForwardBatch:
        return ForwardBatch.from_arrays(step.positions, step.cu_seqlens, step.block_tables,
                                        step.slot_mapping, step.state_ids, self.device,
                                        step.num_drafts)

    def _forward(self, step: StepInput, batch: ForwardBatch
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward: (hidden [T, D], tap states [T, n_taps * D] or None)."""
        tokens = torch.tensor(step.token_ids, device=self.device)
        tap_layers = getattr(self.proposer, "tap_layers", ())
        hidden = self.model(tokens, batch, self.caches, tap_layers)
        return hidden if tap_layers else (hidden, None)

    def _draft_probs(self, step: StepInput) -> list[torch.Tensor | None] | None:
        """Per sequence, the distributions its drafts were drawn from (probabilistic MTP)."""
        kept = getattr(self.proposer, "draft_probs", None)
        if not kept or step.num_drafts is None:
            return None
        return [kept.get(rid) if k else None
                for rid, k in zip(step.request_ids, step.num_drafts, strict=True)]

    def _propose(self, step: StepInput, hidden: torch.Tensor, taps: torch.Tensor | None,
                 num_accepted: np.ndarray, emitted: list[list[int]]) -> np.ndarray:
        lengths = np.diff(step.cu_seqlens)
        kept = np.where(step.num_drafts > 0, 1 + num_accepted, lengths)
        next_tokens = step.next_tokens.copy()
        for seq, tokens in zip(dict.fromkeys(step.sample_seqs.tolist()), emitted, strict=True):
            next_tokens[seq] = tokens[-1]
        return self.proposer.propose(step, hidden, kept, next_tokens, taps)


def logits_row_index(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Index of the logits rows a step reads: a slice when they are consecutive (every decode
    step), which needs no copy to the device and no gather kernel."""
    if len(rows) and (np.diff(rows) == 1).all():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
