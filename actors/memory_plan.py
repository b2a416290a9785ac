"""Memory plan of one rank, made from the meta-built model before anything is allocated.

    device x utilization = weights + reserve + KV pool (KDA state slots + paged blocks)

Weights are exact: parameter bytes of this rank's meta-built shard (numel x element size, in
the storage formats the config names), so the plan is what `materialize` will allocate; a
DFlash draft adds this rank's shard of its weights (its layers are TP-sharded like the
target's) and, per state slot, its K/V ring of this rank's KV heads (speculative/dflash.py),
which the KV pool pays before its blocks. Prefix caching adds state slots for its KDA
checkpoints, each with a ring of its own under DFlash. The MTP layer's cache is
part of every block and slot already (caches.cache_bytes with the MTP layer). The
reserve is an estimate (see `OVERHEAD_BYTES`, `workspace_estimate`). The KV pool is what is left;
its bytes per block and per state slot come from caches.cache_bytes. `MemoryPlan.check` refuses
a model whose weights, reserve and a minimal cache do not fit, with one message naming the
numbers and the ways out; the loader's `check_memory` hook runs it before allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .caches import cache_bytes
from .config import KDA, ModelConfig
from .cuda_graphs import DEFAULT_MAX_GRAPH_TOKENS
from .graph_outputs import GraphOutputs
from .loader import DTYPES, build_model, with_expert_format
from .models.glm5_next import Glm5NextForCausalLM
from .parallel import ParallelConfig, ParallelState
from .speculative.dflash import DRAFT_CHUNK, forward_bytes_per_sequence, ring_bytes_per_sequence
from .speculative.dflash_model import DFlashConfig, draft_weight_bytes

GiB = 2**30
MiB = 2**20

# Parts of the weights, in the order `describe` lists them.
PARTS = ("embedding", "kda", "dsa", "dense_ffn", "shared_experts", "routers", "routed_experts",
         "mhc+norms", "lm_head", "mtp")

# Reserve, part 1 (estimate): device memory outside the weights and torch's tensors: CUDA
# context and kernel images (measured on an H200: 0.53 GiB context, 0.67 GiB once the Triton
# kernels are loaded), NCCL communicator buffers, cuBLAS workspaces, allocator slack.
OVERHEAD_BYTES = 2 * GiB
# Reserve, part 2 (estimate): live activations per token of one layer's eager forward. The
# largest is the MoE: x gathered per routed slot, w13 output, SwiGLU output, down output and
# its fp32 weighted copy, each [T * top_k, ...] (~0.5 MiB per token for top-8 at hidden 4096).
# Measured on an H200 (4-layer full-width slice, bf16, 2048-token prefill at 0-128K context):
# peak 0.50 MiB per token; 1 MiB leaves room for torch's cache fragmentation. Not divided by
# TP: EP ranks still see all T * top_k rows.
ACTIVATION_BYTES_PER_TOKEN = 1 * MiB


def weight_bytes(model: Glm5NextForCausalLM) -> dict[str, int]:
    """Parameter bytes of this rank's model by part (PARTS order, zeros kept): exact for any
    device, meta included. `dsa` is MLA + indexer; `mtp` is the whole MTP layer, its experts
    included; `routed_experts` are the trunk's."""
    parts = dict.fromkeys(PARTS, 0)
    for name, p in model.named_parameters():
        parts[_part(name, model.config)] += p.numel() * p.element_size()
    return parts


def _part(name: str, cfg: ModelConfig) -> str:
    top = name.split(".", 1)[0]
    if top in ("embed_tokens", "lm_head", "mtp"):
        return {"embed_tokens": "embedding"}.get(top, top)
    if name == "norm.weight":
        return "mhc+norms"
    _, layer, block, sub = name.split(".")[:4]  # layers.N.block.sub...
    if block == "self_attn":
        return "kda" if cfg.layer_types[int(layer)] == KDA else "dsa"
    if block == "mlp":
        return {"experts": "routed_experts", "shared_experts": "shared_experts",
                "gate": "routers"}.get(sub, "dense_ffn")
    if block in ("attn_hc", "ffn_hc", "input_layernorm", "post_attention_layernorm"):
        return "mhc+norms"
    raise ValueError(f"parameter {name!r} belongs to no memory-plan part; add it to _part")


