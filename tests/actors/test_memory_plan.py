"""Memory plan of the real GLM-5.3-Flash, built on the meta device (no memory used: runs on CPU).

Expected bytes are hand arithmetic from the model facts (glm53-model.md §1-2, §4-5; exl3 layout:
exl3-dflash-spec.md §A.3), never a second call of the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glm53.actors import loader
from glm53.actors.config import ModelConfig
from glm53.actors.loader import build_model, load_model, with_expert_format
from glm53.actors.memory_plan import (
    GiB,
    MemoryPlanError,
    MiB,
    graph_workspace,
    plan_for_config,
    plan_memory,
    weight_bytes,
    workspace_estimate,
)
from glm53.actors.parallel import ParallelConfig, ParallelState
from glm53.actors.release import exl3_release_config, release_config

# ----- model facts (glm53-model.md §1.2, §2) -----
V, D = 154880, 4096  # vocab, hidden
N_KDA, N_DSA, N_DENSE, N_MOE = 34, 11, 3, 42  # trunk layers; MTP adds one DSA + MoE layer
E, I, FF = 288, 2048, 12288  # routed experts, expert width, dense FFN width
LIN = 64 * 128  # KDA heads x head dim
BF16, FP16, FP32 = 2, 2, 4

# one routed expert = gate, up [I, D] and down [D, I]: 3 matrices of D x I weights
EXPERT = {
    "bf16": 3 * D * I * BF16,
    # EXL3 K4: trellis at 4 bits per weight + fp16 input (suh) and output (svh) scale vectors
    "exl3": 3 * (D * I * 4 // 8 + (D + I) * FP16),
    # int4: two codes per byte + fp16 scale and zero per 128 input columns of every output row
    "int4": 3 * (D * I // 2 + 2 * FP16 * D * I // 128),
}
EXPERT["fp8"] = EXPERT["bf16"]  # dequantised to bf16 while loading


def kda_layer(tp: int) -> int:
    """§2.3: q/k/v/f_b/g_b/b sharded by heads, o_proj by input; f_a, g_a, o_norm replicated;
    conv taps, dt_bias, A_log in fp32."""
    w, heads = LIN // tp, 64 // tp
    bf16 = 3 * w * D + D * w + 2 * (128 * D + w * 128) + heads * D + 128
    fp32 = 3 * w * 4 + w + heads
    return bf16 * BF16 + fp32 * FP32


def dsa_layer(tp: int) -> int:
    """§2.4: MLA (q_b, kv_b, o_proj sharded by heads; q_a, kv_a and their norms replicated) +
    the replicated indexer (its pooling ape and its head weights in fp32)."""
    heads = 64 // tp
    mla = (1536 * D + 1536 + heads * 256 * 1536 + 512 * D + 512 + heads * 512 * 512
           + D * heads * 256)
    indexer = 32 * 128 * 1536 + 128 * D + 2 * 128 + 128 * D
    return (mla + indexer) * BF16 + (4 * 128 + 32 * D) * FP32


def router() -> int:
    return (E * D + E) * FP32  # fp32 gate + correction bias, replicated


def shared_expert(tp: int) -> int:
    return 3 * D * I // tp * BF16


def expected_parts(fmt: str, tp: int, ep: int, with_mtp: bool = True) -> dict[str, int]:
    routed = E // ep * EXPERT[fmt]
    mtp = (5 * D * BF16  # enorm, hnorm, two block norms, shared_head norm
           + 2 * D * D * BF16  # eh_proj [D, 2D], replicated
           + dsa_layer(tp) + router() + shared_expert(tp) + routed)
    return {
        "embedding": V // tp * D * BF16,
        "kda": N_KDA * kda_layer(tp),
        "dsa": N_DSA * dsa_layer(tp),
        "dense_ffn": N_DENSE * 3 * D * FF // tp * BF16,
        "shared_experts": N_MOE * shared_expert(tp),
        "routers": N_MOE * router(),
        "routed_experts": N_MOE * routed,
        # mHC: per site fn [24, 4D] + base [24] + scale [3] in fp32, 2 sites per layer;
        # 2 block norms per layer + the final norm
        "mhc+norms": 45 * 2 * (24 * 4 * D + 24 + 3) * FP32 + (45 * 2 + 1) * D * BF16,
        "lm_head": V // tp * D * BF16,
        "mtp": mtp if with_mtp else 0,
    }


def configs() -> dict[str, ModelConfig]:
    bf16 = release_config()
    del bf16["quantization_config"]  # the BF16 release: same config without FP8 scales
    fp8 = ModelConfig.from_hf(release_config())
    return {
        "bf16": ModelConfig.from_hf(bf16),
        "fp8": fp8,
        "exl3": ModelConfig.from_hf(exl3_release_config()),
        "int4": with_expert_format(fp8, "int4"),  # --quantize-experts int4 on the FP8 release
    }


LAYOUTS = {"TP1": (ParallelConfig(), 0), "TP2/EP2/DCP2 r0": (ParallelConfig(2, 2, 2), 0),
           "TP2/EP2/DCP2 r1": (ParallelConfig(2, 2, 2), 1)}


@pytest.fixture(scope="module")
def meta_model():
    """fmt, layout -> the release model on the meta device (cached: built once per module)."""
    cfgs, built = configs(), {}

    def get(fmt: str, layout: str, with_mtp: bool = True):
        key = (fmt, layout, with_mtp)
        if key not in built:
            par, rank = LAYOUTS[layout]
            built[key] = build_model(cfgs[fmt], with_mtp=with_mtp, device="meta",
                                     ps=ParallelState(par, rank))
        return built[key]
    return get


def test_release_config_has_the_documented_numbers() -> None:
    cfg = ModelConfig.from_hf(release_config())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (V, D, 45)
    assert (len(cfg.kda_layers), cfg.dsa_layers) == (N_KDA, tuple(range(3, 45, 4)))
    assert cfg.mlp_layer_types.count("dense") == N_DENSE and cfg.mlp_layer_types[:3] == (
        "dense",) * 3
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (E, 8, I)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (64, 1536, 512)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool) == (
        32, 128, 2048, 4)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel) == (64, 128, 4)
    assert (cfg.hc_mult, cfg.max_position_embeddings, cfg.num_nextn_predict_layers) == (
        4, 1048576, 1)
    assert (cfg.dtype, cfg.fp8_block_size, cfg.expert_format, cfg.has_vision) == (
        "bfloat16", (128, 128), "dense", True)
    exl3 = ModelConfig.from_hf(exl3_release_config())
    assert (exl3.expert_format, exl3.exl3_bits, exl3.fp8_block_size) == ("exl3", 4, None)
    assert dataclasses.replace(exl3, expert_format="dense", exl3_bits=0, exl3_codebook=0,
                               fp8_block_size=(128, 128)) == cfg


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "exl3", "int4"])
def test_weight_bytes_match_hand_counts(meta_model, fmt: str, layout: str) -> None:
    par = LAYOUTS[layout][0]
    assert weight_bytes(meta_model(fmt, layout)) == expected_parts(fmt, par.tp, par.ep)


def test_trunk_total_matches_the_published_parameter_count(meta_model) -> None:
    """glm53-model.md §5 / performance.md §1: 313,326,811,966 trunk params (313.3 B) and a
    7,432,592,416-param MTP layer. bf16 weights are 2 B per param plus 2 B more for each param
    the model keeps in fp32 (mHC, routers, KDA conv taps / dt_bias / A_log, indexer ape and
    head weights)."""
    fp32_trunk = (45 * 2 * 393_243 + N_MOE * (E * D + E) + N_KDA * (3 * LIN * 4 + LIN + 64)
                  + N_DSA * (4 * 128 + 32 * D))
    parts = weight_bytes(meta_model("bf16", "TP1", with_mtp=False))
    assert sum(parts.values()) == 2 * 313_326_811_966 + 2 * fp32_trunk
    fp32_mtp = E * D + E + 4 * 128 + 32 * D
    assert weight_bytes(meta_model("bf16", "TP1"))["mtp"] == 2 * 7_432_592_416 + 2 * fp32_mtp
    # all routed experts incl. the MTP layer's: 43 MoE layers x 288 x 3 x D x I x 2 B
    assert N_MOE * E * EXPERT["bf16"] + E * EXPERT["bf16"] == 43 * 288 * 3 * 4096 * 2048 * 2


def _plan(model, device_gib: float, **kw):
    block = 16 * model.parallel.dcp_size  # the runner's logical block for --block-size 16
    return plan_memory(model, int(device_gib * GiB), 0.9, block_size=block, num_slots=16,
                       num_spec=3, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_release_plans_like_bf16(meta_model, layout: str) -> None:
    """The FP8 release's weights are dequantised to bf16 while loading (weights.py): the device
    holds exactly the BF16 release's tensors, so the plans agree (only the label differs)."""
    bf16, fp8 = (_plan(meta_model(f, layout), 139) for f in ("bf16", "fp8"))
    assert "FP8" in fp8.experts
    assert dataclasses.replace(fp8, experts=bf16.experts) == bf16


