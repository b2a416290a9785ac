"""Checkpoint <-> parameter mapping and safetensors loading for GLM-5.3-Flash.

Checkpoint names are the release's (`model.language_model.layers.N...`, `lm_head.weight`,
per-expert `mlp.experts.E.{gate,up,down}_proj.weight`, separate `q/k/v_conv1d` and KDA
`q/k/v_proj`, MTP layer at index num_hidden_layers). Our parameters stack what the kernels want
stacked (experts, convs, and the projections of one input in `FUSED`: one GEMM);
`checkpoint_targets` maps one checkpoint name to (parameter, index into it) and
`export_checkpoint` is its inverse (used by `make-tiny`). Block-FP8 tensors (e4m3 weight +
`weight_scale_inv` per block) are dequantised on load. EXL3 routed experts come as
`.trellis/.suh/.svh` per projection plus a codebook marker (`.mcg` or `.mul1`), checked by
`check_exl3_markers`. Loading reads tensor by tensor through `CheckpointReader`, each rank only
its slices (block-FP8 weights with the scale blocks that cover them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .config import ModelConfig

PREFIX = "model.language_model."
SCALE_SUFFIX = ".weight_scale_inv"
_VISION_PREFIX = "model.visual."
VISUAL = "visual."  # our vision tower's parameter prefix
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)$")
_CONV = re.compile(r"self_attn\.([qkv])_conv1d\.weight$")
# Parameters stacking several checkpoint projections of one input, so that decode runs one GEMM
# (one launch) where the checkpoint has several: parameter (relative to its layer) -> the
# checkpoint tensors it holds, in order along dim 0 (the layer records each part's local rows
# as the parameter's `part_sizes`)
FUSED = {
    # KDA: q|k|v (the conv's channel order) and the beta logits; the low-rank gate inputs
    "self_attn.in_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                 "self_attn.v_proj.weight", "self_attn.b_proj.weight"),
    "self_attn.fg_a_proj.weight": ("self_attn.f_a_proj.weight", "self_attn.g_a_proj.weight"),
    # DSA: everything computed from the block input but the fp32 indexer head weights
    "self_attn.x_proj.weight": ("self_attn.q_a_proj.weight",
                                "self_attn.kv_a_proj_with_mqa.weight",
                                "self_attn.indexer.wk.weight",
                                "self_attn.indexer.index_kpool_compress_gate"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared_experts.gate_up_proj.weight": ("mlp.shared_experts.gate_proj.weight",
                                               "mlp.shared_experts.up_proj.weight"),
}
_FUSED_PART = {name: (param, i) for param, names in FUSED.items() for i, name in enumerate(names)}
_EXPERT = re.compile(
    r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|trellis|suh|svh|mcg|mul1)$")
# EXL3 codebook markers: 0-dim int32 tensors whose presence selects the codebook
EXL3_MARKERS = {"mcg": (1, -877_912_083), "mul1": (2, -2_082_680_531)}


class CheckpointError(ValueError):
    """The checkpoint does not match the model: names the offending tensor(s)."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter `param`, into its `part` (index of q|k|v
    in the stacked conv or projection, of gate|up in w13) and `expert` row, if any."""

    param: str
    part: int | None = None
    expert: int | None = None


def _layer_local(rest: str, cfg: ModelConfig) -> Target | None:
    """Map a name relative to one decoder layer to a Target with a layer-relative param (None
    for EXL3 codebook markers, which `check_exl3_markers` reads)."""
    if m := _HC.fullmatch(rest):
        return Target(f"{m.group(1)}_hc.{m.group(2)}")
    if m := _CONV.fullmatch(rest):
        return Target("self_attn.conv_weight", part="qkv".index(m.group(1)))
    if rest in _FUSED_PART:
        param, part = _FUSED_PART[rest]
        return Target(param, part=part)
    if m := _EXPERT.fullmatch(rest):
        e, kind, leaf = int(m.group(1)), m.group(2), m.group(3)
        if e >= cfg.n_routed_experts:
            raise CheckpointError(f"expert index {e} >= n_routed_experts={cfg.n_routed_experts}")
        if leaf in EXL3_MARKERS:
            return None
        param = "mlp.experts." + ("w2" if kind == "down" else "w13")
        if leaf != "weight":
            param += "_" + leaf
        return Target(param, part=None if kind == "down" else "gu".index(kind[0]), expert=e)
    if rest == "shared_head.norm.weight":
        return Target("shared_head_norm.weight")
    return Target(rest)


def checkpoint_targets(name: str, cfg: ModelConfig, with_mtp: bool,
                       with_vision: bool = False) -> Target | None:
    """Where a checkpoint tensor goes; None for tensors recognised and deliberately skipped
    (vision tower when language-only, MTP layer when unused)."""
    if name == "lm_head.weight":
        return Target("lm_head.weight")
    if name.startswith(_VISION_PREFIX):  # module names as in the checkpoint, under `visual.`
        return Target(VISUAL + name[len(_VISION_PREFIX):]) if with_vision else None
    if not name.startswith(PREFIX):
        raise CheckpointError(f"unexpected tensor {name!r} (not under {PREFIX!r})")
    rel = name[len(PREFIX):]
    m = re.match(r"layers\.(\d+)\.(.+)$", rel)
    if not m:
        return Target(rel)
    layer, rest = int(m.group(1)), m.group(2)
    if layer == cfg.mtp_layer_id and cfg.has_mtp:
        if not with_mtp:
            return None
        prefix = "mtp."
    elif layer >= cfg.num_hidden_layers:
        raise CheckpointError(f"unexpected tensor {name!r}: layer {layer} is not in the model")
    else:
        prefix = f"layers.{layer}."
    try:
        target = _layer_local(rest, cfg)
    except CheckpointError as exc:
        raise CheckpointError(f"unexpected tensor {name!r}: {exc}") from None
    if target is None:
        return None
    return Target(prefix + target.param, target.part, target.expert)


def _checkpoint_names(pname: str, param: torch.Tensor, cfg: ModelConfig) -> list[str]:
    """Checkpoint tensors that fill parameter `pname` on this rank (local experts only)."""
    if pname == "lm_head.weight":
        return [pname]
    if pname.startswith(VISUAL):
        return [_VISION_PREFIX + pname[len(VISUAL):]]
    if pname.startswith("mtp."):
        base, rel = f"{PREFIX}layers.{cfg.mtp_layer_id}.", pname[len("mtp."):]
    elif m := re.match(r"layers\.(\d+)\.(.+)$", pname):
        base, rel = f"{PREFIX}layers.{m.group(1)}.", m.group(2)
    else:
        return [PREFIX + pname]
    if m := re.fullmatch(r"(attn|ffn)_hc\.(fn|base|scale)", rel):
        return [f"{base}hc_{m.group(1)}_{m.group(2)}"]
    if rel == "self_attn.conv_weight":
        return [f"{base}self_attn.{c}_conv1d.weight" for c in "qkv"]
    if rel in FUSED:
        return [base + name for name in FUSED[rel]]
    if m := re.fullmatch(r"mlp\.experts\.(w13|w2)(?:_(\w+))?", rel):
        experts = range(param.expert_offset, param.expert_offset + param.shape[0])
        kinds = ("down",) if m.group(1) == "w2" else ("gate", "up")
        # int4 codes, scales and zeros are all quantised from the dense weight
        leaf = m.group(2) if m.group(2) in ("trellis", "suh", "svh") else "weight"
        return [f"{base}mlp.experts.{e}.{k}_proj.{leaf}" for e in experts for k in kinds]
    if rel == "shared_head_norm.weight":
        return [f"{base}shared_head.norm.weight"]
    return [base + rel]


def export_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded model's parameters -> checkpoint-layout tensors (used by `make-tiny`)."""
    if model.parallel.world_size != 1:
        raise ValueError("export needs the unsharded (world size 1) model")
    cfg: ModelConfig = model.config
    out: dict[str, torch.Tensor] = {}
    if cfg.expert_format == "int4":
        raise ValueError("int4 experts are quantised at load time and have no checkpoint form")
    for pname, p in model.named_parameters():
        names = _checkpoint_names(pname, p, cfg)
        t = p.detach()
        if pname.endswith("conv_weight"):
            parts = [c.unsqueeze(1) for c in t.chunk(3, dim=0)]
        elif hasattr(p, "part_sizes"):
            parts = list(t.split(p.part_sizes, dim=0))
        elif ".mlp.experts.w13" in pname:  # gate | up halves of every expert
            parts = [half for e in range(t.shape[0]) for half in t[e].chunk(2, dim=p.part_dim)]
        elif ".mlp.experts.w2" in pname:
            parts = list(t.unbind(0))
        else:
            parts = [t]
        out.update(zip(names, parts, strict=True))
        if cfg.expert_format == "exl3" and pname.endswith("_trellis"):
            for marker, (codebook, value) in EXL3_MARKERS.items():
                if cfg.exl3_codebook == codebook:
                    out.update({n.replace(".trellis", "." + marker):
                                torch.tensor(value, dtype=torch.int32) for n in names})
    return {k: v.contiguous() for k, v in out.items()}


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block_size: tuple[int, int] | None = None,
                          offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Block-FP8 -> fp32: w[r, c] * scale_inv[(r + offset_r) // br, (c + offset_c) // bc].

    weight: [R, C] e4m3, a slice starting at `offset` of the checkpoint tensor; scale_inv: the
    scale blocks that cover it, starting with the block holding `offset`. Without `block_size`
    the block is inferred from the shapes (only for an unsliced tensor), which is only exact
    when every dim divides evenly (e.g. 64 columns in 48-wide blocks give 2 scale columns,
    which read back as 32-wide).
    """
    rows, cols = weight.shape
    if block_size is not None:
        br, bc = block_size
    else:
        br = -(-rows // scale_inv.shape[0])
        bc = -(-cols // scale_inv.shape[1])
    r0, c0 = offset[0] % br, offset[1] % bc
    scale = scale_inv.float().repeat_interleave(br, 0)[r0:r0 + rows]
    scale = scale.repeat_interleave(bc, 1)[:, c0:c0 + cols]
    return weight.float() * scale


class CheckpointReader:
    """Tensor-by-tensor access to a safetensors checkpoint (single file or index.json shards)."""

    def __init__(self, model_dir: str | Path, fp8_block_size: tuple[int, int] | None = None):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                with safe_open(f, framework="pt") as st:
                    weight_map.update(dict.fromkeys(st.keys(), f.name))
        self.files = weight_map
        self.fp8_block_size = fp8_block_size
        scales = {n[: -len(SCALE_SUFFIX)] + ".weight" for n in weight_map if
                  n.endswith(SCALE_SUFFIX)}
        orphan = sorted(s[: -len(".weight")] + SCALE_SUFFIX for s in scales
                        if s not in weight_map)
        if orphan:
            raise CheckpointError(f"unexpected tensor {orphan[0]!r}: block scale without its "
                                  "weight")
        self._scaled = scales
        self._handles: dict[str, object] = {}

    @property
    def names(self) -> list[str]:
        """Logical tensor names (fp8 scale tensors are folded into their weights)."""
        return sorted(n for n in self.files if not n.endswith(SCALE_SUFFIX))

    def _file(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def load(self, name: str, shard_dim: int | None = None, rank: int = 0,
             size: int = 1) -> torch.Tensor:
        """The tensor (fp8 dequantised to fp32), or part `rank` of `size` equal contiguous
        parts along `shard_dim`. A part reads only its slice of the file, block-FP8 included
        (its weight rows/columns and the scale blocks covering them)."""
        handle = self._file(name)
        raw = handle.get_slice(name)
        index: tuple = ()
        lo = 0
        if shard_dim is not None and size > 1:
            part = raw.get_shape()[shard_dim] // size
            lo = rank * part
            index = (slice(None),) * shard_dim + (slice(lo, lo + part),)
        if raw.get_dtype() not in ("F8_E4M3", "F8_E5M2"):
            return raw[index] if index else handle.get_tensor(name)
        if name not in self._scaled:
            raise CheckpointError(f"fp8 tensor {name!r} has no {SCALE_SUFFIX[1:]}")
        scale_name = name[: -len(".weight")] + SCALE_SUFFIX
        scale_raw = self._file(scale_name).get_slice(scale_name)
        full_shape = tuple(raw.get_shape())
        block = self.fp8_block_size
        if block is not None:
            want = tuple(-(-n // b) for n, b in zip(full_shape, block, strict=True))
            if tuple(scale_raw.get_shape()) != want:
                raise CheckpointError(f"{scale_name}: scale shape {tuple(scale_raw.get_shape())}, "
                                      f"expected {want}")
        if not index:
            return dequantize_fp8_blocks(handle.get_tensor(name),
                                         self._file(scale_name).get_tensor(scale_name), block)
        if block is None:
            block = tuple(-(-n // s) for n, s in zip(full_shape, scale_raw.get_shape(),
                                                     strict=True))
        weight = raw[index]
        b = block[shard_dim]
        first, last = lo // b, -(-(lo + weight.shape[shard_dim]) // b)
        scale = scale_raw[(slice(None),) * shard_dim + (slice(first, last),)]
        offset = (lo, 0) if shard_dim == 0 else (0, lo)
        return dequantize_fp8_blocks(weight, scale, block, offset)


def _destination(param: torch.Tensor, target: Target) -> tuple[torch.Tensor, tuple] | None:
    """(view of the local parameter to fill, full checkpoint shape expected for the tensor),
    or None for an expert that lives on another rank."""
    dest = param.data
    if target.expert is not None:
        local = target.expert - param.expert_offset
        if not 0 <= local < dest.shape[0]:
            return None
        dest = dest[local]
    shape = list(dest.shape)
    if target.part is not None and hasattr(param, "part_sizes"):  # a FUSED projection
        sizes = param.part_sizes
        dest = dest.narrow(0, sum(sizes[:target.part]), sizes[target.part])
        shape[0] = sizes[target.part]
    elif target.part is not None:
        n_parts = 3 if target.expert is None else 2  # q|k|v conv taps, gate|up
        dim = getattr(param, "part_dim", 0)
        size = dest.shape[dim] // n_parts
        dest = dest.narrow(dim, target.part * size, size)
        shape[dim] = size
        if target.param.endswith("conv_weight"):
            shape.insert(1, 1)  # conv taps are stored [C, 1, K]
    if getattr(param, "shard_size", 1) > 1:
        shape[param.shard_dim] *= param.shard_size
    return dest, tuple(shape)


def check_exl3_markers(reader: CheckpointReader, cfg: ModelConfig) -> None:
    """Every EXL3 projection carries exactly the codebook marker the config names (§B.2: the
    marker's presence selects the codebook) with its documented value."""
    modules = {n[: -len(".trellis")] for n in reader.names if n.endswith(".trellis")}
    for module in sorted(modules):
        for marker, (codebook, value) in EXL3_MARKERS.items():
            name = f"{module}.{marker}"
            present = name in reader.files
            if present != (cfg.exl3_codebook == codebook):
                state = "has" if present else "lacks"
                raise CheckpointError(f"{module} {state} the {marker} marker, but the config's "
                                      f"codebook is {cfg.exl3_codebook} (0 3inst, 1 mcg, 2 mul1)")
            if present and (found := int(reader.load(name))) != value:
                raise CheckpointError(f"{name} = {found}, expected {value}")


def _dense_expert_loader(modules: dict[str, torch.nn.Module], target: Target):
    """The experts module that quantises `target` (a dense expert weight) while loading, if
    the model holds that layer's experts in a quantised form made at load time."""
    if target.expert is None or not target.param.endswith((".w13", ".w2")):
        return None  # only dense expert weights are quantised at load
    module = modules.get(target.param.rsplit(".", 1)[0])
    return module if hasattr(module, "load_dense") else None


def load_weights(model: torch.nn.Module, model_dir: str | Path, progress: bool = True) -> None:
    """Fill every parameter of `model` (this rank's shard) from the checkpoint in `model_dir`,
    strictly: a missing tensor, an unexpected tensor or a wrong shape raises CheckpointError
    naming it. Sharded parameters read only their slice; other ranks' experts are not read.
    Experts held as int4 are quantised tensor by tensor on the parameters' device."""
    cfg: ModelConfig = model.config
    with_mtp = getattr(model, "mtp", None) is not None
    with_vision = getattr(model, "visual", None) is not None
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    needed = {n for pname, p in params.items() for n in _checkpoint_names(pname, p, cfg)}
    reader = CheckpointReader(model_dir, cfg.fp8_block_size)
    names = reader.names
    targets = {n: checkpoint_targets(n, cfg, with_mtp, with_vision) for n in names}
    missing = sorted(needed - set(names))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {model_dir}")
    unexpected = sorted(n for n, t in targets.items() if t is not None and t.param not in params
                        and _dense_expert_loader(modules, t) is None)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {model_dir}")
    if cfg.expert_format == "exl3":
        check_exl3_markers(reader, cfg)
    todo = [n for n in names if targets[n] is not None]
    with torch.no_grad():
        for name in tqdm(todo, desc="loading weights", unit="tensor", disable=not progress):
            target = targets[name]
            if target.param not in params:
                _load_quantised_expert(reader, name, target, _dense_expert_loader(modules, target),
                                       cfg)
                continue
            param = params[target.param]
            placed = _destination(param, target)
            if placed is None:
                continue
            dest, want = placed
            if reader.shape(name) != want:
                raise CheckpointError(f"tensor {name!r} has shape {reader.shape(name)}, "
                                      f"expected {want}")
            tensor = reader.load(name, getattr(param, "shard_dim", None),
                                 getattr(param, "shard_rank", 0), getattr(param, "shard_size", 1))
            dest.copy_(tensor.reshape(dest.shape).to(param.dtype))


def _load_quantised_expert(reader: CheckpointReader, name: str, target: Target, experts,
                           cfg: ModelConfig) -> None:
    """Read this rank's slice of one dense expert weight and hand it to `experts.load_dense`."""
    local = target.expert - experts.expert_offset
    if not 0 <= local < experts.n_local:
        return
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    kind = "down" if target.part is None else ("gate", "up")[target.part]
    want, shard_dim = ((d, i), 1) if kind == "down" else ((i, d), 0)
    if reader.shape(name) != want:
        raise CheckpointError(f"tensor {name!r} has shape {reader.shape(name)}, expected {want}")
    experts.load_dense(kind, local, reader.load(name, shard_dim, experts.tp_rank, experts.tp))
