"""The 4-layer full-width slice (performance.md, benchmark 2): our model over the paged caches
vs transformers' eager Glm5Next, in the same run, on one GPU.

Layers: KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE (288 experts, top-8), full embedding and
lm_head, bf16, random weights (fan-in scaled normals; each model its own). Ours: the model
forward over a ForwardBatch built per step from host arrays (what the model runner does), the
lm_head on the last rows and a greedy argmax, eager (and a CUDA-graph replay of the same decode
step where capture works), and a decode step served the way the model runner serves it with
graphs (`engine_step_ms`: host step arrays -> static-buffer copy -> replay of the bucket's graph
-> eager sampling of the real rows -> tokens on the host, so host overhead is included).
Ours decodes over a cache of the stated context (zero-filled: the kernels read the same bytes
whatever the values); transformers decodes after a real prefill of that context (skipped
where its eager DSA attention would not fit). Prints a table and writes JSON.

    python benchmarks/slice.py [--json benchmarks/results/slice_h200_<commit>.json] [--commit SHA]
        [--decode 1x2048,...] [--hf-decode 1x2048,...] [--prefill 4096,...] [--no-graphs]
        [--no-transformers] [--profile] [--kv-cache-dtype bf16,fp8,nvfp4]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from bench_common import device_ms, kernel_profile, unit_scale_bank

from glm53.actors.caches import ModelCaches, cache_bytes
from glm53.actors.config import ModelConfig
from glm53.actors.cuda_graphs import DecodeGraphs
from glm53.actors.forward_batch import ForwardBatch, slot_mapping_for
from glm53.actors.loader import build_model
from glm53.actors.model_runner import logits_row_index
from glm53.actors.sampler import Sampler, build_sampling_inputs
from glm53.actors.step import SamplingParams, StepInput
from glm53.actors.tiny import release_config, tiny_text_config
from glm53.actors.transfers import to_host

DEV = "cuda"
BLOCK = 64
FULL = dict(
    vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
    num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32, index_head_dim=128,
    index_topk=2048, n_routed_experts=288, num_experts_per_tok=8,
    max_position_embeddings=131072, dtype="bfloat16",
)


def slice_config(layers: int = 4, mtp: bool = False, experts: int = 288) -> dict:
    text = tiny_text_config(num_layers=layers, mtp=mtp, first_k_dense_replace=1,
                            **{**FULL, "n_routed_experts": experts})
    text["linear_attn_config"].update(num_heads=64, head_dim=128)
    return release_config(text, eos_token_ids=[154820], pad_token_id=154820)


def slice_checkpoint(out_dir: str, experts: int = 288) -> str:
    """A checkpoint directory of the slice plus its MTP layer with `experts` routed experts:
    config.json only (no weights file: writing ~60 GB of random safetensors takes minutes).
    Engines load it under `random_weights()`. Returns the directory."""
    config = slice_config(mtp=True, experts=experts)
    Path(out_dir, "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def slice_label(experts: int, mtp: bool) -> str:
    layers = "KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE" + (", MTP" if mtp else "")
    return f"slice ({layers}; full widths), random weights, {experts} experts"


@contextlib.contextmanager
def random_weights(seed: int = 0):
    """Inside, the loader fills every model it builds with `randomize_` on its device instead
    of reading safetensors (the engines then serve a config-only checkpoint directory; the
    loader has no post-load step, so the model is otherwise the one a checkpoint gives)."""
    from glm53.actors import loader

    def fill(model, model_dir, progress=True) -> None:
        torch.manual_seed(seed)
        randomize_(model)

    original, loader.load_weights = loader.load_weights, fill
    try:
        yield
    finally:
        loader.load_weights = original


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    """Fan-in scaled normals on the device (norm weights ~1, biases / gate constants small)."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim == 1 and (leaf == "weight" or name.endswith("scale")):
            p.normal_(1.0, 0.1)
        elif p.ndim <= 1:
            p.normal_(0.0, 0.3)
        elif "embed" in name:
            p.normal_(0.0, 1.0)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def _sync() -> None:
    """Wait for the GPU (nothing to wait for without one: the CPU runs ops as they are called)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _wait(ready: torch.cuda.Event | None) -> None:
    """Wait for a to_host copy (None: it was on the host already)."""
    if ready is not None:
        ready.synchronize()


def _timed(fn, steps: int) -> float:
    fn()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync()
    return (time.perf_counter() - start) / steps * 1e3


def host_call_ms(fn, calls: int = 10) -> float:
    """Median host time of one call issued to an idle GPU (for a graph replay: what
    cudaGraphLaunch costs the host before it can go on)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return float(np.median(times) * 1e3)


