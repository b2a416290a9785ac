"""Per-layer inference state of GLM-5.3-Flash, allocated once per worker.

KDA layers keep fixed-size state per sequence in *state slots* (recurrent state + short-conv
window). DSA layers (and the MTP layer) keep per-token state in *paged blocks* (MLA latent rows
and pooled indexer keys, one pooled key per `index_kpool` tokens) plus the raw indexer rows of
the open pool in the sequence's state slot.

All sizes here are this rank's: KDA heads / tp, and under DCP a block of `block_size` logical
tokens keeps block_size / dcp latent rows per rank (pooled keys stay replicated).

The latent rows follow `kv_cache_dtype` (KV_CACHE_DTYPES): "auto" keeps the model dtype,
"bf16" stores bfloat16, "fp8" and "nvfp4" store packed uint8 rows (528 / 304 bytes at
kv_lora_rank 512; kernels/ref/latent_quant.py). nvfp4 rows carry an outer scale per layer
from the calibrated scale bank (kv_scale_bank.py). With fp8 or nvfp4 the pooled indexer keys
are stored as vLLM stores them: Hadamard-rotated fp8 rows (132 bytes at index_head_dim 128);
the open-pool ring stays in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.kernels.ops import row_bytes

from .config import KDA, ModelConfig
from .parallel import ParallelState, split

KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")
MTP_LAYER = "mtp"  # the MTP layer's key in a scale bank (trunk layers: their index)


@dataclass(frozen=True)
class KDAReplay:
    """Where a KDA layer writes what its commit will replay when its step defers (verifies
    drafts): the in_proj output (pre-conv q|k|v, then the beta logits) and the mixer's q, k,
    v, g, beta, one row per token. Only the CUDA graphs pass them (their shared outputs,
    graph_outputs.py), so that a graph keeps nothing of its own after its run; an eager step
    allocates its replay."""

    proj: torch.Tensor  # [R, 3 * heads * d + heads] model dtype
    q: torch.Tensor  # [R, heads, d] model dtype (after the conv)
    k: torch.Tensor  # [R, heads, d] model dtype
    v: torch.Tensor  # [R, heads, d] model dtype
    g: torch.Tensor  # [R, heads, d] fp32
    beta: torch.Tensor  # [R, heads] fp32

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int, dtype: torch.dtype,
                 device: torch.device | str, ps: ParallelState | None = None) -> KDAReplay:
        heads = split(cfg.linear_num_heads, (ps or ParallelState()).tp_size,
                      "linear_num_heads")
        d = cfg.linear_head_dim
        return cls(torch.empty(rows, 3 * heads * d + heads, dtype=dtype, device=device),
                   *(torch.empty(rows, heads, d, dtype=dtype, device=device) for _ in range(3)),
                   torch.empty(rows, heads, d, dtype=torch.float32, device=device),
                   torch.empty(rows, heads, dtype=torch.float32, device=device))

    @staticmethod
    def bytes_per_row(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
        """What `allocate` takes per row: (3 + 3) h d + h in the model dtype, h d + h fp32."""
        heads, d = cfg.linear_num_heads // tp_size, cfg.linear_head_dim
        item = torch.empty(0, dtype=dtype).element_size()
        return (6 * heads * d + heads) * item + (heads * d + heads) * 4

    def rows(self, n: int) -> KDAReplay:
        """The first n rows (views)."""
        return KDAReplay(*(t[:n] for t in vars(self).values()))


@dataclass(frozen=True)
class KDAState:
    conv: torch.Tensor  # [slots, 3 * linear_dim, conv_kernel - 1], pre-conv q|k|v inputs
    recurrent: torch.Tensor  # [slots, heads, dk, dv] fp32
    # where a deferring step writes its replay (CUDA graphs' view of the caches), else None
    replay: KDAReplay | None = None


@dataclass(frozen=True)
class DSAState:
    latent: torch.Tensor  # [blocks, block_size, kv_lora_rank]
    pool_keys: torch.Tensor  # [blocks, block_size // kpool, index_head_dim] (or fp8 rows)
    open_rows: torch.Tensor  # [slots, ring, 2 * index_head_dim] raw key | pooling logit
    latent_format: str = "plain"  # "plain" (values) or packed "fp8" / "nvfp4" rows
    outer_scale: float = 1.0  # nvfp4: this layer's entry of the scale bank
    pool_format: str = "plain"  # "plain" or "fp8" (rotated fp8 rows) pooled indexer keys


def latent_row(cfg: ModelConfig, kv_cache_dtype: str,
               dtype: torch.dtype) -> tuple[str, torch.dtype, int]:
    """(latent format, element dtype, elements per row) of the latent cache under
    `kv_cache_dtype` for a model computing in `dtype`."""
    if kv_cache_dtype == "auto":
        return "plain", dtype, cfg.kv_lora_rank
    if kv_cache_dtype == "bf16":
        return "plain", torch.bfloat16, cfg.kv_lora_rank
    if kv_cache_dtype in ("fp8", "nvfp4"):
        return kv_cache_dtype, torch.uint8, row_bytes(kv_cache_dtype, cfg.kv_lora_rank)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")


def pool_row(cfg: ModelConfig, kv_cache_dtype: str,
             dtype: torch.dtype) -> tuple[str, torch.dtype, int]:
    """(pool key format, element dtype, elements per row) of the pooled indexer keys."""
    if kv_cache_dtype in ("fp8", "nvfp4"):
        d = cfg.index_head_dim
        if d & (d - 1):  # the Hadamard rotation of the keys
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} stores Hadamard-rotated fp8 pool "
                             f"keys, which need a power-of-two index_head_dim, not {d}")
        return "fp8", torch.uint8, row_bytes("fp8", d)
    return "plain", dtype, cfg.index_head_dim


def latent_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    _, elem, width = latent_row(cfg, kv_cache_dtype, dtype)
    return width * torch.empty(0, dtype=elem).element_size()


def _layer_scale(kv_scales: dict[str, float] | None, key: str, kv_cache_dtype: str) -> float:
    if kv_cache_dtype != "nvfp4":
        return 1.0
    if kv_scales is None or key not in kv_scales:
        raise ValueError(f"the nvfp4 KV cache needs an outer scale for layer {key} in the "
                         "scale bank (glm53 calibrate-kv builds one)")
    return kv_scales[key]


def open_ring_size(cfg: ModelConfig, num_spec: int) -> int:
    """Rows of the per-slot indexer ring: the open pool plus the drafts a step may reject."""
    return cfg.index_kpool * -(-(cfg.index_kpool + num_spec) // cfg.index_kpool)


def _dsa_state(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
               dtype: torch.dtype, device: torch.device | str, dcp: int,
               num_spec: int, kv_cache_dtype: str, outer_scale: float) -> DSAState:
    latent_format, latent_dtype, width = latent_row(cfg, kv_cache_dtype, dtype)
    pool_format, pool_dtype, pool_width = pool_row(cfg, kv_cache_dtype, dtype)
    return DSAState(
        # zero rows are valid zero latents in every format
        latent=torch.zeros(num_blocks, block_size // dcp, width, dtype=latent_dtype,
                           device=device),
        pool_keys=torch.zeros(num_blocks, block_size // cfg.index_kpool, pool_width,
                              dtype=pool_dtype, device=device),
        open_rows=torch.zeros(num_slots, open_ring_size(cfg, num_spec), 2 * cfg.index_head_dim,
                              dtype=dtype, device=device),
        latent_format=latent_format, outer_scale=outer_scale, pool_format=pool_format,
    )


@dataclass(frozen=True)
class ModelCaches:
    """State for every trunk layer (index = layer id) and, optionally, the MTP layer."""

    layers: tuple[KDAState | DSAState, ...]
    mtp: DSAState | None
    block_size: int  # logical tokens per block

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        with_mtp: bool = False,
        ps: ParallelState | None = None,
        num_spec: int = 0,
        kv_cache_dtype: str = "auto",
        kv_scales: dict[str, float] | None = None,
    ) -> ModelCaches:
        """`block_size` counts logical tokens per block (a multiple of index_kpool and of the
        DCP size). `kv_scales`: the nvfp4 outer scale per DSA layer (str(layer id), "mtp")."""
        ps = ps or ParallelState()
        _check_block_size(cfg, block_size, ps.dcp_size)
        heads = split(cfg.linear_num_heads, ps.tp_size, "linear_num_heads")
        layers: list[KDAState | DSAState] = []
        for i, kind in enumerate(cfg.layer_types):
            if kind == KDA:
                layers.append(KDAState(
                    conv=torch.zeros(num_slots, 3 * heads * cfg.linear_head_dim,
                                     cfg.linear_conv_kernel - 1, dtype=dtype, device=device),
                    recurrent=torch.zeros(num_slots, heads, cfg.linear_head_dim,
                                          cfg.linear_head_dim, dtype=torch.float32,
                                          device=device),
                ))
            else:
                layers.append(_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device,
                                         ps.dcp_size, num_spec, kv_cache_dtype,
                                         _layer_scale(kv_scales, str(i), kv_cache_dtype)))
        mtp = (_dsa_state(cfg, num_blocks, block_size, num_slots, dtype, device, ps.dcp_size,
                          num_spec, kv_cache_dtype,
                          _layer_scale(kv_scales, MTP_LAYER, kv_cache_dtype))
               if with_mtp else None)
        return cls(layers=tuple(layers), mtp=mtp, block_size=block_size)


def copy_state_slots(caches: ModelCaches, copies) -> None:
    """Copy the KDA state (recurrent state + conv windows) of slot src into slot dst for each
    (src, dst) row of `copies`, in order (a checkpoint is saved before its slot is reused).
    The DSA open-pool rows are not copied: checkpoints sit at block boundaries, which are pool
    boundaries, where the open pool is empty. Every rank copies its own shard."""
    for src, dst in copies.tolist():
        for state in caches.layers:
            if isinstance(state, KDAState):
                state.conv[dst].copy_(state.conv[src])
                state.recurrent[dst].copy_(state.recurrent[src])


def _check_block_size(cfg: ModelConfig, block_size: int, dcp: int) -> None:
    if block_size % cfg.index_kpool or block_size % dcp:
        raise ValueError(f"block_size {block_size} must be a multiple of index_kpool "
                         f"{cfg.index_kpool} and of the DCP size {dcp}")


@dataclass(frozen=True)
class CachePlan:
    """How many paged blocks and state slots a worker allocates, and what they cost."""

    num_blocks: int  # including the null block 0
    block_size: int  # logical tokens per block (latent rows per rank = block_size / dcp)
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    kv_cache_dtype: str = "auto"
    # where the rank's device memory goes (MemoryPlan.describe), when it was planned (CUDA)
    memory_plan: str | None = None
    # prefix-cache checkpoints of the KDA state: slots after the running ones and the graph
    # padding slot (num_slots + 1 + i), paid by the same per-slot price
    num_checkpoints: int = 0
    # a DFlash draft's K/V ring per running slot and per checkpoint
    # (speculative/dflash.ring_bytes_per_sequence), paid out of the same budget as the blocks
    draft_bytes_per_slot: int = 0

    def checkpoint_slot(self, index: int) -> int:
        """State slot id of checkpoint `index` (0 <= index < num_checkpoints)."""
        if not 0 <= index < self.num_checkpoints:
            raise ValueError(f"checkpoint {index} out of range 0..{self.num_checkpoints - 1}")
        return self.num_slots + 1 + index

    def checkpoint_of(self, slot: int) -> int | None:
        """The checkpoint index state slot `slot` holds, or None for a running slot."""
        index = slot - self.num_slots - 1
        return index if 0 <= index < self.num_checkpoints else None

    @property
    def num_tokens(self) -> int:
        """Token capacity of the usable blocks (the null block holds nothing)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def tokens_per_gib(self) -> float:
        """Tokens one GiB of paged cache holds on this rank (latent rows, pooled keys)."""
        return self.block_size * 2**30 / self.bytes_per_block

    @property
    def draft_bytes(self) -> int:
        """The DFlash proposer's rings: one per running slot and one per checkpoint."""
        return (self.num_slots + self.num_checkpoints) * self.draft_bytes_per_slot

    @property
    def total_bytes(self) -> int:
        """What the runner allocates: the blocks, the running slots, the graph padding slot and
        the checkpoints (see checkpoint_slot), and the DFlash rings."""
        return (self.num_blocks * self.bytes_per_block
                + (self.num_slots + 1 + self.num_checkpoints) * self.bytes_per_slot
                + self.draft_bytes)

    def describe(self, max_model_len: int) -> str:
        text = (f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({self.num_tokens // max_model_len} sequences of "
                f"max_model_len {max_model_len}); {self.num_slots} KDA state slots"
                + (f" + {self.num_checkpoints} prefix checkpoints" if self.num_checkpoints
                   else "")
                + (f" + {self.num_slots + self.num_checkpoints} DFlash rings of "
                   f"{self.draft_bytes_per_slot / 2**20:.2f} MiB" if self.draft_bytes_per_slot
                   else "")
                + f"; {self.total_bytes / 2**20:.1f} MiB; kv_cache_dtype "
                f"{self.kv_cache_dtype}: {self.tokens_per_gib:,.0f} tokens per GiB")
        return f"{text}\n{self.memory_plan}" if self.memory_plan else text


def cache_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, with_mtp: bool,
                ps: ParallelState | None = None, num_spec: int = 0,
                kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(bytes per paged block, bytes per state slot) over all layers, on one rank."""
    ps = ps or ParallelState()
    item = torch.empty(0, dtype=dtype).element_size()
    n_dsa = len(cfg.dsa_layers) + int(with_mtp)
    latent = latent_bytes_per_token(cfg, kv_cache_dtype, dtype)
    _, pool_dtype, pool_width = pool_row(cfg, kv_cache_dtype, dtype)
    pool = pool_width * torch.empty(0, dtype=pool_dtype).element_size()
    per_block = n_dsa * (block_size // ps.dcp_size * latent + block_size // cfg.index_kpool * pool)
    heads = cfg.linear_num_heads // ps.tp_size
    kda_slot = (3 * heads * cfg.linear_head_dim * (cfg.linear_conv_kernel - 1) * item
                + heads * cfg.linear_head_dim**2 * 4)
    open_pool = open_ring_size(cfg, num_spec) * 2 * cfg.index_head_dim * item
    per_slot = len(cfg.kda_layers) * kda_slot + n_dsa * open_pool
    return per_block, per_slot


def plan_cache(cfg: ModelConfig, block_size: int, num_slots: int, dtype: torch.dtype,
               with_mtp: bool, *, num_blocks: int | None = None,
               budget_bytes: int | None = None, ps: ParallelState | None = None,
               num_spec: int = 0, kv_cache_dtype: str = "auto") -> CachePlan:
    """Size one rank's caches from an explicit block count or a byte budget (slots are paid
    first). `block_size` counts logical tokens per block."""
    ps = ps or ParallelState()
    _check_block_size(cfg, block_size, ps.dcp_size)
    per_block, per_slot = cache_bytes(cfg, block_size, dtype, with_mtp, ps, num_spec,
                                      kv_cache_dtype)
    if (num_blocks is None) == (budget_bytes is None):
        raise ValueError("give exactly one of num_blocks or budget_bytes")
    if num_blocks is None:
        num_blocks = (budget_bytes - num_slots * per_slot) // per_block
    if num_blocks < 2:
        raise ValueError(f"cache budget too small: {num_blocks} blocks (need >= 2: one is the "
                         f"null block); a block costs {per_block} B, a state slot {per_slot} B")
    return CachePlan(num_blocks, block_size, num_slots, per_block, per_slot, kv_cache_dtype)