def workspace_estimate(cfg: ModelConfig, *, max_num_batched_tokens: int, num_slots: int,
                       num_spec: int, max_model_len: int, dtype: torch.dtype, n_taps: int = 0,
                       tp_size: int = 1, graph_max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS,
                       ) -> int:
    """Bytes the runner allocates after its caches (estimate): the eager forward of one step of
    `max_num_batched_tokens` tokens (torch's cache keeps them) and the CUDA graphs
    (`graph_workspace`)."""
    return (max_num_batched_tokens * activation_bytes_per_token(cfg, max_model_len)
            + graph_workspace(cfg, num_slots=num_slots, num_spec=num_spec,
                              max_model_len=max_model_len, dtype=dtype, n_taps=n_taps,
                              tp_size=tp_size, max_tokens=graph_max_tokens))


def graph_workspace(cfg: ModelConfig, *, num_slots: int, num_spec: int, max_model_len: int,
                    dtype: torch.dtype, n_taps: int = 0, tp_size: int = 1,
                    max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS) -> int:
    """Bytes of the CUDA graphs: their one set of shared outputs, exact
    (GraphOutputs.bytes_per_row in the model `dtype`: hidden, `n_taps` tap states, fp32 logits
    and, when speculating, every KDA layer's replay), plus the graph pool, whose scratch is the
    largest graph's (an estimate: activation_bytes_per_token per row) and which every smaller
    graph reuses. Both scale with the largest graph's rows: num_slots sequences (always a
    bucket) x the widest step, 1 + num_spec (the runner captures widths 1 and 1 + num_spec, or
    with adaptive draft length every width between; none is wider), but at most `max_tokens`
    (the graphs' cap: wider steps run eagerly, within the eager step's reserve)."""
    rows = min(num_slots * (1 + num_spec), max_tokens)
    per_row = GraphOutputs.bytes_per_row(cfg, n_taps=n_taps, verify=num_spec > 0, dtype=dtype,
                                         tp_size=tp_size)
    return rows * (activation_bytes_per_token(cfg, max_model_len) + per_row)


def activation_bytes_per_token(cfg: ModelConfig, max_model_len: int) -> int:
    """Live activations of one token of a forward (estimate): ACTIVATION_BYTES_PER_TOKEN, plus
    the indexer's scores over every pool the block table can address, which grow with the
    context: one fp32 score per pool of index_kpool tokens plus its radix-select histograms (4
    passes x 256 int32 bins per 2048 pools), i.e. (4 + 2) / index_kpool bytes per token of
    max_model_len (1.5 B: 3 GiB for a 2048-token chunk at 1M context; that chunk measured a
    3.3 GiB peak, 4.4 GiB held by torch's cache, against the 5 GiB estimated here)."""
    return ACTIVATION_BYTES_PER_TOKEN + max_model_len * 6 // cfg.index_kpool


