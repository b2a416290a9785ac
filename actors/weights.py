"""Checkpoint <-> parameter mapping and safetensors loading for GLM-5.3-Flash.

Checkpoint names are the release's (`model.language_model.layers.N...`, `lm_head.weight`,
per-expert `mlp.experts.E.{gate,up,down}_proj.weight`, separate `q/k/v_conv1d` and KDA
`q/k/v_proj`, MTP layer at index num_hidden_layers). Our parameters stack what the kernels want
stacked (experts, convs, KDA q|k|v projections: one GEMM);
`checkpoint_targets` maps one checkpoint name to (parameter, index into it) and
`export_checkpoint` is its inverse (used by `make-tiny`). Block-FP8 tensors (e4m3 weight +
`weight_scale_inv` per block) are dequantised on load. Loading reads tensor by tensor through
`CheckpointReader`, so a sharded loader can later read only its rank's slices.
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
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)$")
_CONV = re.compile(r"self_attn\.([qkv])_conv1d\.weight$")
_QKV = re.compile(r"self_attn\.([qkv])_proj\.weight$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class CheckpointError(ValueError):
    """The checkpoint does not match the model: names the offending tensor(s)."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter `param`, into its `part` (index of q|k|v
    in the stacked conv or projection, of gate|up in w13) and `expert` row, if any."""

    param: str
    part: int | None = None
    expert: int | None = None


def _layer_local(rest: str, cfg: ModelConfig) -> Target:
    """Map a name relative to one decoder layer to a Target with a layer-relative param."""
    if m := _HC.fullmatch(rest):
        return Target(f"{m.group(1)}_hc.{m.group(2)}")
    if m := _CONV.fullmatch(rest):
        return Target("self_attn.conv_weight", part="qkv".index(m.group(1)))
    if m := _QKV.fullmatch(rest):
        return Target("self_attn.qkv_proj.weight", part="qkv".index(m.group(1)))
    if m := _EXPERT.fullmatch(rest):
        e, kind = int(m.group(1)), m.group(2)
        if e >= cfg.n_routed_experts:
            raise CheckpointError(f"expert index {e} >= n_routed_experts={cfg.n_routed_experts}")
        if kind == "down":
            return Target("mlp.w2", expert=e)
        return Target("mlp.w13", part=0 if kind == "gate" else 1, expert=e)
    if rest == "shared_head.norm.weight":
        return Target("shared_head_norm.weight")
    return Target(rest)


def checkpoint_targets(name: str, cfg: ModelConfig, with_mtp: bool) -> Target | None:
    """Where a checkpoint tensor goes; None for tensors recognised and deliberately skipped
    (vision tower when language-only, MTP layer when unused)."""
    if name == "lm_head.weight":
        return Target("lm_head.weight")
    if name.startswith(_VISION_PREFIX):
        return None  # language-only: the vision tower is not built
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
    return Target(prefix + target.param, target.part, target.expert)


def _checkpoint_names(pname: str, param: torch.Tensor, cfg: ModelConfig) -> list[str]:
    """Checkpoint tensors that fill parameter `pname` on this rank (local experts only)."""
    if pname == "lm_head.weight":
        return [pname]
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
    if rel == "self_attn.qkv_proj.weight":
        return [f"{base}self_attn.{c}_proj.weight" for c in "qkv"]
    if rel in ("mlp.w13", "mlp.w2"):
        experts = range(param.expert_offset, param.expert_offset + param.shape[0])
        kinds = ("down",) if rel == "mlp.w2" else ("gate", "up")
        return [f"{base}mlp.experts.{e}.{k}_proj.weight" for e in experts for k in kinds]
    if rel == "shared_head_norm.weight":
        return [f"{base}shared_head.norm.weight"]
    return [base + rel]


def export_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded model's parameters -> checkpoint-layout tensors (used by `make-tiny`)."""
    if model.parallel.world_size != 1:
        raise ValueError("export needs the unsharded (world size 1) model")
    cfg: ModelConfig = model.config
    out: dict[str, torch.Tensor] = {}
    for pname, p in model.named_parameters():
        names = _checkpoint_names(pname, p, cfg)
        t = p.detach()
        if pname.endswith("conv_weight"):
            parts = [c.unsqueeze(1) for c in t.chunk(3, dim=0)]
        elif pname.endswith("qkv_proj.weight"):
            parts = list(t.chunk(3, dim=0))
        elif pname.endswith("mlp.w13"):
            parts = [half for e in range(t.shape[0]) for half in t[e].chunk(2, dim=0)]
        elif pname.endswith("mlp.w2"):
            parts = list(t.unbind(0))
        else:
            parts = [t]
        out.update(zip(names, parts, strict=True))
    return {k: v.contiguous() for k, v in out.items()}


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Block-FP8 -> fp32: w[r, c] * scale_inv[r // br, c // bc].

    weight: [R, C] e4m3; scale_inv: [ceil(R/br), ceil(C/bc)] fp32. Without `block_size` the
    block is inferred from the shapes, which is only exact when every dim divides evenly
    (e.g. 64 columns in 48-wide blocks give 2 scale columns, which read back as 32-wide).
    """
    rows, cols = weight.shape
    if block_size is not None:
        br, bc = block_size
    else:
        br = -(-rows // scale_inv.shape[0])
        bc = -(-cols // scale_inv.shape[1])
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
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
        parts along `shard_dim`; unsharded reads touch only that part of the file."""
        handle = self._file(name)
        if shard_dim is None or size == 1:
            index: tuple = ()
        else:
            part = self.shape(name)[shard_dim] // size
            index = (slice(None),) * shard_dim + (slice(rank * part, (rank + 1) * part),)
        raw = handle.get_slice(name)
        if raw.get_dtype() not in ("F8_E4M3", "F8_E5M2"):
            return raw[index] if index else handle.get_tensor(name)
        if name not in self._scaled:
            raise CheckpointError(f"fp8 tensor {name!r} has no {SCALE_SUFFIX[1:]}")
        t = handle.get_tensor(name)
        scale_name = name[: -len(".weight")] + SCALE_SUFFIX
        scale = self._file(scale_name).get_tensor(scale_name)
        if self.fp8_block_size is not None:
            br, bc = self.fp8_block_size
            want = (-(-t.shape[0] // br), -(-t.shape[1] // bc))
            if tuple(scale.shape) != want:
                raise CheckpointError(f"{scale_name}: scale shape {tuple(scale.shape)}, "
                                      f"expected {want}")
        full = dequantize_fp8_blocks(t, scale, self.fp8_block_size)
        return full[index] if index else full


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
    if target.part is not None:
        n_parts = 3 if target.expert is None else 2  # q|k|v (conv taps, projections), gate|up
        size = dest.shape[0] // n_parts
        dest = dest[target.part * size:(target.part + 1) * size]
        shape[0] = size
        if target.param.endswith("conv_weight"):
            shape.insert(1, 1)  # conv taps are stored [C, 1, K]
    if getattr(param, "shard_size", 1) > 1:
        shape[param.shard_dim] *= param.shard_size
    return dest, tuple(shape)


def load_weights(model: torch.nn.Module, model_dir: str | Path, progress: bool = True) -> None:
    """Fill every parameter of `model` (this rank's shard) from the checkpoint in `model_dir`,
    strictly: a missing tensor, an unexpected tensor or a wrong shape raises CheckpointError
    naming it. Sharded parameters read only their slice; other ranks' experts are not read."""
    cfg: ModelConfig = model.config
    with_mtp = getattr(model, "mtp", None) is not None
    params = dict(model.named_parameters())
    needed = {n for pname, p in params.items() for n in _checkpoint_names(pname, p, cfg)}
    reader = CheckpointReader(model_dir, cfg.fp8_block_size)
    names = reader.names
    targets = {n: checkpoint_targets(n, cfg, with_mtp) for n in names}
    missing = sorted(needed - set(names))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {model_dir}")
    unexpected = sorted(n for n, t in targets.items() if t is not None and t.param not in params)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {model_dir}")
    todo = [n for n in names if targets[n] is not None]
    with torch.no_grad():
        for name in tqdm(todo, desc="loading weights", unit="tensor", disable=not progress):
            target = targets[name]
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
