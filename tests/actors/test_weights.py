"""Strict safetensors loading of tiny release-layout checkpoints (names, shapes, FP8, shards)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53.actors.loader import build_model, load_model, read_config
from glm53.actors.weights import CheckpointError, CheckpointReader, export_checkpoint, load_weights

P = "model.language_model."
MTP = f"{P}layers.5."  # 5 trunk layers: the MTP layer is index 5
FILE = "model.safetensors"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints) -> Path:
    return tiny_checkpoints(seed=2, layers=5, mtp=True)


@pytest.fixture(scope="module")
def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / FILE)


Mutation = Callable[[dict[str, torch.Tensor]], None]


def copy_with(src: Path, dst: Path, mutate: Mutation | None = None) -> Path:
    """Copy a checkpoint directory, applying `mutate` to its tensors."""
    shutil.copytree(src, dst)
    if mutate is not None:
        tensors = load_file(dst / FILE)
        mutate(tensors)
        save_file(tensors, dst / FILE, metadata={"format": "pt"})
    return dst


def assert_load_error(model_dir: Path, *fragments: str, with_mtp: bool = False) -> None:
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir, with_mtp=with_mtp, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value)


# ----- round trip -----

@pytest.mark.parametrize(("with_mtp", "with_vision"), [(False, False), (True, True)])
def test_loaded_parameters_equal_checkpoint(ckpt: Path, tensors: dict[str, torch.Tensor],
                                            with_mtp: bool, with_vision: bool) -> None:
    model = load_model(ckpt, with_mtp=with_mtp, progress=False, with_vision=with_vision)
    exported = export_checkpoint(model)
    expected = {n for n in tensors if (with_mtp or not n.startswith(MTP))
                and (with_vision or not n.startswith("model.visual."))}
    assert set(exported) == expected
    # the file does hold MTP and vision tensors
    assert with_mtp or sum(n.startswith(MTP) for n in tensors) > 0
    assert with_vision or sum(n.startswith("model.visual.") for n in tensors) > 0
    for name in sorted(expected):
        assert exported[name].dtype == tensors[name].dtype, name
        assert torch.equal(exported[name], tensors[name]), name


# ----- strictness: missing, unexpected, wrong shape -----

def test_missing_expert_tensor_is_named(ckpt: Path, tmp_path: Path) -> None:
    name = f"{P}layers.4.mlp.experts.3.up_proj.weight"
    bad = copy_with(ckpt, tmp_path / "m", lambda t: t.pop(name))
    assert_load_error(bad, repr(name), "missing")


@pytest.mark.parametrize("name", [
    f"{P}layers.2.self_attn.bogus.weight",
    "foo.bar",
    f"{P}layers.7.input_layernorm.weight",  # beyond the trunk and the MTP layer
    f"{P}layers.4.mlp.experts.8.up_proj.weight",  # expert index out of range (8 experts)
])
def test_unexpected_tensor_is_named(ckpt: Path, tmp_path: Path, name: str) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(4, 4)

    bad = copy_with(ckpt, tmp_path / "x", add)
    assert_load_error(bad, repr(name), "unexpected")


@pytest.mark.parametrize("name, new_shape", [
    (f"{P}layers.3.self_attn.q_a_proj.weight", None),  # transposed
    (f"{P}layers.0.self_attn.k_conv1d.weight", "kernel-1"),  # conv with the wrong kernel size
])
def test_wrong_shape_is_named(ckpt: Path, tensors: dict[str, torch.Tensor], tmp_path: Path,
                              name: str, new_shape: str | None) -> None:
    good = tuple(tensors[name].shape)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].t().contiguous() if new_shape is None else t[name][..., :-1].clone()

    bad = copy_with(ckpt, tmp_path / "s", reshape)
    wrong = tuple(load_file(bad / FILE)[name].shape)
    assert wrong != good
    assert_load_error(bad, repr(name), str(wrong), str(good))


# ----- block FP8 -----

def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """e4m3 weight, fp32 scale_inv grid and the dequantised reference, block by block."""
    br, bc = block
    rows, cols = w.shape
    grid = (-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid, dtype=torch.float32)
    ref = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = tile.abs().max().clamp_min(1e-12) / 448.0
            q_tile = (tile / s).to(torch.float8_e4m3fn)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q_tile
            scale[i, j] = s
            ref[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q_tile.float() * s
    return q, scale, ref


FP8_NAMES = [
    f"{P}layers.3.self_attn.kv_a_proj_with_mqa.weight",  # dense DSA projection [32, 64]
    f"{P}layers.4.mlp.experts.5.down_proj.weight",  # routed expert [64, 32]
    f"{P}layers.1.self_attn.b_proj.weight",  # [2, 64]: rows not divisible by the block
    "lm_head.weight",  # [272, 64]
]


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int],
                         names: list[str]) -> dict[str, torch.Tensor]:
    """Copy `src` with `names` stored as block-FP8 and a top-level quantization_config;
    returns the dequantised reference of each name."""
    refs: dict[str, torch.Tensor] = {}

    def quantize(t: dict[str, torch.Tensor]) -> None:
        for name in names:
            q, scale, refs[name] = quantize_blocks(t[name], block)
            t[name] = q
            t[name.removesuffix(".weight") + ".weight_scale_inv"] = scale

    copy_with(src, dst, quantize)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    return refs


@pytest.mark.parametrize("block", [(16, 16), (48, 48), (16, 48)])
def test_fp8_weights_are_dequantised(ckpt: Path, tensors: dict[str, torch.Tensor],
                                     tmp_path: Path, block: tuple[int, int]) -> None:
    refs = write_fp8_checkpoint(ckpt, tmp_path / "fp8", block, FP8_NAMES)
    assert read_config(tmp_path / "fp8").fp8_block_size == block
    file = load_file(tmp_path / "fp8" / FILE)
    assert all(file[n].dtype == torch.float8_e4m3fn for n in FP8_NAMES)
    exported = export_checkpoint(load_model(tmp_path / "fp8", progress=False))
    for name in FP8_NAMES:
        original = tensors[name]
        assert torch.equal(exported[name], refs[name]), name
        assert not torch.equal(exported[name], original), name  # the fp8 tensor was used
        tol = original.abs().max() / 8  # e4m3 keeps 3 mantissa bits
        assert torch.allclose(exported[name], original, atol=float(tol)), name
    # everything else is untouched
    for name, t in tensors.items():
        if name not in FP8_NAMES and not name.startswith((MTP, "model.visual.")):
            assert torch.equal(exported[name], t), name


def test_fp8_weight_without_scale(ckpt: Path, tmp_path: Path) -> None:
    name = FP8_NAMES[0]
    write_fp8_checkpoint(ckpt, tmp_path / "a", (16, 16), [name])

    def drop_scale(t: dict[str, torch.Tensor]) -> None:
        del t[name.removesuffix(".weight") + ".weight_scale_inv"]

    bad = copy_with(tmp_path / "a", tmp_path / "b", drop_scale)
    assert_load_error(bad, repr(name), "weight_scale_inv")


def test_fp8_scale_without_weight(ckpt: Path, tmp_path: Path) -> None:
    scale_name = f"{P}layers.3.self_attn.bogus_proj.weight_scale_inv"

    def add_scale(t: dict[str, torch.Tensor]) -> None:
        t[scale_name] = torch.ones(1, 1)

    bad = copy_with(ckpt, tmp_path / "s", add_scale)
    assert_load_error(bad, repr(scale_name))


def test_fp8_scale_with_wrong_block_grid(ckpt: Path, tmp_path: Path) -> None:
    name = FP8_NAMES[0]  # [32, 64] in 16x16 blocks: a 2x4 grid
    scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
    write_fp8_checkpoint(ckpt, tmp_path / "a", (16, 16), [name])

    def coarse_scale(t: dict[str, torch.Tensor]) -> None:
        t[scale_name] = t[scale_name][:1].clone()

    bad = copy_with(tmp_path / "a", tmp_path / "b", coarse_scale)
    assert_load_error(bad, scale_name, "(1, 4)", "(2, 4)")


# ----- skipped tensors: vision tower, MTP layer -----

def test_vision_tensors_are_skipped(ckpt: Path, tensors: dict[str, torch.Tensor],
                                    tmp_path: Path) -> None:
    def add_vision(t: dict[str, torch.Tensor]) -> None:
        t["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32)
        t["model.visual.blocks.0.attn.qkv.bias"] = torch.randn(96)
        t["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 14, 14)
        t["model.visual.merger.proj.weight"] = torch.randn(64, 64)

    vis = copy_with(ckpt, tmp_path / "v", add_vision)
    assert any(n.startswith("model.visual.") for n in CheckpointReader(vis).names)
    model = load_model(vis, with_mtp=True, progress=False)
    exported = export_checkpoint(model)
    assert not any(n.startswith("model.visual.") for n in exported)
    assert all(torch.equal(exported[n], tensors[n]) for n in exported)


def test_mtp_tensors_skipped_without_mtp(ckpt: Path) -> None:
    assert any(n.startswith(MTP) for n in CheckpointReader(ckpt).names)
    model = build_model(read_config(ckpt), with_mtp=False)
    load_weights(model, ckpt, progress=False)
    assert model.mtp is None
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())


def test_mtp_tensors_loaded_with_mtp(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    model = build_model(read_config(ckpt), with_mtp=True)
    load_weights(model, ckpt, progress=False)
    assert torch.equal(model.mtp.eh_proj.weight, tensors[f"{MTP}eh_proj.weight"])
    assert torch.equal(model.mtp.shared_head_norm.weight,
                       tensors[f"{MTP}shared_head.norm.weight"])
    assert torch.equal(model.mtp.enorm.weight, tensors[f"{MTP}enorm.weight"])


def test_missing_mtp_tensors_fail_for_mtp_model(ckpt: Path, tmp_path: Path) -> None:
    def drop_mtp(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith(MTP)]:
            del t[name]

    trunk = copy_with(ckpt, tmp_path / "t", drop_mtp)
    load_model(trunk, with_mtp=False, progress=False)  # fine without MTP
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor '{MTP}")):
        load_model(trunk, with_mtp=True, progress=False)


# ----- sharded checkpoints -----

def test_sharded_checkpoint_loads_the_same(ckpt: Path, tensors: dict[str, torch.Tensor],
                                           tmp_path: Path) -> None:
    sharded = copy_with(ckpt, tmp_path / "sh")
    (sharded / FILE).unlink()
    names = sorted(tensors)
    weight_map = {}
    for k in range(3):
        shard = f"model-{k + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[k::3]}
        save_file(part, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    reader = CheckpointReader(sharded)
    assert len(set(reader.files.values())) == 3
    single = load_model(ckpt, with_mtp=True, progress=False).state_dict()
    loaded = load_model(sharded, with_mtp=True, progress=False).state_dict()
    assert loaded.keys() == single.keys()
    for key, value in single.items():
        assert torch.equal(loaded[key], value), key


# ----- dtypes -----

FP32_PARAMS = re.compile(r"(mlp\.gate\.weight|e_score_correction_bias|_hc\.(fn|base|scale)"
                         r"|conv_weight|dt_bias|A_log|index_kpool_compress_ape"
                         r"|indexer\.weights_proj\.weight)$")


def test_bf16_load_keeps_fp32_parameters(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    model = load_model(ckpt, with_mtp=True, dtype=torch.bfloat16, progress=False)
    kinds = set()
    for name, p in model.named_parameters():
        if m := FP32_PARAMS.search(name):
            kinds.add(m.group(1))
            assert p.dtype == torch.float32, name
        elif p.ndim >= 2:
            assert p.dtype == torch.bfloat16, name
    assert kinds == {"mlp.gate.weight", "e_score_correction_bias", "_hc.fn", "_hc.base",
                     "_hc.scale", "conv_weight", "dt_bias", "A_log", "index_kpool_compress_ape",
                     "indexer.weights_proj.weight"}
    # values: fp32 parameters exactly as stored, the rest rounded to bf16
    for name, t in export_checkpoint(model).items():
        assert torch.equal(t, tensors[name].to(t.dtype)), name


@pytest.mark.parametrize("block", [(16, 16), (48, 48), (16, 48)])
@pytest.mark.parametrize("dim", [0, 1])
def test_fp8_shards_read_only_their_slice(ckpt: Path, tmp_path: Path, block: tuple[int, int],
                                          dim: int) -> None:
    """A TP shard of a block-FP8 tensor reads its rows/columns and the scale blocks covering
    them (48-wide blocks straddle the shard boundary), and equals that slice of the whole."""
    name = "lm_head.weight"  # [272, 64]
    write_fp8_checkpoint(ckpt, tmp_path / "fp8", block, [name])
    whole = CheckpointReader(tmp_path / "fp8", block).load(name)
    reader = CheckpointReader(tmp_path / "fp8", block)
    handle = reader._file(name)
    reads: list[tuple] = []

    class SliceOnly:  # the safetensors file, refusing whole-tensor reads and logging slices
        def get_tensor(self, n):
            raise AssertionError(f"a shard read the whole of {n}")

        def get_slice(self, n):
            raw = handle.get_slice(n)

            class Logged:
                def get_shape(self):
                    return raw.get_shape()

                def get_dtype(self):
                    return raw.get_dtype()

                def __getitem__(self, index):
                    part = raw[index]
                    reads.append((n, tuple(part.shape)))
                    return part
            return Logged()

    reader._handles = {f: SliceOnly() for f in set(reader.files.values())}
    for size in (2, 4):
        for rank in range(size):
            reads.clear()
            part = whole.shape[dim] // size
            want = whole.narrow(dim, rank * part, part)
            assert torch.equal(reader.load(name, dim, rank, size), want), (size, rank)
            (_, got), (_, scales) = reads  # the weight's slice, then its scale blocks
            assert got[dim] == part
            first, last = rank * part // block[dim], -(-(rank + 1) * part // block[dim])
            assert scales[dim] == last - first, (size, rank, scales)