class MemoryPlanError(ValueError):
    """The model does not fit the device under the plan."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's device memory in bytes (GiB only in `describe`)."""

    layout: str  # e.g. "TP2/EP2/DCP2 rank 0"
    expert_format: str  # ModelConfig.expert_format: dense | exl3 | int4
    experts: str  # how the routed experts are stored on the device, for humans
    device_bytes: int
    utilization: float  # the share of the device this process may use
    weights: dict[str, int]  # part -> bytes (weight_bytes)
    overhead_bytes: int  # reserve not allocated by torch tensors (OVERHEAD_BYTES)
    workspace_bytes: int  # reserve allocated after the caches (workspace_estimate)
    block_size: int  # logical tokens per paged block (latent rows per rank: block_size / DCP)
    bytes_per_block: int  # one block over every DSA layer (+ MTP)
    bytes_per_slot: int  # one sequence's KDA state + indexer ring over every layer
    num_slots: int  # state slots the engine hands out; the runner pays one more (graph padding)
    min_blocks: int  # the smallest useful pool: the null block + one full step's tokens
    max_model_len: int
    draft_weight_bytes: int = 0  # this rank's DFlash draft weights (draft_weight_bytes), else 0
    draft_bytes_per_slot: int = 0  # its K/V ring per slot (ring_bytes_per_sequence)
    draft_kv_cache_dtype: str = "auto"  # how the ring is stored (dflash.DRAFT_KV_CACHE_DTYPES)
    # prefix-cache KDA state checkpoints: one state slot each (and, with a draft, one ring)
    num_checkpoints: int = 0
    # reserve, part 3 (estimate): one draft forward of DRAFT_CHUNK sequences, after the caches
    draft_workspace_bytes: int = 0

    @property
    def budget_bytes(self) -> int:
        return int(self.device_bytes * self.utilization)

    @property
    def weight_bytes(self) -> int:
        """The target shard's weights and a DFlash draft's."""
        return sum(self.weights.values()) + self.draft_weight_bytes

    @property
    def reserve_bytes(self) -> int:
        return self.overhead_bytes + self.workspace_bytes + self.draft_workspace_bytes

    @property
    def after_cache_bytes(self) -> int:
        """The reserve allocated after the caches (the runner keeps it out of the KV pool)."""
        return self.workspace_bytes + self.draft_workspace_bytes

    @property
    def kv_pool_bytes(self) -> int:
        """What is left for state slots and blocks (negative when the weights do not fit)."""
        return self.budget_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def state_bytes(self) -> int:
        """KDA state slots (num_slots + the graph padding slot + the prefix checkpoints) and
        a DFlash draft's rings (one per running slot and per checkpoint: the proposer's)."""
        return ((self.num_slots + 1 + self.num_checkpoints) * self.bytes_per_slot
                + (self.num_slots + self.num_checkpoints) * self.draft_bytes_per_slot)

    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds after the state slots, the null block 0 included."""
        return max(0, (self.kv_pool_bytes - self.state_bytes) // self.bytes_per_block)

    @property
    def num_tokens(self) -> int:
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def num_sequences(self) -> int:
        """Sequences of max_model_len tokens the blocks hold at once."""
        return self.num_tokens // self.max_model_len

    @property
    def required_bytes(self) -> int:
        """Weights + reserve + the minimal cache (all state slots, min_blocks blocks)."""
        return (self.weight_bytes + self.reserve_bytes + self.state_bytes
                + self.min_blocks * self.bytes_per_block)

    def describe(self) -> str:
        """The start-up log: where the device's memory goes and what the KV pool holds."""
        lines = [
            f"memory plan of {self.layout} (routed experts: {self.experts})",
            f"  usable   {_gib(self.budget_bytes, 8)} = {_gib(self.device_bytes)} x "
            f"{self.utilization:.3g}",
            f"  weights  {_gib(self.weight_bytes, 8)}",
            *(f"    {part:<16}{_gib(n, 8)}" for part, n in self.weights.items() if n),
            *([f"    {'dflash_draft':<16}{_gib(self.draft_weight_bytes, 8)}"]
              if self.draft_weight_bytes else []),
            f"  reserve  {_gib(self.reserve_bytes, 8)} (estimate: {_gib(self.overhead_bytes)} "
            f"overhead + {_gib(self.workspace_bytes)} activations and CUDA graphs"
            + (f" + {_gib(self.draft_workspace_bytes)} DFlash forward"
               if self.draft_workspace_bytes else "") + ")",
            f"  KV pool  {_gib(self.kv_pool_bytes, 8)} = "
            + (f"({self.num_slots + 1} KDA state slots + {self.num_checkpoints} prefix "
               "checkpoints)" if self.num_checkpoints else f"{self.num_slots + 1} KDA state slots")
            + f" x {self.bytes_per_slot / MiB:.1f} MiB + "
            + (f"{self.num_slots + self.num_checkpoints} DFlash rings x "
               f"{self.draft_bytes_per_slot / MiB:.1f} MiB"
               + (f" ({self.draft_kv_cache_dtype})" if self.draft_kv_cache_dtype != "auto"
                  else "") + " + " if self.draft_bytes_per_slot
               else "")
            + f"{self.num_blocks:,} blocks x "
            f"{self.bytes_per_block / 2**10:.0f} KiB ({self.block_size} tokens each)",
            f"  capacity {self.num_tokens:,} tokens = {self.num_sequences} sequences of "
            f"max_model_len {self.max_model_len:,} ({self.num_slots} running at most)",
        ]
        return "\n".join(lines)

    def check(self) -> MemoryPlan:
        """This plan, or MemoryPlanError when the minimal cache does not fit."""
        short = self.required_bytes - self.budget_bytes
        if short <= 0:
            return self
        ways = ["a larger --tp/--ep (more GPUs per engine)", "another checkpoint"]
        if self.expert_format == "dense":  # experts in the model dtype: 4-bit cuts them ~4x
            ways.insert(0, "4-bit routed experts (an EXL3 checkpoint, or --quantize-experts "
                           "int4 for a BF16/FP8 checkpoint)")
        raise MemoryPlanError(
            f"GLM-5.3-Flash does not fit {self.layout}: weights {_gib(self.weight_bytes)} per rank "
            f"(routed experts in {self.experts}: {_gib(self.weights['routed_experts'])} of it) + "
            f"reserve {_gib(self.reserve_bytes)} + minimal cache "
            f"{_gib(self.required_bytes - self.weight_bytes - self.reserve_bytes)} "
            f"({self.num_slots + 1 + self.num_checkpoints} state slots, {self.min_blocks} "
            f"blocks) = "
            f"{_gib(self.required_bytes)}, but the device gives {_gib(self.device_bytes)} x "
            f"{self.utilization:.3g} = {_gib(self.budget_bytes)}: {_gib(short)} short. "
            f"Ways out: {'; '.join(ways)}.")