def engine_step_ms(model, caches: ModelCaches, cfg: ModelConfig, batch_size: int, ctx: int,
                   tables: list[list[int]], steps: int = 20,
                   profile: bool = False) -> tuple[float, dict]:
    """ms per greedy decode step through DecodeGraphs, as ModelRunner.execute runs it: block
    tables as wide as the model's context (the engine's fixed graph width), the pad slot last.
    Also where the host spends a step (medians, ms): building the step and loading + replaying
    the graph, the sampler's calls, and the wait for the tokens; `overlapped_ms`, the step as
    overlapped execution runs it (ModelRunner.launch of step N+1, whose tokens are step N's
    samples filled in on the device, before finish of step N: the host work hides behind the
    running step). With CUDA graphs, the device's share of it: `engine_graph_device_ms` (the
    engine's graph replayed alone), `full_width_graph_device_ms` (the same with block tables
    as wide as the model's context, as every graph had before graphs per context size),
    `case_width_graph_device_ms` (with tables as wide as the case's, as the bare replay's),
    `engine_step_device_ms` (all a step queues) and `engine_step_kernels` (its kernels by
    device time). With `profile`, the host calls that take the most CPU time in one step
    (torch.profiler) and every kernel of the engine's graph (`engine_graph_kernels`, to diff
    with the bare step's). Runs on the model's device: CUDA graphs on CUDA, their eager
    emulation elsewhere."""
    device = next(model.parameters()).device
    graphs = DecodeGraphs(model, caches, pad_slot=caches.layers[0].conv.shape[0] - 1,
                          max_blocks=cfg.max_position_embeddings // BLOCK,
                          batch_sizes=(batch_size,), widths=(1,),
                          capture=device.type == "cuda")
    sampler = Sampler()
    rows = np.arange(batch_size, dtype=np.int64)
    positions = np.full(batch_size, ctx - 1, dtype=np.int64)
    table = np.array(tables, dtype=np.int32)
    sampling = build_sampling_inputs(
        [(SamplingParams(temperature=0.0), 0, ctx, (), (), ())] * batch_size)
    token_ids = np.random.default_rng(0).integers(0, cfg.vocab_size, batch_size)
    marks: list[tuple[float, float, float]] = []
    empty = np.zeros(0, dtype=np.int64)

    def step_input(delta: bool, placeholders: bool) -> StepInput:
        return StepInput(0, [""] * batch_size, token_ids, positions,
                         np.arange(batch_size + 1, dtype=np.int64), table,
                         slot_mapping_for(positions, rows, table, BLOCK), rows, rows, rows,
                         sampling, block_table_resets=empty if delta else None,
                         block_table_updates=empty.reshape(0, 3) if delta else None,
                         placeholder_rows=rows if placeholders else None,
                         placeholder_sources=rows if placeholders else None)

    def launch(previous: bool, delta: bool = True) -> tuple[torch.Tensor, object]:
        """Steps 'build -> load + replay -> sample' of one step; its tokens are the last
        step's samples (on the device, graphs.static.samples) when `previous`. The graphs read
        the block tables from their persistent rows: `delta`, the step brings the engine's
        steady-state change to them (none); else its whole tables are written there (the first
        step)."""
        step = step_input(delta, previous)
        graphs.static.update_tables(step)  # whole tables (the first step); a delta: no-op
        _, _, logits = graphs.run(step, graphs.bucket(step))
        t1 = time.perf_counter()
        ids, _ = sampler(logits[logits_row_index(step.sample_rows, device)], step.sampling,
                         out=graphs.static.samples_out(batch_size))
        return to_host(ids), t1

    def decode() -> np.ndarray:
        t0 = time.perf_counter()
        (host, ready), t1 = launch(False)
        t2 = time.perf_counter()
        _wait(ready)
        marks.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return host.numpy()

    launch(False, delta=False)
    ms = _timed(decode, steps)
    split = [float(v) for v in np.median(np.array(marks[1:]), axis=0) * 1e3]  # [0]: warm-up
    host = dict(build_load_replay_ms=split[0], sampler_calls_ms=split[1], wait_ms=split[2])

    def overlapped(n: int) -> None:
        (host, ready), _ = launch(False)
        for _ in range(n):
            nxt, _ = launch(True)
            _wait(ready)
            host.numpy()
            (host, ready) = nxt
        _wait(ready)

    overlapped(2)  # warm-up
    _sync()
    start = time.perf_counter()
    overlapped(steps)
    host["overlapped_ms"] = (time.perf_counter() - start) / (steps + 1) * 1e3
    if graphs.graphs:
        # where the overlapped step's time over a bare replay goes, on the device alone (host
        # time hidden): the engine's graph replayed by itself (its block tables as wide as the
        # narrowest captured context holding the case, the bare replay's only as wide as the
        # case), the same at tables as wide as the model's context, then everything a step
        # queues (the input copy, replay, sampler, copy back)
        graph = graphs.graphs[graphs.bucket(step_input(True, True))].graph
        host["engine_graph_device_ms"] = device_ms(graph.replay)

        def graph_at_width(blocks: int) -> float:
            """Device ms of the engine's graph captured with tables `blocks` wide (the widths
            end at max_blocks, so a narrower case also captures that one, unused)."""
            other = DecodeGraphs(model, caches, pad_slot=graphs.static.pad_slot,
                                 max_blocks=graphs.static.max_blocks, batch_sizes=(batch_size,),
                                 widths=(1,),
                                 table_widths=tuple(sorted({blocks, graphs.static.max_blocks})))
            step = step_input(False, False)
            other.static.update_tables(step)
            key = other.bucket(step)
            other.run(step, key)
            return device_ms(other.graphs[key].graph.replay)

        host["full_width_graph_device_ms"] = graph_at_width(graphs.static.max_blocks)
        # as wide as the case (the bare replay's width), timed the same way: what is left of
        # the gap to `graph_ms` is not the tables
        host["case_width_graph_device_ms"] = graph_at_width(table.shape[1])
        # a step of the overlapped loop: its tokens filled from the last step's samples
        host["engine_step_device_ms"] = device_ms(lambda: launch(True))
        host["engine_step_kernels"] = kernel_profile(lambda: launch(True), top=12)
        if profile:  # every kernel of the engine's graph, against the bare graph's
            host["engine_graph_kernels"] = kernel_profile(graph.replay, top=200)
    if profile:
        host["profile"] = host_profile(decode)
    return ms, host