def test_ranks_plan_alike(meta_model) -> None:
    for fmt in ("exl3", "int4"):
        r0, r1 = (_plan(meta_model(fmt, f"TP2/EP2/DCP2 r{r}"), 139) for r in (0, 1))
        assert dataclasses.replace(r1, layout=r0.layout) == r0


# per-rank cache bytes (§4), bf16 cache, MTP layer on, 3 drafts: DSA layers incl. MTP = 12
N_DSA_CACHED = N_DSA + 1
RING = 4 * 2  # indexer ring rows: kpool x ceil((kpool + 3 drafts) / kpool)


def slot_bytes(tp: int) -> int:
    """KDA conv window (3 x q|k|v channels, bf16) + fp32 state per layer; indexer ring per DSA."""
    kda = 3 * LIN // tp * 3 * BF16 + 64 // tp * 128 * 128 * FP32
    return N_KDA * kda + N_DSA_CACHED * RING * 2 * 128 * BF16


def block_bytes(block: int, dcp: int) -> int:
    """A block of `block` tokens: block / dcp latent rows of 512 + block / 4 pooled keys of 128."""
    return N_DSA_CACHED * BF16 * (block // dcp * 512 + block // 4 * 128)


def graph_row_bytes(tp: int, verify: bool, n_taps: int = 0) -> int:
    """One row of the CUDA graphs' shared outputs: hidden (+ taps) bf16, fp32 logits, and when
    verifying, per KDA layer the replay: in_proj output (q|k|v + beta logits), q, k, v bf16
    and g, beta fp32."""
    heads = 64 // tp
    replay = (3 * heads * 128 + heads + 3 * heads * 128) * BF16 + (heads * 128 + heads) * FP32
    return (1 + n_taps) * D * BF16 + V * FP32 + verify * N_KDA * replay


def test_graph_workspace_is_one_shared_set_of_outputs(meta_model) -> None:
    """The graphs' bytes: num_slots x (1 + num_spec) rows, at most the graphs' cap (512 by
    default), of shared outputs (exact) and of the largest graph's scratch (1 MiB + 1.5 B per
    token of context), however many buckets and widths are captured."""
    cfg = meta_model("exl3", "TP2/EP2/DCP2 r0").config
    kw = dict(max_model_len=8192, dtype=torch.bfloat16, tp_size=2)
    act = MiB + 8192 * 3 // 2
    assert graph_row_bytes(2, True) == 8192 + 619_520 + 34 * 65_728  # 2.73 MiB a row at TP2
    # MTP3 at 384 slots: 1536 rows without a cap (15 GB of replay + 5.4 GB of logits kept per
    # graph before the outputs were shared; 4.1 GiB of outputs shared), 512 under the default
    # cap (1.4 GiB; batches over 128 verify eagerly)
    assert graph_workspace(cfg, num_slots=384, num_spec=3, max_tokens=10**6, **kw) == (
        384 * 4 * (act + graph_row_bytes(2, True)))
    assert graph_workspace(cfg, num_slots=384, num_spec=3, **kw) == (
        512 * (act + graph_row_bytes(2, True)))
    assert graph_workspace(cfg, num_slots=384, num_spec=7, **kw) == (
        512 * (act + graph_row_bytes(2, True)))  # DFlash's 8-token steps: the same cap
    assert graph_workspace(cfg, num_slots=16, num_spec=0, **kw) == (
        16 * (act + graph_row_bytes(2, False)))
    # a DFlash draft's 5 tap layers, 7 drafts
    assert graph_workspace(cfg, num_slots=16, num_spec=7, n_taps=5, **kw) == (
        16 * 8 * (act + graph_row_bytes(2, True, n_taps=5)))
    # the eager step comes on top
    assert workspace_estimate(cfg, max_num_batched_tokens=2048, num_slots=16, num_spec=3,
                              **kw) == 2048 * act + 16 * 4 * (act + graph_row_bytes(2, True))


def test_slot_and_block_bytes_match_hand_counts(meta_model) -> None:
    assert slot_bytes(1) - N_DSA_CACHED * RING * 512 == 147_619_840  # §4.1: 140.8 MiB
    plan = _plan(meta_model("exl3", "TP2/EP2/DCP2 r0"), 139)
    assert (plan.bytes_per_slot, plan.bytes_per_block) == (slot_bytes(2), block_bytes(32, 2))


def test_bf16_release_does_not_fit_one_h200(meta_model) -> None:
    plan = plan_memory(meta_model("bf16", "TP1"), 141 * GiB, 0.9, block_size=16, num_slots=16,
                       num_spec=3, reserve_bytes=6 * GiB)
    weights = sum(expected_parts("bf16", 1, 1).values())
    need = weights + 6 * GiB + 17 * slot_bytes(1) + (1 + 2048 // 16) * block_bytes(16, 1)
    short = need - int(141 * GiB * 0.9)
    with pytest.raises(MemoryPlanError) as err:
        plan.check()
    msg = str(err.value)
    for part in (f"weights {weights / GiB:.2f} GiB per rank", "141.00 GiB x 0.9",
                 f"{int(141 * GiB * 0.9) / GiB:.2f} GiB", f"{short / GiB:.2f} GiB short",
                 "bfloat16", "EXL3", "--quantize-experts int4", "--tp/--ep",
                 "another checkpoint"):
        assert part in msg, f"{part!r} not in: {msg}"
    assert isinstance(err.value, ValueError)


def test_exl3_k4_fits_an_h200_pair(meta_model) -> None:
    """Rank 0 of TP2/EP2/DCP2 on a 139 GiB H200 at utilisation 0.9, 16 sequences, MTP3."""
    plan = _plan(meta_model("exl3", "TP2/EP2/DCP2 r0"), 139)
    assert plan.check() is plan, plan.describe()
    weights = sum(expected_parts("exl3", 2, 2).values())
    # reserve estimate: 2 GiB overhead + (2048-token prefill + 16 x 4-token verify graph) x
    # (1 MiB + 1.5 B per token of the 1M context) + the graphs' shared outputs of 16 x 4 rows
    reserve = (2 * GiB + (2048 + 16 * 4) * (MiB + 1048576 * 3 // 2)
               + 16 * 4 * graph_row_bytes(tp=2, verify=True))
    pool = int(139 * GiB * 0.9) - weights - reserve
    blocks = (pool - 17 * slot_bytes(2)) // block_bytes(32, 2)
    got = (plan.weight_bytes, plan.reserve_bytes, plan.kv_pool_bytes, plan.num_blocks,
           plan.num_tokens)
    want = (weights, reserve, pool, blocks, (blocks - 1) * 32)
    assert got == want, f"{got} != {want}\n{plan.describe()}"
    assert plan.num_tokens > 5_000_000 and plan.num_sequences == 5, plan.describe()
    for line in ("EXL3 4-bit", "routed_experts", "5 sequences of max_model_len 1,048,576"):
        assert line in plan.describe()
    # the plan-memory CLI core builds the same model and plans alike
    assert plan_for_config(exl3_release_config(), device_bytes=139 * GiB, tp=2, ep=2, dcp=2,
                           with_mtp=True, num_spec=3) == plan


def test_int4_fits_an_h200_pair_too(meta_model) -> None:
    plan = _plan(meta_model("int4", "TP2/EP2/DCP2 r0"), 139).check()
    assert plan.weights["routed_experts"] == N_MOE * 144 * EXPERT["int4"]
    assert plan.num_sequences >= 4, plan.describe()


def test_load_model_refuses_before_allocating(tiny_checkpoint, monkeypatch) -> None:
    model_dir = tiny_checkpoint

    def check(model):
        plan_memory(model, 1 * MiB, 0.9, block_size=16, num_slots=4).check()

    def no_allocation(*args, **kwargs):
        pytest.fail("parameters were allocated before the memory check refused the model")

    with monkeypatch.context() as m:
        m.setattr(loader, "materialize", no_allocation)
        with pytest.raises(MemoryPlanError, match="does not fit"):
            load_model(model_dir, progress=False, check_memory=check)
    # a device that fits: the model loads, and the plan counted exactly what was allocated
    plans = []
    model = load_model(model_dir, progress=False, check_memory=lambda meta: plans.append(
        plan_memory(meta, 64 * GiB, 0.9, block_size=16, num_slots=4).check()))
    assert next(model.parameters()).device == torch.device("cpu")
    assert weight_bytes(model) == plans[0].weights


def test_start_up_log_carries_the_memory_plan(meta_model) -> None:
    """The cache capacity line the engine logs at start-up (and `glm53 serve` prints) is
    followed by the rank's memory plan when one was made (CUDA runners)."""
    from glm53.actors.caches import plan_cache

    model = meta_model("exl3", "TP2/EP2/DCP2 r0")
    plan = _plan(model, 139)
    cache = plan_cache(model.config, 32, 17, torch.bfloat16, True, num_blocks=plan.num_blocks,
                       ps=model.parallel, num_spec=3)
    text = dataclasses.replace(cache, memory_plan=plan.describe()).describe(131072)
    assert text.startswith("KV cache: ") and text.endswith(plan.describe())
    assert "memory plan" not in cache.describe(131072)  # CPU runners plan no device memory
