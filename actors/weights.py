"""Checkpoint <-> parameter mapping and safetensors loading for GLM-5.3-Flash.

Checkpoint names are the release's (`model.language_model.layers.N...`, `lm_head.weight`,
per-expert `mlp.experts.E.{gate,up,down}_proj.weight`, separate `q/k/v_conv1d`, MTP layer at
index num_hidden_layers). Our parameters stack what the kernels want stacked (experts, convs);
`checkpoint_targets` maps one checkpoint name to (parameter, index into it) and
`export_checkpoint` is its inverse (used by `make-tiny`). Block-FP8 tensors (e4m3 weight +
`weight_scale_inv` per block) are dequantised on load. Loading reads tensor by tensor through
`CheckpointReader`, so a sharded loader can later read only its rank's slices.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
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
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class CheckpointError(ValueError):
    """The checkpoint does not match the model: names the offending tensor(s)."""


@dataclass(frozen=True)
class Target:
    param: str  # our parameter name
    index: tuple = ()  # where the checkpoint tensor goes inside the parameter
    shape: tuple[int, ...] | None = None  # checkpoint shape when it differs from param[index]


def _layer_local(rest: str, cfg: ModelConfig) -> tuple[str, tuple, tuple | None]:
    """Map a name relative to one decoder layer to (our relative name, index, ckpt shape)."""
    if m := _HC.fullmatch(rest):
        return f"{m.group(1)}_hc.{m.group(2)}", (), None
    if m := _CONV.fullmatch(rest):
        c = cfg.linear_dim
        j = "qkv".index(m.group(1))
        return "self_attn.conv_weight", (slice(j * c, (j + 1) * c),), (
            c, 1, cfg.linear_conv_kernel)
    if m := _EXPERT.fullmatch(rest):
        e, kind, i = int(m.group(1)), m.group(2), cfg.moe_intermediate_size
        if e >= cfg.n_routed_experts:
            raise CheckpointError(f"expert index {e} >= n_routed_experts={cfg.n_routed_experts}")
        if kind == "down":
            return "mlp.w2", (e,), None
        return "mlp.w13", (e, slice(0, i) if kind == "gate" else slice(i, 2 * i)), None
    if rest == "shared_head.norm.weight":
        return "shared_head_norm.weight", (), None
    return rest, (), None


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
        param, index, shape = _layer_local(rest, cfg)
    except CheckpointError as exc:
        raise CheckpointError(f"unexpected tensor {name!r}: {exc}") from None
    return Target(prefix + param, index, shape)


def export_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters -> checkpoint-layout tensors (inverse of `checkpoint_targets`)."""
    cfg: ModelConfig = model.config
    out: dict[str, torch.Tensor] = {}
    for pname, p in model.named_parameters():
        t = p.detach()
        if pname == "lm_head.weight":
            out[pname] = t
            continue
        if pname.startswith("mtp."):
            base, rel = f"{PREFIX}layers.{cfg.mtp_layer_id}.", pname[len("mtp."):]
        elif m := re.match(r"layers\.(\d+)\.(.+)$", pname):
            base, rel = f"{PREFIX}layers.{m.group(1)}.", m.group(2)
        else:
            out[PREFIX + pname] = t
            continue
        if m := re.fullmatch(r"(attn|ffn)_hc\.(fn|base|scale)", rel):
            out[f"{base}hc_{m.group(1)}_{m.group(2)}"] = t
        elif rel == "self_attn.conv_weight":
            for j, part in enumerate(t.chunk(3, dim=0)):
                out[f"{base}self_attn.{'qkv'[j]}_conv1d.weight"] = part.unsqueeze(1)
        elif rel in ("mlp.w13", "mlp.w2"):
            for e in range(t.shape[0]):
                if rel == "mlp.w2":
                    out[f"{base}mlp.experts.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{base}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{base}mlp.experts.{e}.up_proj.weight"] = up
        elif rel == "shared_head_norm.weight":
            out[f"{base}shared_head.norm.weight"] = t
        else:
            out[base + rel] = t
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

    @property
    def names(self) -> list[str]:
        """Logical tensor names (fp8 scale tensors are folded into their weights)."""
        return sorted(n for n in self.files if not n.endswith(SCALE_SUFFIX))

    def _raw(self, name: str) -> torch.Tensor:
        with safe_open(self.dir / self.files[name], framework="pt") as st:
            return st.get_tensor(name)

    def load(self, name: str) -> torch.Tensor:
        t = self._raw(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name not in self._scaled:
                raise CheckpointError(f"fp8 tensor {name!r} has no {SCALE_SUFFIX[1:]}")
            scale = self._raw(name[: -len(".weight")] + SCALE_SUFFIX)
            if self.fp8_block_size is not None:
                br, bc = self.fp8_block_size
                want = (-(-t.shape[0] // br), -(-t.shape[1] // bc))
                if tuple(scale.shape) != want:
                    raise CheckpointError(f"{name}{SCALE_SUFFIX[7:]}: scale shape "
                                          f"{tuple(scale.shape)}, expected {want}")
            return dequantize_fp8_blocks(t, scale, self.fp8_block_size)
        return t

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.load(name)


def load_weights(model: torch.nn.Module, model_dir: str | Path, progress: bool = True) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, strictly: a missing
    tensor, an unexpected tensor or a wrong shape raises CheckpointError naming it."""
    cfg: ModelConfig = model.config
    with_mtp = getattr(model, "mtp", None) is not None
    params = dict(model.named_parameters())
    expected = set(export_names(model))
    reader = CheckpointReader(model_dir, cfg.fp8_block_size)
    names = reader.names
    targets = {n: checkpoint_targets(n, cfg, with_mtp) for n in names}
    missing = sorted(expected - set(names))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {model_dir}")
    unexpected = sorted(n for n, t in targets.items() if t is not None and n not in expected)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {model_dir}")
    todo = [n for n in names if targets[n] is not None]
    with torch.no_grad():
        for name in tqdm(todo, desc="loading weights", unit="tensor", disable=not progress):
            target = targets[name]
            param = params[target.param]
            dest = param.data[target.index] if target.index else param.data
            tensor = reader.load(name)
            want = target.shape or tuple(dest.shape)
            if tuple(tensor.shape) != tuple(want):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(want)}")
            dest.copy_(tensor.reshape(dest.shape).to(param.dtype))


def export_names(model: torch.nn.Module) -> list[str]:
    """Checkpoint names the model needs (without materialising tensors twice)."""
    return list(export_checkpoint(model))
