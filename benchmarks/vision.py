"""Vision tower throughput (issue 24's GPU acceptance point): images/s of the serving vision
tower (ViT blocks, 2x2 patch merger, projector into the text width) at the release config.

Built by the serving code: `build_model(release config, with_vision=True)` on the meta device,
its `visual` module materialised on the device (`materialize`) and filled by `tiny.randomize`
(bf16, fan-in scaled normals). The release `vision_config` is `actors/release.py`
(glm53-model.md §1.4): 24 blocks, hidden 1024, 16 heads, 14-pixel patches, 2 frames, 2x2 merge,
out 4096, about 564 M parameters. An image of SIZE x SIZE pixels is what the processor
(`deployments/images.py`) makes of a square image of that size: a (1, SIZE/14, SIZE/14) grid of
patches, one vision token per 2x2 block. 448 is the release `image_size` (1024 patches, 256
tokens); 896 is the serving default cap per image (`ImageConfig.max_tokens` = 1024 tokens).

A batch of B images is one tower call with B grids (attention stays within each image); the
model runner today embeds one image per call, so batch 1 is what serving gets. Pixels are
random fp32 rows already on the device (the runner's host-to-device copy is not timed). Per
case: `ms` (median of CUDA-event times around each call issued to an idle GPU, host launch
gaps included: what the runner waits), `device_ms` (the kernels' summed device time per call,
from torch.profiler over 3 calls: the rate if launches were hidden; `bench_common.device_ms`
cannot queue calls ahead, since each call copies its patch positions to the GPU, a sync), and
images/s, vision tokens/s and TFLOP/s (modeled matmul + attention FLOPs) from each. `--compile`
adds the same cases with each ViT block under torch.compile (off by default: compiling takes
minutes). The JSON also keeps each case's 15 largest kernels (device ms per call).

    python benchmarks/vision.py [--json benchmarks/results/vision_h200_<commit>.json]
        [--commit SHA] [--sizes 448,896] [--batches 1,4,16] [--compile]
    python benchmarks/vision.py --device cpu --tiny     # the tests' toy tower: a CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from datetime import UTC, datetime

import torch
from bench_common import git_commit, kernel_profile
from torch import nn

from glm53.actors.config import ModelConfig, VisionConfig
from glm53.actors.loader import build_model, materialize
from glm53.actors.models.vision import VisionTower
from glm53.actors.release import release_config
from glm53.actors.tiny import randomize, tiny_text_config
from glm53.actors.tiny import release_config as tiny_release_config


def tower_config(tiny: bool) -> tuple[dict, ModelConfig]:
    """(the raw `config.json` dict, its ModelConfig): the release's or the tests' toy one."""
    if tiny:
        text = tiny_text_config(dtype="bfloat16")
        raw = tiny_release_config(text, eos_token_ids=[0], pad_token_id=0)
    else:
        raw = release_config()
    return raw, ModelConfig.from_hf(raw)


def build_tower(cfg: ModelConfig, device: str, seed: int = 0) -> VisionTower:
    """The serving model's vision tower with random bf16 weights on `device`: the whole model
    built on meta as the loader builds it, only `visual` materialised."""
    visual = build_model(cfg, dtype=torch.bfloat16, device="meta", with_vision=True).visual
    holder = nn.Module()  # randomize keys its vision rule on the model's `visual.` prefix
    holder.visual = materialize(visual, device)
    holder.config = cfg
    with torch.no_grad():
        randomize(holder, seed)
    return holder.visual


def image_flops(v: VisionConfig, side: int) -> float:
    """Modeled FLOPs of one side x side-patch image: every matmul (2 per weight per token:
    patch-level weights over patches, merger weights over merged tokens) and the attention
    (QK^T and PV: 4 * S^2 * hidden per block, S = patches)."""
    patches, merged = side * side, side * side // v.spatial_merge_size**2
    d, i, o, pi = v.hidden_size, v.intermediate_size, v.out_hidden_size, \
        v.projection_intermediate_size
    per_patch = v.patch_dim * d + v.depth * (4 * d * d + 3 * d * i)
    per_merged = v.spatial_merge_size**2 * d * o + o * o + 3 * o * pi
    return 2.0 * (patches * per_patch + merged * per_merged) + v.depth * 4.0 * patches**2 * d


PROFILED_CALLS = 3  # calls under the profiler per case, for device_ms


def call_ms(fn, device: str, reps: int) -> float:
    """Median ms of one call, each issued to an idle device (CUDA events; perf_counter on
    CPU): host work and launch gaps included."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def reps_for(ms: float, budget_ms: float) -> int:
    """Timed repetitions that fit `budget_ms` (3..30)."""
    return int(min(30, max(3, budget_ms // max(ms, 1e-3))))


def run_case(tower: nn.Module, v: VisionConfig, side: int, batch: int, device: str,
             budget_ms: float) -> dict:
    grids = [(1, side, side)] * batch
    gen = torch.Generator(device=device).manual_seed(batch)
    pixels = torch.randn(batch * side * side, v.patch_dim, generator=gen, device=device)

    def fn():
        return tower(pixels, grids)

    tokens = side * side // v.spatial_merge_size**2
    out = fn()
    assert out.shape == (batch * tokens, v.out_hidden_size), out.shape
    assert bool(torch.isfinite(out).all()), "non-finite vision embeddings"
    for _ in range(2):  # warm-up
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = call_ms(fn, device, 1)
    reps = reps_for(first, budget_ms)
    row = dict(batch=batch, reps=reps, ms=round(call_ms(fn, device, reps), 4))
    if device == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        try:
            prof = kernel_profile(lambda: [fn() for _ in range(PROFILED_CALLS)], top=15)
            row["device_ms"] = round(prof["device_ms"] / PROFILED_CALLS, 4)
            row["kernels"] = [dict(k, calls=k["calls"] / PROFILED_CALLS,
                                   ms=round(k["ms"] / PROFILED_CALLS, 4))
                              for k in prof["kernels"]]  # per call, in the JSON only
        except Exception as exc:  # noqa: BLE001 - the wall time stands without it
            row["device_error"] = repr(exc)[:400]
    flops = image_flops(v, side) * batch
    for key, suffix in (("ms", ""), ("device_ms", "_device")):
        if key in row:
            s = row[key] / 1e3
            row["images_per_s" + suffix] = round(batch / s, 2)
            row["tokens_per_s" + suffix] = round(batch * tokens / s, 1)
            row["tflops" + suffix] = round(flops / s / 1e12, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--commit", default=None, help="default: git's (the device copy has none)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="the tests' toy vision tower")
    ap.add_argument("--sizes", help="square image sides in pixels, multiples of patch x "
                    "merge (default 448,896; --tiny: 448)")
    ap.add_argument("--batches", help="images per tower call (default 1,4,16; --tiny: 1,4)")
    ap.add_argument("--compile", action="store_true",
                    help="also time each case with the ViT blocks under torch.compile")
    ap.add_argument("--budget-ms", type=float,
                    help="time per case spent on timed repetitions (default 1500; --tiny: 200)")
    args = ap.parse_args()
    args.sizes = args.sizes or ("448" if args.tiny else "448,896")
    args.batches = args.batches or ("1,4" if args.tiny else "1,4,16")
    args.budget_ms = args.budget_ms or (200.0 if args.tiny else 1500.0)
    raw, cfg = tower_config(args.tiny)
    v = cfg.vision
    unit = v.patch_size * v.spatial_merge_size
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if any(s % unit for s in sizes):
        raise SystemExit(f"--sizes: each side must be a multiple of {unit} (patch x merge)")
    batches = [int(b) for b in args.batches.split(",") if b]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    tower = build_tower(cfg, args.device)
    if args.device == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    meta = dict(
        benchmark="vision", commit=args.commit or git_commit(),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        date=datetime.now(UTC).isoformat(timespec="seconds"), torch=torch.__version__,
        config="tiny (tests' toy tower)" if args.tiny else
        "release (actors/release.py, glm53-model.md §1.4)",
        vision_config=raw["vision_config"], rope_theta=v.rope_theta, dtype="bfloat16",
        params=sum(p.numel() for p in tower.parameters()), build_s=round(build_s, 2),
        note="one tower call per batch (grids of B images); pixels already on the device; "
             "ms: CUDA events per call, host gaps included; device_ms: kernels' summed device "
             "time per call (torch.profiler); "
             "tflops: modeled matmul + attention FLOPs; random weights")
    print(json.dumps(meta, indent=1), flush=True)
    rows: list[dict] = []

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta, results=rows), f, indent=2)

    modes = ["eager"] + (["compile"] if args.compile else [])
    for mode in modes:
        if mode == "compile":
            for block in tower.blocks:
                block.compile(dynamic=False)
        for side_px in sizes:
            side = side_px // v.patch_size
            for batch in batches:
                row = dict(mode=mode, image_px=side_px, grid=[1, side, side],
                           patches_per_image=side * side,
                           tokens_per_image=side * side // v.spatial_merge_size**2)
                try:
                    row.update(run_case(tower, v, side, batch, args.device, args.budget_ms))
                except Exception:  # noqa: BLE001 - a failed case is recorded, not fatal
                    row.update(batch=batch, error=traceback.format_exc()[-3000:])
                    print(row["error"], flush=True)
                rows.append(row)
                print(json.dumps({k: x for k, x in row.items() if k != "kernels"}),
                      flush=True)
                save()
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    print_table(rows)
    save()


def print_table(rows: list[dict]) -> None:
    cols = ("mode", "image_px", "tokens_per_image", "batch", "ms", "device_ms", "images_per_s",
            "images_per_s_device", "tokens_per_s", "tflops_device", "peak_gib")
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "error" if c == "ms" and "error" in r else "-"))
                         for c in cols))


if __name__ == "__main__":
    main()