def _gib(n: int, width: int = 0) -> str:
    return f"{n / GiB:{width}.2f} GiB"


def _experts(model: Glm5NextForCausalLM) -> str:
    cfg = model.config
    if cfg.expert_format == "exl3":
        return f"EXL3 {cfg.exl3_bits}-bit"
    if cfg.expert_format == "int4":
        return "int4 (quantised at load)"
    dtype = next((p.dtype for n, p in model.named_parameters() if ".experts." in n), None)
    name = str(dtype).removeprefix("torch.")
    return f"{name} (dequantised from FP8 at load)" if cfg.fp8_block_size else name


def plan_memory(model: Glm5NextForCausalLM, device_bytes: int, utilization: float, *,
                block_size: int, num_slots: int, cache_dtype: torch.dtype | None = None,
                num_spec: int = 0, max_model_len: int | None = None,
                max_num_batched_tokens: int = 2048, reserve_bytes: int | None = None,
                kv_cache_dtype: str = "auto",
                draft: DFlashConfig | None = None, num_checkpoints: int = 0,
                draft_kv_cache_dtype: str = "auto",
                graph_max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS) -> MemoryPlan:
    """Plan this rank (`model`: its meta-built shard; whether it has the MTP layer is read off
    it, so the cache plan cannot disagree with the weights). `block_size`: the runner's logical
    tokens per block; `num_slots`: max_num_seqs; `cache_dtype` defaults to the model's (the
    latent rows follow `kv_cache_dtype`, caches.KV_CACHE_DTYPES);
    `max_model_len` to the model's context. `reserve_bytes` replaces the reserve estimate
    (all of it counted as allocated after the caches). `draft`: a DFlash draft's config; its
    weights and per-slot ring (this rank's shard, in `cache_dtype`, as the runner loads it; the
    ring stored as `draft_kv_cache_dtype` says, its fp8 scales included) join the plan.
    `num_checkpoints`: the prefix cache's KDA state checkpoints (EngineConfig
    .num_prefix_checkpoints), each a state slot and, with a draft, a ring. `graph_max_tokens`:
    the runner's cap on a CUDA graph's rows (EngineConfig.cuda_graph_max_tokens)."""
    cfg, ps = model.config, model.parallel
    cache_dtype = cache_dtype or model.embed_tokens.weight.dtype
    max_model_len = max_model_len or cfg.max_position_embeddings
    per_block, per_slot = cache_bytes(cfg, block_size, cache_dtype, model.mtp is not None, ps,
                                      num_spec, kv_cache_dtype)
    draft_workspace = 0
    if reserve_bytes is None:
        overhead, workspace = OVERHEAD_BYTES, workspace_estimate(
            cfg, max_num_batched_tokens=max_num_batched_tokens, num_slots=num_slots,
            num_spec=num_spec, max_model_len=max_model_len,
            dtype=model.embed_tokens.weight.dtype,
            n_taps=len(draft.target_layer_ids) if draft is not None else 0,
            tp_size=ps.tp_size, graph_max_tokens=graph_max_tokens)
        if draft is not None:
            draft_workspace = min(num_slots, DRAFT_CHUNK) * forward_bytes_per_sequence(
                draft, cache_dtype, ps.tp_size, draft_kv_cache_dtype)
    else:
        overhead, workspace = 0, reserve_bytes
    par = ps.config
    return MemoryPlan(
        layout=f"TP{par.tp}/EP{par.ep}/DCP{par.dcp} rank {ps.rank}",
        expert_format=cfg.expert_format, experts=_experts(model),
        device_bytes=device_bytes, utilization=utilization, weights=weight_bytes(model),
        overhead_bytes=overhead, workspace_bytes=workspace, block_size=block_size,
        bytes_per_block=per_block, bytes_per_slot=per_slot, num_slots=num_slots,
        min_blocks=1 + -(-max_num_batched_tokens // block_size), max_model_len=max_model_len,
        draft_weight_bytes=draft_weight_bytes(draft, cache_dtype, ps) if draft else 0,
        draft_bytes_per_slot=ring_bytes_per_sequence(draft, cache_dtype, ps.tp_size,
                                                     draft_kv_cache_dtype) if draft else 0,
        draft_kv_cache_dtype=draft_kv_cache_dtype,
        draft_workspace_bytes=draft_workspace, num_checkpoints=num_checkpoints)


def meta_shard(config: dict, *, tp: int = 1, ep: int = 1, dcp: int = 1, rank: int = 0,
               quantize_experts: str | None = None, dtype: str | None = None,
               with_mtp: bool = False) -> Glm5NextForCausalLM:
    """`rank`'s shard of the model of a `config.json` dict, built on the meta device."""
    cfg = with_expert_format(ModelConfig.from_hf(config), quantize_experts)
    parallel = ParallelConfig(tp, ep, dcp)
    if not 0 <= rank < parallel.world_size:
        raise ValueError(f"rank {rank} is not in 0..{parallel.world_size - 1} "
                         f"(world size {parallel.world_size})")
    return build_model(cfg, with_mtp=with_mtp, dtype=DTYPES[dtype] if dtype else None,
                       device="meta", ps=ParallelState(parallel, rank))


def plan_for_config(config: dict, *, device_bytes: int, utilization: float = 0.9, tp: int = 1,
                    ep: int = 1, dcp: int = 1, rank: int = 0,
                    quantize_experts: str | None = None, dtype: str | None = None,
                    with_mtp: bool = False, num_spec: int = 0, block_size: int = 16,
                    max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                    max_model_len: int | None = None,
                    kv_cache_dtype: str = "auto",
                    draft_config: dict | None = None, num_checkpoints: int = 0,
                    draft_kv_cache_dtype: str = "auto") -> MemoryPlan:
    """The plan of `rank` for a `config.json` dict under engine settings (the core of
    `glm53 plan-memory`; names as in EngineConfig, `block_size` per DCP rank like
    `--block-size`). `draft_config`: a DFlash draft's `config.json` dict (its ring stored as
    `draft_kv_cache_dtype`); `num_checkpoints`:
    the prefix cache's KDA checkpoints (EngineConfig.num_prefix_checkpoints). Builds the shard on
    the meta device: no memory is used."""
    model = meta_shard(config, tp=tp, ep=ep, dcp=dcp, rank=rank,
                       quantize_experts=quantize_experts, dtype=dtype, with_mtp=with_mtp)
    # the runner's block spans the DCP ranks' rows (raycluster/executor.runner_kwargs)
    return plan_memory(model, device_bytes, utilization, block_size=block_size * dcp,
                       num_slots=max_num_seqs, num_spec=num_spec, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens,
                       kv_cache_dtype=kv_cache_dtype, num_checkpoints=num_checkpoints,
                       draft=DFlashConfig.from_hf(draft_config) if draft_config else None,
                       draft_kv_cache_dtype=draft_kv_cache_dtype)


def sequences_held(model: Glm5NextForCausalLM, device_bytes: int, utilization: float, *,
                   context_len: int, block_size: int, max_seqs: int = 1 << 14,
                   **plan_kw) -> tuple[int, MemoryPlan | None]:
    """How many sequences of `context_len` tokens this rank holds at once, all running: the
    largest n whose plan with n state slots (and, with a draft, n DFlash rings; the graph
    workspace of n sequences) still has n x ceil(context_len / block_size) blocks besides the
    null block, and passes `check`. Returns (n, that plan), or (0, None) when not even one
    fits. `plan_kw`: plan_memory's other arguments (num_spec, draft, reserve_bytes, ...)."""
    blocks_per_seq = -(-context_len // block_size)

    def plan(n: int) -> MemoryPlan | None:
        p = plan_memory(model, device_bytes, utilization, block_size=block_size, num_slots=n,
                        max_model_len=context_len, **plan_kw)
        fits = p.required_bytes <= p.budget_bytes and p.num_blocks - 1 >= n * blocks_per_seq
        return p if fits else None

    lo, hi = 0, max_seqs  # plan(lo) fits (or lo == 0); find the largest n that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(mid) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo, plan(lo) if lo else None
