"""EngineConfig: what an engine serves and within which limits (frozen; validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass

from glm53.actors.caches import KV_CACHE_DTYPES
from glm53.actors.cuda_graphs import DEFAULT_MAX_GRAPH_TOKENS
from glm53.actors.speculative.dflash import DRAFT_KV_CACHE_DTYPES


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory
    dtype: str | None = None  # default: the checkpoint's
    device: str = "cpu"
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 16  # running requests (= KDA state slots)
    max_model_len: int | None = None  # default: min(model context, cache capacity)
    block_size: int = 16  # tokens per paged block; a multiple of index_kpool
    num_blocks: int | None = None  # explicit cache size ...
    cache_bytes: int | None = None  # ... or a byte budget (CPU); neither: gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    quantize_experts: str | None = None  # "int4": quantise a dense/FP8 checkpoint's experts
    # latent cache rows: "auto" (model dtype), "bf16", "fp8" (528 B), "nvfp4" (304 B, outer
    # scales from the scale bank: kv_scale_bank, default the checkpoint's kv_scales_nvfp4.json)
    kv_cache_dtype: str = "auto"
    kv_scale_bank: str | None = None
    with_mtp: bool = False
    vision: bool = False  # build the vision tower and accept images
    # image pixels one step may carry to the workers (under the step channel's 32 MiB); an
    # image larger than this is refused
    max_step_image_bytes: int = 24 << 20
    seed: int = 0  # seeds requests that bring none
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    max_waiting_requests: int | None = None  # bound of the waiting queue (None = unbounded)
    speculative_method: str | None = None  # "mtp" (the MTP layer) or "dflash" (draft_model)
    num_speculative_tokens: int = 0  # drafts verified per step and request
    draft_model: str | None = None  # DFlash2 draft checkpoint directory
    # its K/V ring: "auto" (the draft's dtype) or "fp8" (e4m3 rows + one fp32 scale per head
    # and position: 132 B per 128 values, about half of bf16; speculative/dflash.py)
    draft_kv_cache_dtype: str = "auto"
    draft_sampling: str = "greedy"  # MTP drafts: "greedy" or "probabilistic" (sampled, p/q)
    # each step verifies 0..num_speculative_tokens drafts, chosen for tokens/s (draft_policy.py)
    adaptive_drafts: bool = False
    # its step times: a `glm53 bench latency --json` record; None = the documented default
    draft_cost_table: str | None = None
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # overlapped scheduling: step N+1 is scheduled and sent while step N runs (engine.py); off
    # until measured on a GPU
    async_scheduling: bool = False
    # decode batch sizes with a CUDA graph (capped at max_num_seqs, which is always one);
    # None = actors/cuda_graphs.py DEFAULT_BATCH_SIZES
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # contexts (tokens) whose block-table widths get CUDA graphs of their own, besides
    # max_model_len's; None = actors/cuda_graphs.py DEFAULT_CONTEXT_SIZES
    cuda_graph_context_sizes: tuple[int, ...] | None = None
    # rows (sequences x tokens each) of the largest CUDA graph: wider uniform steps run eagerly
    cuda_graph_max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS
    # prefix caching (raycluster/prefix_cache.py): cached blocks + KDA state checkpoints, each
    # checkpoint one more state slot per rank (and DFlash ring; None: max_num_seqs of them),
    # taken every prefix_checkpoint_interval tokens of a prefill (a multiple of the block) and
    # at the end of each prompt and turn. None: on unless the other settings cannot have it
    # (`prefix_caching`; the engine logs why); True where they cannot is refused. A prefill
    # chunk ends at each checkpoint position, so the default interval is the default step
    # budget: a cold prompt takes the steps it takes without the cache (at 512 an 8K prompt
    # took 16 steps, not 4), while chat turns resume from their own prompt-end checkpoints
    enable_prefix_caching: bool | None = None
    prefix_checkpoints: int | None = None
    prefix_checkpoint_interval: int = 2048

    def __post_init__(self) -> None:
        checks = [
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_step_image_bytes >= 1, "max_step_image_bytes must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.num_blocks is None or self.num_blocks >= 2, "num_blocks must be >= 2"),
            (self.cache_bytes is None or self.cache_bytes > 0, "cache_bytes must be > 0"),
            (self.num_blocks is None or self.cache_bytes is None,
             "give num_blocks or cache_bytes, not both"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.quantize_experts in (None, "int4"), "quantize_experts must be None or int4"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.kv_scale_bank is None or self.kv_cache_dtype == "nvfp4",
             "kv_scale_bank holds nvfp4 outer scales: it needs kv_cache_dtype nvfp4"),
            (self.dtype in (None, "float32", "bfloat16", "float16"),
             "dtype must be float32, bfloat16 or float16"),
            (min(self.tensor_parallel_size, self.expert_parallel_size,
                 self.decode_context_parallel_size) >= 1, "parallel sizes must be >= 1"),
            (self.max_waiting_requests is None or self.max_waiting_requests >= 1,
             "max_waiting_requests must be >= 1"),
            (self.speculative_method in (None, "mtp", "dflash"),
             f"unknown speculative method {self.speculative_method!r} (mtp or dflash)"),
            ((self.speculative_method == "dflash") == (self.draft_model is not None),
             "speculative method dflash needs draft_model (and only it uses one)"),
            ((self.speculative_method is None) == (self.num_speculative_tokens == 0),
             "a speculative method needs num_speculative_tokens >= 1, and vice versa"),
            (0 <= self.num_speculative_tokens <= 8, "num_speculative_tokens must be in 0..8"),
            (not self.adaptive_drafts or self.speculative_method is not None,
             "adaptive draft length needs a speculative method"),
            (self.draft_cost_table is None or self.adaptive_drafts,
             "draft_cost_table is for adaptive draft length"),
            (self.draft_kv_cache_dtype in DRAFT_KV_CACHE_DTYPES,
             f"draft_kv_cache_dtype must be one of {', '.join(DRAFT_KV_CACHE_DTYPES)}"),
            (self.draft_kv_cache_dtype == "auto" or self.speculative_method == "dflash",
             "draft_kv_cache_dtype is the DFlash draft's ring: it needs speculative method "
             "dflash"),
            (self.draft_sampling in ("greedy", "probabilistic"),
             "draft_sampling must be greedy or probabilistic"),
            (self.cuda_graph_batch_sizes is None or (
                len(self.cuda_graph_batch_sizes) > 0
                and all(s >= 1 for s in self.cuda_graph_batch_sizes)),
             "cuda_graph_batch_sizes must be non-empty and >= 1"),
            (self.cuda_graph_context_sizes is None
             or all(s >= 1 for s in self.cuda_graph_context_sizes),
             "cuda_graph_context_sizes must be >= 1 token"),
            (self.cuda_graph_max_tokens >= 1, "cuda_graph_max_tokens must be >= 1"),
            (self.prefix_checkpoints is None or self.prefix_checkpoints >= 1,
             "prefix_checkpoints must be >= 1"),
            (not self.enable_prefix_caching or self.prefix_caching_refusal is None,
             f"enable_prefix_caching: {self.prefix_caching_refusal}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def prefix_caching_refusal(self) -> str | None:
        """Why these settings cannot cache prefixes (None: they can). The one rule so far:
        checkpoints inside a prefill sit at block boundaries."""
        block = self.block_size * self.decode_context_parallel_size  # the engine's block
        interval = self.prefix_checkpoint_interval
        if interval < 1 or interval % block:
            return (f"prefix_checkpoint_interval {interval} must be a positive multiple of the "
                    f"block ({block} tokens: block_size {self.block_size} x "
                    f"decode_context_parallel_size {self.decode_context_parallel_size})")
        return None

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine caches prefixes: as asked, else (the default) wherever the other
        settings allow it."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        return self.prefix_caching_refusal is None

    @property
    def num_prefix_checkpoints(self) -> int:
        """State slots each rank allocates for prefix-cache checkpoints."""
        if not self.prefix_caching:
            return 0
        return self.prefix_checkpoints or self.max_num_seqs

    @property
    def world_size(self) -> int:
        """GPUs of one engine: EP and DCP ranks live inside the TP group (same GPUs)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size,
                   self.decode_context_parallel_size)
