"""The `glm53` command line, in-process: make-tiny and generate (ids, text, chat, errors)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from glm53.actors.config import ModelConfig
from glm53.deployments import tiny_model
from glm53.deployments.cli import _parser, main
from glm53.deployments.tokenizer import decode, load_tokenizer

CKPT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the embedded tiny model (built on demand) out of the real cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("GLM53_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-tiny", str(out), "--seed", "3", "--layers", "4", "--mtp"]) == 0
    return out


@pytest.fixture(scope="module")
def config(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "config.json").read_text())


def generate_all(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["generate", *args, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    results = generate_all(capsys, *args)
    assert len(results) == 1, results
    return results[0]


def check_output(result: dict[str, Any], model_dir: Path, max_tokens: int) -> list[int]:
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    ids = result["token_ids"]
    assert set(result) == {"token_ids", "text"}
    assert all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in ids)
    assert 1 <= len(ids) <= max_tokens
    if len(ids) < max_tokens:  # stopped early only on an end-of-sequence id
        assert ids[-1] in cfg.eos_token_ids
    assert not any(t in cfg.eos_token_ids for t in ids[:-1])
    assert result["text"] == decode(load_tokenizer(model_dir), ids)
    return ids


# ----- make-tiny -----

def test_make_tiny_writes_a_release_layout_checkpoint(ckpt: Path,
                                                      config: dict[str, Any]) -> None:
    for name in CKPT_FILES:
        assert (ckpt / name).is_file(), name
    text = config["text_config"]
    assert text["num_nextn_predict_layers"] == 1
    assert text["num_hidden_layers"] == 4
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    names = load_file(ckpt / "model.safetensors")
    assert "model.language_model.layers.4.eh_proj.weight" in names  # MTP on top of 4 layers
    assert "model.language_model.layers.3.self_attn.q_a_proj.weight" in names  # DSA layer 3


def test_make_tiny_is_deterministic_in_the_seed(ckpt: Path, tmp_path: Path) -> None:
    main(["make-tiny", str(tmp_path / "same"), "--seed", "3", "--layers", "4", "--mtp"])
    main(["make-tiny", str(tmp_path / "other"), "--seed", "4", "--layers", "4", "--mtp"])
    weights = (ckpt / "model.safetensors").read_bytes()
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != weights


def test_make_tiny_exl3_then_generate_with_its_4bit_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exl3"
    assert main(["make-tiny", str(out), "--layers", "4", "--exl3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3"
    names = load_file(out / "model.safetensors")
    stem = "model.language_model.layers.1.mlp.experts.0.down_proj"
    assert names[stem + ".trellis"].shape == (128 // 16, 128 // 16, 64)  # K4: 64 words a tile
    assert int(names[stem + ".mcg"]) == -877_912_083
    assert not any(n.endswith("experts.0.down_proj.weight") for n in names)
    check_output(generate(capsys, "--model", str(out), "--prompt-ids", "1,2,3",
                          "--max-tokens", "6"), out, 6)


def test_generate_quantize_experts_int4(ckpt: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from glm53.actors.layers import experts

    calls = []
    forward = experts.Int4Experts.forward
    monkeypatch.setattr(experts.Int4Experts, "forward",
                        lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
    check_output(generate(capsys, "--model", str(ckpt), "--prompt-ids", "1,2,3",
                          "--max-tokens", "6", "--quantize-experts", "int4"), ckpt, 6)
    assert calls  # the experts ran as int4 codes


# ----- generate -----

def test_generate_from_prompt_ids_greedy(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "8")
    first = generate(capsys, *args)
    check_output(first, ckpt, 8)
    assert generate(capsys, *args) == first


def test_generate_sampling_is_seeded(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "8",
            "--temperature", "1", "--top-p", "0.9", "--seed", "5")
    first = generate(capsys, *args)
    check_output(first, ckpt, 8)
    assert generate(capsys, *args) == first


@pytest.mark.parametrize("chat", [False, True])
def test_generate_from_text_prompt(ckpt: Path, capsys: pytest.CaptureFixture[str],
                                   chat: bool) -> None:
    args = ["--model", str(ckpt), "--prompt", "hello", "--max-tokens", "4"]
    check_output(generate(capsys, *args, *(["--chat"] if chat else [])), ckpt, 4)


def test_generate_human_readable_output(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    main(["generate", "--model", str(ckpt), "--prompt-ids", "5,6", "--max-tokens", "2"])
    out = capsys.readouterr().out
    assert "prompt ids: [5, 6]" in out
    assert "generated ids: [" in out


def test_generate_builds_the_embedded_model(capsys: pytest.CaptureFixture[str],
                                            _cache_dir: Path) -> None:
    target = _cache_dir / f"tiny-v{tiny_model.EMBEDDED_TINY_VERSION}"
    assert not target.exists()
    result = generate(capsys, "--prompt-ids", "1,2", "--max-tokens", "3")
    assert (target / "config.json").is_file()
    assert (target / "model.safetensors").is_file()
    check_output(result, target, 3)
    assert generate(capsys, "--prompt-ids", "1,2", "--max-tokens", "3") == result  # reused


# ----- bad input -----

@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x", "--max-tokens", "2"], "comma-separated"),
    (["--prompt-ids", "", "--max-tokens", "2"], "empty"),
])
def test_argument_errors(ckpt: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                         message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(ckpt), *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _exit_message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert isinstance(info.value.code, str)  # a message, exit status 1
    return info.value.code


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt-ids", "1", "--max-tokens", "2", "--temperature", "-1"], "--temperature"),
    (["--prompt-ids", "1", "--max-tokens", "2", "--top-p", "0"], "--top-p"),
])
def test_generation_parameter_errors(ckpt: Path, args: list[str], message: str) -> None:
    assert message in _exit_message(["generate", "--model", str(ckpt), *args])


def test_prompt_id_outside_vocab(ckpt: Path, config: dict[str, Any]) -> None:
    vocab = config["text_config"]["vocab_size"]
    argv = ["generate", "--model", str(ckpt), "--prompt-ids", f"1,{vocab}", "--max-tokens", "2"]
    assert f"[0, {vocab})" in _exit_message(argv)
    argv[4] = f"{vocab - 1}"  # the largest valid id is accepted
    assert main(argv) == 0


@pytest.mark.parametrize("exists", [True, False])
def test_model_dir_without_config(tmp_path: Path, exists: bool) -> None:
    model_dir = tmp_path / "empty"
    if exists:
        model_dir.mkdir()
    message = _exit_message(["generate", "--model", str(model_dir), "--prompt-ids", "1",
                             "--max-tokens", "2"])
    assert message.startswith("error: ")
    assert "config.json" in message


def test_broken_checkpoint_is_a_clean_error(ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.language_model.norm.weight"
    del tensors[name]
    save_file(tensors, broken / "model.safetensors")
    message = _exit_message(["generate", "--model", str(broken), "--prompt-ids", "1",
                             "--max-tokens", "2"])
    assert message.startswith("error: ")
    assert name in message


def test_unsupported_config_is_a_clean_error(ckpt: Path, tmp_path: Path,
                                             config: dict[str, Any]) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(ckpt, odd)
    bad = json.loads(json.dumps(config))
    bad["text_config"]["qk_rope_head_dim"] = 64
    (odd / "config.json").write_text(json.dumps(bad))
    message = _exit_message(["generate", "--model", str(odd), "--prompt-ids", "1",
                             "--max-tokens", "2"])
    assert message.startswith("error: ")
    assert "qk_rope_head_dim" in message


def test_several_prompts_run_together_and_print_in_order(ckpt: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    prompts = [["--prompt-ids", "5,6,7"], ["--prompt", "hello there"], ["--prompt-ids", "9"]]
    alone = [generate(capsys, "--model", str(ckpt), *p, "--max-tokens", "6") for p in prompts]
    together = generate_all(capsys, "--model", str(ckpt), *[a for p in prompts for a in p],
                            "--max-tokens", "6", "--max-num-batched-tokens", "5",
                            "--max-num-seqs", "2", "--block-size", "8", "--num-blocks", "64")
    assert together == alone


def test_engine_limit_errors_are_clean(ckpt: Path) -> None:
    base = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "4"]
    assert "max_model_len" in _exit_message([*base, "--max-model-len", "5"])
    assert "multiple of index_kpool" in _exit_message([*base, "--block-size", "6"])
    assert "cache budget too small" in _exit_message([*base, "--cache-bytes", "1K"])
    assert "at least one" in _exit_message(["generate", "--model", str(ckpt), "--max-tokens", "2"])


# ----- plan-memory -----

def test_plan_memory_of_the_release(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan-memory", "--tp", "2", "--ep", "2", "--dcp", "2", "--speculative", "mtp:3"]
    assert main([*args, "--release", "exl3"]) == 0
    out = capsys.readouterr().out
    assert "TP2/EP2/DCP2 rank 0 (routed experts: EXL3 4-bit)" in out
    assert "5 sequences of max_model_len 1,048,576" in out
    assert main(["plan-memory", "--release", "fp8"]) == 1  # bf16 experts: does not fit TP1
    err = capsys.readouterr().err
    assert "does not fit TP1/EP1/DCP1" in err and "--quantize-experts int4" in err
    assert main([*args, "--release", "fp8", "--quantize-experts", "int4"]) == 0
    assert "int4 (quantised at load)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"rank 2 is not in 0\.\.1"):
        main(["plan-memory", "--release", "exl3", "--tp", "2", "--rank", "2"])
    with pytest.raises(SystemExit, match="is /nowhere a DFlash draft directory"):
        main(["plan-memory", "--release", "exl3", "--speculative", "dflash:/nowhere"])


def test_plan_memory_counts_a_dflash_draft(capsys: pytest.CaptureFixture[str]) -> None:
    """The published DFlash2 (by name, no download): this rank's half of its weights (TP2) and
    a 20 MiB ring of its 4 KV heads per running slot and per prefix checkpoint are in the plan,
    and at 16 slots of 128K it still holds more tokens than MTP3."""
    args = ["plan-memory", "--release", "exl3", "--tp", "2", "--ep", "2", "--dcp", "2",
            "--max-model-len", "131072"]
    dflash = "dflash:incoai/GLM-5.3-Flash-DFlash2:7"
    assert main([*args, "--speculative", dflash]) == 0
    out = capsys.readouterr().out
    assert re.search(r"dflash_draft +1.28 GiB\n", out)
    # prefix caching (on by default): a ring per checkpoint too, one checkpoint per slot
    assert "(17 KDA state slots + 16 prefix checkpoints) x" in out
    assert "32 DFlash rings x 20.0 MiB" in out
    assert main([*args, "--speculative", dflash, "--prefix-checkpoints", "4"]) == 0
    assert "20 DFlash rings x 20.0 MiB" in capsys.readouterr().out
    assert main([*args, "--speculative", dflash, "--no-enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "= 17 KDA state slots x" in out and "16 DFlash rings x 20.0 MiB" in out
    assert main([*args, "--speculative", "mtp:3", "--no-enable-prefix-caching"]) == 0
    tokens = [int(line.split()[1].replace(",", "")) for line in
              (out + capsys.readouterr().out).splitlines() if line.startswith("  capacity")]
    assert tokens[0] > tokens[1]  # DFlash vs MTP3 at 16 running sequences
    # the fp8 ring: 128 e4m3 codes + a 4 B scale per row, 10.3 MiB a sequence
    assert main([*args, "--speculative", dflash, "--draft-kv-cache-dtype", "fp8"]) == 0
    assert "32 DFlash rings x 10.3 MiB (fp8)" in capsys.readouterr().out


def test_plan_memory_follows_the_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    tokens = {}
    for dtype in ("auto", "fp8", "nvfp4"):
        assert main(["plan-memory", "--release", "exl3", "--tp", "2", "--ep", "2", "--dcp", "2",
                     "--kv-cache-dtype", dtype]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "capacity" in x)
        tokens[dtype] = int(line.split()[1].replace(",", ""))
    # bf16 latents 1,024 B, fp8 528 B, nvfp4 304 B per token and layer (+ 33 B of pool keys)
    assert 1.6 < tokens["fp8"] / tokens["auto"] < 2.0
    assert 1.5 < tokens["nvfp4"] / tokens["fp8"] < 1.8


@pytest.mark.parametrize("flags, has_cuda, placement", [
    (["--tp", "2", "--ep", "2", "--dcp", "2"], False, ("cpu", 2)),
    (["--tp", "2", "--num-replicas", "2"], False, ("cpu", 4)),
    (["--dcp", "2", "--device", "cpu"], True, ("cpu", 2)),
    (["--tp", "2"], True, ("cuda", None)),  # Ray counts the real GPUs
    ([], False, ("cpu", None)),  # one rank runs in the replica: no GPU to reserve
])
def test_serve_on_cpu_gives_each_rank_a_fake_gpu(flags, has_cuda, placement):
    """`glm53 serve --tp 2` on a machine without GPUs: its private Ray gets one fake GPU per
    rank of every replica, so the replicas' GPU bundles can be placed (they never could)."""
    from glm53.deployments.serve_cli import local_placement, serving_config

    config = serving_config(_parser().parse_args(["serve", "--speculative", "none", *flags]))
    assert local_placement(config, has_cuda) == placement