def host_profile(fn, top: int = 15) -> list[dict]:
    """One call of fn under torch.profiler: the `top` host calls by self CPU time (ms)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [dict(name=e.key[:120], calls=e.count, cpu_ms=e.self_cpu_time_total / 1e3)
            for e in events[:top]]


def bench_ours(cfg: ModelConfig, decode_cases, prefill_lens, rows, graphs: bool,
               profile: bool = False, kv_cache_dtype: str = "bf16") -> None:
    model = build_model(cfg, dtype=torch.bfloat16, device=DEV)
    randomize_(model)
    max_seqs = max(b for b, _ in decode_cases)
    max_tokens = max(max(b * c for b, c in decode_cases), max(prefill_lens))
    blocks = max_tokens // BLOCK + max_seqs + 1
    # one slot more: the padding slot of the graph path
    caches = ModelCaches.allocate(cfg, num_blocks=blocks, block_size=BLOCK,
                                  num_slots=max_seqs + 1, dtype=torch.bfloat16, device=DEV,
                                  kv_cache_dtype=kv_cache_dtype, kv_scales=unit_scale_bank(cfg))
    vocab = cfg.vocab_size

    def step(batch: ForwardBatch, ids: torch.Tensor) -> torch.Tensor:
        hidden = model(ids, batch, caches)
        last = batch.num_tokens - 1 if batch.cu_seqlens.numel() == 2 else None
        rows_ = hidden[-1:] if last is not None else hidden
        return model.compute_logits(rows_).argmax(-1)

    with torch.inference_mode():
        for batch_size, ctx in decode_cases:
            per = -(-ctx // BLOCK)
            tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch_size)]
            ids = torch.randint(0, vocab, (batch_size,), device=DEV)

            def decode(ids=ids, tables=tables, batch_size=batch_size, ctx=ctx):
                b = ForwardBatch.build([ctx - 1] * batch_size, [1] * batch_size,
                                       list(range(batch_size)), tables, BLOCK, device=DEV)
                return step(b, ids)
            row = dict(model="ours", phase="decode", batch=batch_size, context=ctx,
                       ms=_timed(decode, 10))
            if profile:
                row["profile"] = kernel_profile(decode)
            if graphs:
                try:
                    b = ForwardBatch.build([ctx - 1] * batch_size, [1] * batch_size,
                                           list(range(batch_size)), tables, BLOCK, device=DEV)
                    step(b, ids)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step(b, ids)
                    row["graph_ms"] = _timed(graph.replay, 20)
                    row["graph_launch_host_ms"] = host_call_ms(graph.replay)
                    if profile:  # the replay's kernels (`profile` is the eager call's)
                        row["graph_kernels"] = kernel_profile(graph.replay, top=200)
                except Exception as exc:
                    row["graph_error"] = repr(exc)[:300]
                try:
                    row["engine_step_ms"], row["engine_step_host"] = engine_step_ms(
                        model, caches, cfg, batch_size, ctx, tables, profile=profile)
                except Exception as exc:
                    row["engine_step_error"] = repr(exc)[:300]
                gc.collect()  # the case's graphs and their pool
                torch.cuda.empty_cache()
            rows.add(row)
        for n in prefill_lens:
            tokens = torch.randint(0, vocab, (n,), device=DEV)
            table = [list(range(1, 2 + n // BLOCK))]

            def prefill(tokens=tokens, table=table, n=n):
                b = ForwardBatch.build([0], [n], [0], table, BLOCK, device=DEV)
                return step(b, tokens)
            ms = _timed(prefill, 3)
            row = dict(model="ours", phase="prefill", batch=1, tokens=n, ms=ms,
                       tok_per_s=n / ms * 1e3)
            if profile:
                row["profile"] = kernel_profile(prefill)
            rows.add(row)
    gc.collect()
    torch.cuda.empty_cache()


def bench_transformers(config: dict, decode_cases, prefill_lens, rows) -> None:
    import transformers
    from transformers import DynamicCache, Glm5NextConfig, Glm5NextForConditionalGeneration

    hf_cfg = Glm5NextConfig.from_dict(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            hf = Glm5NextForConditionalGeneration(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    hf = hf.eval().requires_grad_(False)
    randomize_(hf)
    text_cfg = hf.config.text_config
    vocab = text_cfg.vocab_size
    info = dict(model="transformers", version=transformers.__version__)
    with torch.inference_mode():
        for batch_size, ctx in decode_cases:
            row = dict(info, phase="decode", batch=batch_size, context=ctx)
            try:
                cache = DynamicCache(config=text_cfg)
                prompt = torch.randint(0, vocab, (batch_size, ctx - 1), device=DEV)
                out = hf(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
                state = {"cache": out.cache, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

                def decode(state=state):
                    o = hf(input_ids=state["next"], cache=state["cache"], use_cache=True)
                    state["cache"], state["next"] = o.cache, o.logits[:, -1].argmax(-1,
                                                                                   keepdim=True)
                row["ms"] = _timed(decode, 5)
            except torch.OutOfMemoryError as exc:
                row["error"] = "out of memory: " + str(exc)[:200]
            rows.add(row)
            gc.collect()
            torch.cuda.empty_cache()
        for n in prefill_lens:
            row = dict(info, phase="prefill", batch=1, tokens=n)
            try:
                prompt = torch.randint(0, vocab, (1, n), device=DEV)
                row["ms"] = _timed(lambda prompt=prompt: hf(input_ids=prompt, logits_to_keep=1),
                                   2)
                row["tok_per_s"] = n / row["ms"] * 1e3
            except torch.OutOfMemoryError as exc:
                row["error"] = "out of memory: " + str(exc)[:200]
            rows.add(row)
            gc.collect()
            torch.cuda.empty_cache()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class Results:
    """The rows of one run: each printed as it comes and the JSON file rewritten, so a run cut
    short by a time limit keeps what it measured."""

    def __init__(self, path: str | None, meta: dict):
        self.path, self.meta, self.rows = path, meta, []
        self.tag: dict = {}  # fields every row added from now on carries

    def add(self, row: dict) -> None:
        row = {**self.tag, **row}
        self.rows.append(row)
        print(row, flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(dict(self.meta, results=self.rows,
                               speedup_vs_transformers=self.speedups()), f, indent=2)

    def speedups(self) -> dict:
        """transformers ms / ours ms per case both ran (eager, and graph replay)."""
        out = {}
        for r in self.rows:
            if r.get("model") != "transformers" or "ms" not in r:
                continue
            key = ("context", "batch") if r["phase"] == "decode" else ("tokens", "batch")
            mine = [o for o in self.rows if o.get("model") == "ours"
                    and o["phase"] == r["phase"] and all(o.get(k) == r.get(k) for k in key)]
            if mine:
                name = f"{r['phase']}_b{r['batch']}_" + (
                    f"ctx{r['context']}" if r["phase"] == "decode" else f"n{r['tokens']}")
                out[name] = dict(eager=r["ms"] / mine[0]["ms"])
                if "graph_ms" in mine[0]:
                    out[name]["graph"] = r["ms"] / mine[0]["graph_ms"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--commit")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--hf-decode", default="1x2048,16x2048",
                    help="transformers decode cases BATCHxCONTEXT (it prefills each first)")
    ap.add_argument("--decode", default="1x2048,16x2048,64x2048,1x32768,16x32768,64x32768",
                    help="our decode cases BATCHxCONTEXT")
    ap.add_argument("--prefill", default="4096,16384", help="prefill lengths (both models)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager step of each of our cases: device time per "
                         "kernel (where prefill and eager decode spend their time)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="bf16",
                    help="our latent-cache formats, comma-separated (bf16, fp8, nvfp4): our "
                         "cases run once per format, rows tagged kv_cache_dtype")
    args = ap.parse_args()
    config = slice_config()
    cfg = ModelConfig.from_hf(config)
    def cases(text: str) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in case.split("x")) for case in text.split(",") if case]
    ours_decode, hf_decode = cases(args.decode), cases(args.hf_decode)
    prefill = [int(n) for n in args.prefill.split(",") if n]
    rows = Results(args.json, dict(
        benchmark="slice", layers="KDA+dense, KDA+MoE, KDA+MoE, DSA+MoE",
        device=torch.cuda.get_device_name(), commit=args.commit,
        date=datetime.now(UTC).isoformat(timespec="seconds"), torch=torch.__version__,
        fla=_version("fla-core")))
    rows.meta["kv_bytes_per_token"] = {}
    for kv in args.kv_cache_dtype.split(","):
        per_block, _ = cache_bytes(cfg, BLOCK, torch.bfloat16, False, kv_cache_dtype=kv)
        rows.meta["kv_bytes_per_token"][kv] = per_block / BLOCK
        rows.tag = {"kv_cache_dtype": kv}
        bench_ours(cfg, ours_decode, prefill, rows, graphs=not args.no_graphs,
                   profile=args.profile, kv_cache_dtype=kv)
        gc.collect()
        torch.cuda.empty_cache()
    rows.tag = {}
    if not args.no_transformers:
        try:
            bench_transformers(config, hf_decode, prefill, rows)
        except Exception as exc:
            rows.add(dict(model="transformers", error=repr(exc)[:500]))
    print(json.dumps(rows.speedups(), indent=1))


if __name__ == "__main__":
    main()
