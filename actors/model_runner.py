"""ModelRunner: StepInput (host arrays) -> tensors -> model over the paged caches -> logits rows
-> sampler -> StepOutput. Owns the model shard, its caches and the sampler of one worker; every
rank runs the same forward (the collectives need all of them) and samples the same gathered logits;
only rank 0 answers with the StepOutput.

On CUDA, uniform decode / verify steps replay a captured graph of the forward + lm_head
(cuda_graphs.py); every other step, and every step under `enforce_eager`, runs eagerly.

The sampled ids of the last step stay on the device: a step scheduled before that one's result
reached the engine (overlapped scheduling) names the tokens it needs by their sample rows
(`StepInput.placeholder_rows` / `placeholder_sources`), and they are copied there on the device,
after the step's own inputs: by the graph's first nodes from where the sampler wrote them
(`StaticInputs.samples`), or for an eager step by a gather. A speculative step scheduled so
(`previous_seqs`) is settled on the host from the last step's output, which acceptance has
brought there anyway (overlap.py), except for its sequences that verified no drafts: their
samples are their tokens, filled like a plain step's. A graphed speculative step in which no
sequence verifies or proposes a draft (adaptive draft length at width 0) is not waited for at
all: its MTP cache pass reads the samples on the device.

`execute` is `launch` then `finish`. An executor that overlaps steps (raycluster's
StepPipeline) launches step N+1 before it finishes step N, so the device never waits for the
host work of a step (building its inputs, staging them, launching the graph): the copies
`launch` makes go through pinned memory (`to_device`), which queues them without waiting for
the step in flight."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from .caches import CachePlan, ModelCaches, copy_state_slots, plan_cache
from .cuda_graphs import (
    DEFAULT_MAX_GRAPH_TOKENS,
    DecodeGraphs,
    GraphKey,
    batch_buckets,
    table_buckets,
)
from .forward_batch import DeferredStates, ForwardBatch
from .kv_scale_bank import bank_path, load_scale_bank
from .loader import DTYPES, load_model
from .memory_plan import MemoryPlan, plan_memory
from .overlap import resolve_after
from .parallel import ParallelState
from .sampler import Sampler, gather_logprobs
from .speculative.dflash import DFlashProposer, ring_bytes_per_sequence
from .speculative.dflash_model import DFlashConfig, load_draft
from .speculative.mtp import MTPProposer
from .speculative.verify import accept_drafts
from .step import Logprobs, StepInput, StepOutput
from .transfers import to_device, to_host

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LaunchedStep:
    """A step whose work is queued on the device (`ModelRunner.launch`). A plain step's
    samples are on their way to `sampled` (host memory) once `ready` (a CUDA event; None on
    CPU) has passed; a speculative step was finished at launch and carries its `output`."""
    step: StepInput
    sampled: torch.Tensor | None  # [R] int64 on the host
    ready: torch.cuda.Event | None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    output: StepOutput | None = None
    # drafts per sequence when the step speculated but verified and proposed none (its
    # output then says so: nothing accepted, no drafts); 0 for a plain step
    num_spec: int = 0

    def done(self) -> bool:
        """Whether `finish` would return without waiting."""
        return self.ready is None or self.ready.query()


class ModelRunner:
    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str | None = None,
                 block_size: int = 16, num_slots: int = 16, num_blocks: int | None = None,
                 cache_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 with_mtp: bool = False, progress: bool = False,
                 ps: ParallelState | None = None, num_spec: int = 0,
                 draft_model: str | None = None, draft_sampling: str = "greedy",
                 enforce_eager: bool = False, adaptive_drafts: bool = False,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None,
                 cuda_graph_context_sizes: tuple[int, ...] | None = None,
                 cuda_graph_max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS,
                 max_model_len: int | None = None,
                 quantize_experts: str | None = None,
                 max_num_batched_tokens: int = 2048, kv_cache_dtype: str = "auto",
                 kv_scale_bank: str | None = None, with_vision: bool = False,
                 num_checkpoints: int = 0, draft_kv_cache_dtype: str = "auto") -> None:
        """`block_size` counts logical tokens per block (latent rows per rank x DCP size).
        Speculation: `num_spec` drafts per step from the MTP layer (`with_mtp`) or from the DFlash
        draft checkpoint `draft_model` (its layers TP-sharded like the target's); with
        `adaptive_drafts` a step may verify any 0..num_spec of them. CUDA graphs (unless
        `enforce_eager`) are captured for decode batches of `cuda_graph_batch_sizes` (capped at
        num_slots) with block tables wide enough for `max_model_len` (default: the model's context)
        tokens, and narrower ones for the `cuda_graph_context_sizes` shorter than that (default
        cuda_graphs.DEFAULT_CONTEXT_SIZES), each of at most `cuda_graph_max_tokens` rows (batch x
        verify width; wider steps run eagerly). `quantize_experts` ("int4") quantises the routed
        experts of a dense/FP8 checkpoint while loading. `kv_cache_dtype` (caches.KV_CACHE_DTYPES)
        sets the latent rows; nvfp4 reads its outer scales from `kv_scale_bank` (default: the bank
        file in the checkpoint). `with_vision` builds the vision tower: image embeddings are
        computed once per image and spliced over its placeholders chunk by chunk.

        On CUDA without an explicit cache size, the memory plan (memory_plan.py) of the
        meta-built model is checked before anything is allocated, so a model that cannot fit
        is refused with the numbers; after loading, the KV pool gets the measured free memory
        under `gpu_memory_utilization` (which caps weights, caches, activations and graphs)
        less the plan's workspace estimate for what is allocated after the caches.
        `num_checkpoints` more state slots hold the engine's prefix-cache KDA checkpoints
        (with a DFlash draft, each with a ring of its own). `draft_kv_cache_dtype`
        (dflash.DRAFT_KV_CACHE_DTYPES) sets how the DFlash rings are stored."""
        self.device = torch.device(device)
        self.ps = ps or ParallelState()
        if draft_sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"draft sampling {draft_sampling!r}: greedy or probabilistic")
        self.memory_plan: MemoryPlan | None = None
        self.kv_cache_dtype = kv_cache_dtype
        self.draft_kv_cache_dtype = draft_kv_cache_dtype
        self.kv_scales = (load_scale_bank(bank_path(model_dir, kv_scale_bank))
                          if kv_cache_dtype == "nvfp4" else None)
        sized = num_blocks is not None or cache_bytes is not None

        def check_memory(meta_model) -> None:
            if self.device.type != "cuda" or sized:
                return
            total = torch.cuda.mem_get_info(self.device)[1]
            self.memory_plan = plan_memory(
                meta_model, total, gpu_memory_utilization, block_size=block_size,
                num_slots=num_slots, num_spec=num_spec, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_dtype=kv_cache_dtype, num_checkpoints=num_checkpoints,
                draft=DFlashConfig.from_dir(draft_model) if draft_model and num_spec else None,
                draft_kv_cache_dtype=draft_kv_cache_dtype,
                graph_max_tokens=cuda_graph_max_tokens,
            ).check()

        self.model = load_model(model_dir, with_mtp=with_mtp,
                                dtype=DTYPES[dtype] if dtype else None, device=self.device,
                                progress=progress, ps=self.ps,
                                quantize_experts=quantize_experts, check_memory=check_memory,
                                with_vision=with_vision)
        self.config = self.model.config
        cache_dtype = self.model.embed_tokens.weight.dtype
        self.with_mtp, self.num_spec = with_mtp, num_spec
        self.draft_sampling = draft_sampling
        self.adaptive_drafts = adaptive_drafts
        # the draft is loaded before the cache is sized, so its weights come out of the budget
        self.draft = (load_draft(draft_model, cache_dtype, self.device, self.ps)
                      if draft_model and num_spec else None)
        if not sized:
            cache_bytes = self._free_memory_budget(gpu_memory_utilization)
        # the DFlash rings (one per running slot and per checkpoint, allocated with the
        # caches) come out of the same budget as the blocks
        ring = (ring_bytes_per_sequence(self.draft.config, cache_dtype, self.ps.tp_size,
                                        draft_kv_cache_dtype)
                if self.draft is not None else 0)
        if cache_bytes is not None:
            cache_bytes -= (num_slots + num_checkpoints) * ring
        self.proposer: MTPProposer | DFlashProposer | None = None
        # what this rank could hold; ranks agree on the smallest before allocating
        # the budget also pays for the padding slot of the CUDA graphs (see allocate_caches);
        # the engine is told of num_slots
        self.plan: CachePlan = dataclasses.replace(
            plan_cache(self.config, block_size, num_slots + 1 + num_checkpoints, cache_dtype,
                       with_mtp, num_blocks=num_blocks, budget_bytes=cache_bytes, ps=self.ps,
                       num_spec=num_spec, kv_cache_dtype=kv_cache_dtype), num_slots=num_slots,
            num_checkpoints=num_checkpoints, draft_bytes_per_slot=ring,
            memory_plan=self.memory_plan.describe() if self.memory_plan else None)
        self.caches: ModelCaches | None = None
        self.sampler = Sampler()
        # drafts -> (accepted counts, emitted tokens); a benchmark may put SyntheticAcceptance
        self.verify_drafts = accept_drafts
        self.graphs: DecodeGraphs | None = None
        self.enforce_eager = enforce_eager or self.device.type != "cuda"
        self.graph_batch_sizes = batch_buckets(num_slots, cuda_graph_batch_sizes)
        self.graph_context_sizes = cuda_graph_context_sizes
        self.graph_max_tokens = cuda_graph_max_tokens
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        # embeddings of images whose prefill continues in a later chunk, by StepImage.key
        self.image_embeds: dict[str, torch.Tensor] = {}
        # [R] sampled ids of the last step, on the device (after a speculative step, only
        # the rows of sequences that verified no drafts are tokens: a step continuing the
        # others is settled on the host from last_step instead)
        self.last_sampled: torch.Tensor | None = None
        # the last step as it ran and its output (every rank), for a step that continues it
        self.last_step: tuple[StepInput, StepOutput] | None = None

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
            self.num_spec, self.kv_cache_dtype, self.kv_scales)
        if self.draft is not None:
            self.proposer = DFlashProposer(self.model, self.draft, self.plan.num_slots,
                                           self.num_spec, self.plan.num_checkpoints,
                                           self.draft_kv_cache_dtype)
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
        CPU tests). Widths: plain decode, and verify of num_spec drafts when speculating (of
        any 1..num_spec with adaptive draft length, whose uniform steps take each width)."""
        widths = (1,)
        if self.proposer is not None:
            widths = tuple(range(1, 2 + self.num_spec)) if self.adaptive_drafts else (
                1, 1 + self.num_spec)
        max_blocks = min(-(-self.max_model_len // self.plan.block_size),
                         self.plan.num_blocks - 1)
        greedy_mtp = isinstance(self.proposer, MTPProposer) and not self.proposer.probabilistic
        return DecodeGraphs(self.model, self.caches, pad_slot=self.plan.num_slots,
                            max_blocks=max_blocks, batch_sizes=self.graph_batch_sizes,
                            widths=widths, tap_layers=getattr(self.proposer, "tap_layers", ()),
                            capture=capture,
                            drafter=self.proposer.draft_after_verify if greedy_mtp else None,
                            draft_passes=self.num_spec if greedy_mtp else 0,
                            table_widths=table_buckets(max_blocks, self.plan.block_size,
                                                       self.graph_context_sizes),
                            max_tokens=self.graph_max_tokens,
                            # a step samples at most 1 + num_spec rows a sequence
                            max_samples=self.plan.num_slots * (1 + self.num_spec))

    def _free_memory_budget(self, utilization: float) -> int:
        if self.device.type != "cuda":
            raise ValueError("on CPU give the cache size explicitly (num_blocks or cache_bytes)")
        free, total = torch.cuda.mem_get_info(self.device)
        # what the process may still take under the utilisation cap after the weights (and a
        # draft), less what is allocated after the caches (activations, graph pool, DFlash forward)
        return int(utilization * total) - (total - free) - self.memory_plan.after_cache_bytes

    def execute(self, step: StepInput) -> StepOutput | None:
        """Run one step; rank 0 returns the StepOutput, other ranks None (`launch`, then
        `finish`)."""
        return self.finish(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step's work on the device and return without waiting for it, unless it
        speculates: acceptance is decided on the host, so a speculative step is finished here.
        A plain step's samples travel to the host behind the step; `finish` waits for them.
        The next step may be launched before this one is finished if it does not continue a
        speculative step of this one (`previous_seqs`: settled from `last_step`, which
        `finish` sets). Every rank samples (the gathered logits are identical), so
        acceptance, the KDA commit and the MTP drafts agree everywhere without a broadcast."""
        if step.previous_seqs is not None:
            if self.last_step is None:
                raise RuntimeError(f"step {step.step_id} continues a step that did not run")
            step = resolve_after(step, *self.last_step, self.plan.block_size)
        if step.state_copies is not None:
            copy_state_slots(self.caches, step.state_copies)
            if isinstance(self.proposer, DFlashProposer):
                self._copy_draft_rings(step.state_copies)
        n_sample = len(step.sample_rows)
        rows = logits_row_index(np.concatenate([step.sample_rows, step.prompt_logprob_rows]),
                                self.device)
        if step.placeholder_rows is not None and self.last_sampled is None:
            raise RuntimeError(f"step {step.step_id} has placeholders, but the step before it "
                               f"left no samples on the device (none ran, or it speculated)")
        key = None
        if self.graphs is not None:
            # a chunk of image placeholders is never a decode step, whatever its width
            key = None if step.images else self.graphs.bucket(step)
            # eager steps too: the rows stay current (a graph sets a small delta itself)
            if key is None or not self.graphs.static.delta_in_graph(step, key.batch):
                self.graphs.static.update_tables(step)
        if key is not None:  # the graph fills placeholders from graphs.static.samples
            hidden, taps, all_logits = self.graphs.run(step, key)
            logits = all_logits[rows]
        else:
            hidden, taps = self._forward(step, self._batch(step), self._placeholder_fill(step))
            logits = self.model.compute_logits(hidden[rows])
        # with graphs the samples land where the next graph's placeholders read them
        out = None if self.graphs is None else self.graphs.static.samples_out(n_sample)
        draft_probs = self._draft_probs(step)
        if draft_probs is None:
            sampled, logprobs = self.sampler(logits[:n_sample], step.sampling, out=out)
            probs = None
        else:
            sampled, logprobs, probs = self.sampler(logits[:n_sample], step.sampling,
                                                    with_probs=True, out=out)
        # read before the next step's forward overwrites the graph's logits
        prompt_logprobs = self._prompt_logprobs(step, logits[n_sample:])
        # a speculative step's samples stay usable as placeholders too: a sequence that
        # verified no drafts emits its sample (the engine fills only such sequences' tokens so)
        self.last_sampled = sampled
        if step.num_drafts is None:
            return LaunchedStep(step, *to_host(sampled), logprobs, prompt_logprobs)
        if self._drafts_nothing_on_device(step, key):
            # nothing to accept and nothing to draft: the samples are the tokens, and the MTP
            # cache rows of the step's rows are written from them on the device, so the step
            # is not waited for here (the next one may be launched first, as after a plain
            # step). The samples' copy to the host is queued before that pass.
            launched = LaunchedStep(step, *to_host(sampled), logprobs, prompt_logprobs,
                                    num_spec=self.num_spec)
            self.graphs.run_accepted(key, None, sampled)
            return launched
        sampled = sampled.cpu().numpy()
        num_accepted, emitted = self.verify_drafts(
            sampled, step.sample_seqs, step.num_drafts, step.draft_ids, probs, draft_probs,
            step.sampling.seeds, step.sampling.positions)
        next_tokens = place_emitted(step, sampled, emitted)
        if logprobs is not None and probs is not None:  # rejection may change tokens
            logprobs = gather_logprobs(torch.log(probs),
                                       torch.tensor(sampled, device=self.device),
                                       int(step.sampling.num_logprobs.max()))
        drafts = None
        if key is not None and self.graphs.has_accepted_graph(key.width):
            # the KDA commit (and greedy MTP drafts) as one graph after acceptance
            graphed = self.graphs.run_accepted(key, 1 + num_accepted, next_tokens,
                                               int(step.propose.max()))
            if graphed is not None:
                drafts = np.full((len(step.state_ids), self.num_spec), -1, np.int64)
                drafts[:, :graphed.shape[1]] = graphed.cpu().numpy()
                drafts[np.arange(self.num_spec)[None, :] >= step.propose[:, None]] = -1
        elif step.num_drafts.any():  # the verifying sequences' KDA states were deferred
            mine = step.num_drafts > 0
            self.model.commit_speculative(
                DeferredStates.of_step(step.positions, step.cu_seqlens, step.state_ids,
                                       step.num_drafts, self.device),
                self.caches, to_device(1 + num_accepted[mine], self.device))
        if drafts is None and self.proposer is not None:
            drafts = self._propose(step, hidden, taps, num_accepted, next_tokens)
        output = StepOutput(step.step_id, sampled, logprobs, prompt_logprobs, num_accepted,
                            drafts)
        self.last_step = (step, output)
        return LaunchedStep(step, None, None, output=output)

    def finish(self, launched: LaunchedStep) -> StepOutput | None:
        """Wait for a launched step's samples; rank 0 returns its StepOutput, other ranks
        None. Steps are finished in the order they were launched."""
        output = launched.output
        if output is None:
            if launched.ready is not None:
                launched.ready.synchronize()
            n = len(launched.step.state_ids)
            nothing_drafted = dict(num_accepted=np.zeros(n, np.int64), draft_ids=np.full(
                (n, launched.num_spec), -1, np.int64)) if launched.num_spec else {}
            output = StepOutput(launched.step.step_id, launched.sampled.numpy(),
                                launched.logprobs, launched.prompt_logprobs, **nothing_drafted)
            self.last_step = (launched.step, output)
        return output if self.ps.rank == 0 else None

    def _drafts_nothing_on_device(self, step: StepInput, key: GraphKey | None) -> bool:
        """Whether a speculative step needs no acceptance on the host: a graphed step of one
        token per sequence, each sampling it, none verifying or proposing a draft (adaptive
        draft length at width 0), with a drafter whose cache pass the graph after acceptance
        runs (greedy MTP)."""
        return (key is not None and key.width == 1 and self.graphs.drafter is not None
                and not step.num_drafts.any() and not step.propose.any()
                and len(step.sample_seqs) == len(step.state_ids))

    def _prompt_logprobs(self, step: StepInput, logits: torch.Tensor) -> Logprobs | None:
        """Rank 0's logprobs of the prompt tokens of `step.prompt_logprob_rows` (logits: theirs)."""
        if self.ps.rank != 0 or not len(step.prompt_logprob_rows):
            return None
        return gather_logprobs(torch.log_softmax(logits, dim=-1),
                               to_device(step.prompt_logprob_targets, self.device),
                               int(step.prompt_logprob_k.max()))

    def _copy_draft_rings(self, copies: np.ndarray) -> None:
        """A KDA checkpoint also keeps the DFlash ring of its slot: saved with it (slot ->
        checkpoint) and restored with it on a prefix-cache hit (checkpoint -> slot)."""
        for src, dst in copies.tolist():
            index = self.plan.checkpoint_of(dst)
            if index is not None:
                self.proposer.save(src, index)
            else:
                self.proposer.restore(self.plan.checkpoint_of(src), dst)

    def _batch(self, step: StepInput) -> ForwardBatch:
        return ForwardBatch.from_arrays(step.positions, step.cu_seqlens, step.block_tables,
                                        step.slot_mapping, step.state_ids, self.device,
                                        step.num_drafts)

    def _placeholder_fill(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows, their ids from the last step's samples), on the device, or None: an
        eager step's placeholders (a graph fills its own)."""
        if step.placeholder_rows is None:
            return None
        sources = to_device(step.placeholder_sources, self.device)
        rows = to_device(step.placeholder_rows, self.device)
        return rows, self.last_sampled[sources]

    def _forward(self, step: StepInput, batch: ForwardBatch,
                 fill: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward: (hidden [T, D], tap states [T, n_taps * D] or None)."""
        tokens = to_device(step.token_ids, self.device)
        if fill is not None:
            tokens[fill[0]] = fill[1]
        tap_layers = getattr(self.proposer, "tap_layers", ())
        hidden = self.model(tokens, batch, self.caches, tap_layers,
                            image_embeds=self._image_embeds(step))
        return hidden if tap_layers else (hidden, None)

    def _image_embeds(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, embeddings) of the step's image placeholders. An image is embedded
        whole, once: its embeddings are kept until its last placeholder is computed, or
        dropped (and recomputed from the pixels the step carries) when its request skips a
        step, so nothing outlives an aborted or preempted request. The images a step embeds
        go through the tower in one call (its attention keeps each image to itself), not one
        call each: the eager tower's launches, not its math, bound one small image."""
        if not step.images:
            self.image_embeds.clear()
            return None
        if self.model.visual is None:
            raise RuntimeError("a step carries images but the model has no vision tower")
        new = list({item.key: item.image for item in step.images
                    if item.key not in self.image_embeds}.items())
        embedded = dict(self.image_embeds)
        if new:
            pixels = to_device(np.concatenate([image.pixel_values for _, image in new]),
                               self.device)
            out = self.model.visual(pixels, [image.grid_thw for _, image in new])
            embedded.update(zip((key for key, _ in new),
                                out.split([image.num_tokens for _, image in new]),
                                strict=True))
        kept, rows, parts = {}, [], []
        for item in step.images:
            embeds = embedded[item.key]
            if item.end < item.image.num_tokens:
                kept[item.key] = embeds
            rows.append(item.rows)
            parts.append(embeds[item.start:item.end])
        self.image_embeds = kept
        return to_device(np.concatenate(rows), self.device), torch.cat(parts)

    def _draft_probs(self, step: StepInput) -> list[torch.Tensor | None] | None:
        """Per sequence, the distributions its drafts were drawn from (probabilistic MTP)."""
        kept = getattr(self.proposer, "draft_probs", None)
        if not kept or step.num_drafts is None:
            return None
        return [kept.get(rid) if k else None
                for rid, k in zip(step.request_ids, step.num_drafts, strict=True)]

    def _propose(self, step: StepInput, hidden: torch.Tensor, taps: torch.Tensor | None,
                 num_accepted: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
        lengths = np.diff(step.cu_seqlens)
        kept = np.where(step.num_drafts > 0, 1 + num_accepted, lengths)
        return self.proposer.propose(step, hidden, kept, next_tokens, taps)


def place_emitted(step: StepInput, sampled: np.ndarray, emitted: list[list[int]]) -> np.ndarray:
    """After acceptance of a speculative step: write each sequence's emitted tokens into the
    first of its sample rows of `sampled` [R] (where the engine reads them), in place, and
    return each sequence's token after its kept rows [N] (the last one emitted; the step's
    `next_tokens` for a sequence that samples nothing)."""
    next_tokens = step.next_tokens.copy()
    row = 0
    for seq, tokens in zip(dict.fromkeys(step.sample_seqs.tolist()), emitted, strict=True):
        sampled[row:row + len(tokens)] = tokens
        row += 1 + int(step.num_drafts[seq])
        next_tokens[seq] = tokens[-1]
    return next_tokens


def logits_row_index(rows: np.ndarray, device: torch.device | str) -> slice | torch.Tensor:
    """Index of the logits rows a step reads: a slice when they are consecutive (every decode
    step), which needs no copy to the device and no gather kernel."""
    if len(rows) and (np.diff(rows) == 1).all():
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return to_device(rows.astype(np.int64), device)