@pytest.mark.slow  # starts a private Ray in a subprocess
def test_serve_starts_a_private_ray_on_loopback():
    """Without RAY_ADDRESS, `glm53 serve` starts its own Ray whose listeners (GCS, raylet,
    workers) bind 127.0.0.1, not the machine's network address (a fresh process: the switch
    is read when ray is imported), with the fake GPUs it is given."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    code = ("from glm53.deployments.serve_cli import _start_ray\n"
            "ray = _start_ray(num_gpus=2)\n"
            "print(ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address,\n"
            "      ray.cluster_resources().get('GPU'))\n"
            "ray.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    node_ip, gcs, gpus = out[-3:]
    assert node_ip == "127.0.0.1" and gcs.startswith("127.0.0.1:"), out
    assert gpus == "2.0", out


# ----- calibrate-kv -----

def test_calibrate_kv_is_deterministic_and_feeds_the_nvfp4_cache(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\n\njumps over the lazy dog twice\n")
    with pytest.raises(SystemExit, match="no nvfp4 KV scale bank.*calibrate-kv"):
        generate(capsys, "--model", str(ckpt), "--prompt-ids", "1,2,3", "--max-tokens", "2",
                 "--kv-cache-dtype", "nvfp4")
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for out in (first, second):
        assert main(["calibrate-kv", "--model", str(ckpt), "--prompts", str(prompts),
                     "--output", str(out)]) == 0
    assert first.read_bytes() == second.read_bytes()
    assert set(json.loads(first.read_text())["scales"]) == {"3", "mtp"}
    check_output(generate(capsys, "--model", str(ckpt), "--prompt-ids", "1,2,3",
                          "--max-tokens", "5", "--kv-cache-dtype", "nvfp4",
                          "--kv-scale-bank", str(first)), ckpt, 5)


@pytest.mark.parametrize("text, expected", [
    ("none", (None, 0, None, False)),
    ("mtp", ("mtp", 3, None, False)),
    ("mtp:2", ("mtp", 2, None, False)),
    ("mtp:auto", ("mtp", 3, None, True)),
    ("mtp:5:auto", ("mtp", 5, None, True)),
    ("dflash:/d", ("dflash", 7, "/d", False)),
    ("dflash:/d:auto", ("dflash", 7, "/d", True)),
    ("dflash:/d:4:auto", ("dflash", 4, "/d", True)),
])
def test_speculative_flag_fixed_and_adaptive(text: str, expected: tuple) -> None:
    args = _parser().parse_args(["generate", "--prompt-ids", "1", "--max-tokens", "2",
                                 "--speculative", text])
    assert tuple(args.speculative) == expected


@pytest.mark.parametrize("text", ["mtp:x", "mtp:2:3", "dflash", "eagle:auto"])
def test_speculative_flag_errors(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "--prompt-ids", "1", "--max-tokens", "2",
                                 "--speculative", text])
    assert "--speculative" in capsys.readouterr().err


@pytest.mark.parametrize("flags, on", [([], True), (["--enable-prefix-caching"], True),
                                       (["--no-enable-prefix-caching"], False)])
def test_serve_prefix_caching_switch_reaches_the_engine(flags, on):
    from glm53.deployments.serve_cli import serving_config

    args = ["serve", "--speculative", "none", "--prefix-checkpoints", "3",
            "--prefix-checkpoint-interval", "64", *flags]
    engine = serving_config(_parser().parse_args(args)).engine_config("m", "cpu")
    assert engine.prefix_caching is on
    assert (engine.num_prefix_checkpoints, engine.prefix_checkpoint_interval) == (3 * on, 64)


def test_prefix_caching_by_default_gives_way_but_an_explicit_one_is_refused():
    """On by default: settings that cannot have it (a checkpoint interval off the block) turn
    it off (the engine logs why: test_prefix_cache.py); asked for explicitly, they are
    refused."""
    from glm53.deployments.serve_cli import serving_config

    args = ["serve", "--speculative", "none", "--block-size", "24"]
    config = serving_config(_parser().parse_args(args))
    assert not config.prefix_caching and not config.prefix_routing_enabled
    engine = config.engine_config("m", "cpu")
    assert engine.enable_prefix_caching is None and engine.num_prefix_checkpoints == 0
    with pytest.raises(ValueError, match="prefix_checkpoint_interval 2048 must be a positive "
                                         r"multiple of the block \(24 tokens"):
        serving_config(_parser().parse_args([*args, "--enable-prefix-caching"])
                       ).engine_config("m", "cpu")
