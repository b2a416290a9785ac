"""Serving config: profiles, explicit overrides, strictness, not-supported-yet features, the
EngineConfig and Serve options it produces, and `glm53 serve` flags (no Ray started)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from glm53.deployments.app import build_app
from glm53.deployments.cli import _parser, main
from glm53.deployments.config import (
    CPU_CACHE_BYTES,
    PROFILES,
    NotSupportedYetError,
    ServingConfig,
)
from glm53.deployments.serve_cli import exposure_warnings, proxy_options, serving_config


def test_profiles_mirror_the_reference_runtime():
    assert set(PROFILES) == {"lang-mtp3", "lang-dflash2", "mm-dflash2", "long500k"}
    default = ServingConfig()
    assert default.profile == "lang-mtp3"
    assert (default.vision, default.max_model_len) == (False, 131_072)
    assert (default.speculative.method, default.speculative.num_speculative_tokens) == ("mtp", 3)
    dflash = ServingConfig(profile="lang-dflash2")
    assert (dflash.speculative.method, dflash.max_model_len, dflash.vision) == (
        "dflash", 98_304, False)
    mm = ServingConfig(profile="mm-dflash2")
    assert (mm.vision, mm.max_model_len) == (True, 98_304)
    long = ServingConfig(profile="long500k")
    assert (long.max_model_len, long.max_num_batched_tokens, long.max_num_seqs) == (
        499_968, 1024, 1)


def test_explicit_fields_override_the_profile():
    c = ServingConfig(profile="long500k", max_model_len=8192, speculative="none")
    assert (c.max_model_len, c.max_num_seqs, c.speculative.enabled) == (8192, 1, False)
    assert not c.from_profile("max_model_len") and c.from_profile("max_num_seqs")
    assert ServingConfig.model_validate({"speculative": "mtp:2"}).speculative \
        .num_speculative_tokens == 2
    assert ServingConfig(speculative={"method": "dflash"}).speculative.num_speculative_tokens == 7


@pytest.mark.parametrize("bad", [
    {"unknown_field": 1}, {"profile": "nope"}, {"tensor_parallel_size": 0},
    {"max_num_seqs": "many"}, {"cache_bytes": 10, "num_blocks": 10},
    {"speculative": {"method": "none", "num_speculative_tokens": 2}},
    {"speculative": {"method": "eagle"}}, {"kv_cache_dtype": "int3"},
])
def test_invalid_configs_are_rejected(bad):
    with pytest.raises(ValidationError):
        ServingConfig.model_validate(bad)


def test_unimplemented_features_fail_clearly():
    ServingConfig().check_supported()  # lang-mtp3: MTP speculative decoding is implemented
    # until DFlash lands in the engine: not supported; after: it needs the drafter
    dflash = (r"speculative decoding with dflash \(from profile lang-dflash2\) (is not "
              r"supported yet|needs the drafter checkpoint)")
    with pytest.raises(NotSupportedYetError, match=dflash):
        ServingConfig(profile="lang-dflash2").check_supported()
    ServingConfig(profile="mm-dflash2", speculative="none").check_supported()  # vision works
    assert ServingConfig(profile="mm-dflash2", speculative="none").engine_config(
        "/ckpt", "cpu").vision
    ServingConfig(kv_cache_dtype="fp8").check_supported()  # quantised KV caches are served
    with pytest.raises(NotSupportedYetError):  # before anything is deployed
        build_app({"profile": "lang-dflash2"})


def test_engine_config_and_deployment_options():
    c = ServingConfig(speculative="none", max_model_len=512, max_num_seqs=4, seed=3,
                      tensor_parallel_size=2, decode_context_parallel_size=2)
    e = c.engine_config("/ckpt", "cpu")
    assert (e.model, e.device, e.max_model_len, e.max_num_seqs, e.seed) == (
        "/ckpt", "cpu", 512, 4, 3)
    assert e.cache_bytes == CPU_CACHE_BYTES and e.num_blocks is None
    assert (e.tensor_parallel_size, e.decode_context_parallel_size, e.world_size) == (2, 2, 2)
    assert e.max_waiting_requests == c.max_waiting_requests and not e.with_mtp
    assert (e.speculative_method, e.num_speculative_tokens) == (None, 0)
    mtp = ServingConfig().engine_config("/ckpt", "cpu")
    assert (mtp.speculative_method, mtp.num_speculative_tokens, mtp.with_mtp) == ("mtp", 3, True)
    assert c.engine_config("/ckpt", "cuda").cache_bytes is None  # sized from GPU memory
    # a pair replica reserves the engine (bundle 0, where Serve puts the replica) and one GPU
    # per rank in one STRICT_PACK group, on GPUs and on CPU (fake GPUs) alike
    for device in ("cpu", "cuda"):
        pair = c.server_deployment_options(device)
        assert pair["ray_actor_options"] == {"num_cpus": 1}
        assert pair["placement_group_bundles"] == [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}]
        assert pair["placement_group_strategy"] == "STRICT_PACK"
    single = ServingConfig(speculative="none").server_deployment_options("cuda")
    assert single["ray_actor_options"]["num_gpus"] == 1
    assert "placement_group_bundles" not in single
    assert ServingConfig(speculative="none").server_deployment_options("cpu")[
        "ray_actor_options"] == {"num_cpus": 0}


def test_model_name():
    assert ServingConfig().model_name == "glm53-tiny"
    assert ServingConfig(model="/m/GLM-5.3-Flash").model_name == "GLM-5.3-Flash"
    assert ServingConfig(model="/m/x", served_model_name="glm").model_name == "glm"


def test_serve_flags_override_profile_only_when_given(monkeypatch):
    monkeypatch.delenv("GLM53_API_KEYS", raising=False)
    monkeypatch.delenv("GLM53_API_KEY", raising=False)
    args = _parser().parse_args(["serve", "--profile", "long500k", "--speculative", "none",
                                 "--tp", "2", "--max-num-seqs", "3", "--cache-bytes", "64M",
                                 "--no-vision"])
    c = serving_config(args)
    assert (c.profile, c.tensor_parallel_size, c.max_num_seqs, c.cache_bytes) == (
        "long500k", 2, 3, 64 * 2**20)
    assert (c.max_model_len, c.max_num_batched_tokens, c.vision) == (499_968, 1024, False)
    assert not c.speculative.enabled
    args = _parser().parse_args(["serve", "--speculative", "mtp", "--num-speculative-tokens",
                                 "1"])
    assert serving_config(args).speculative.num_speculative_tokens == 1
    default = _parser().parse_args(["serve"])
    assert (default.host, default.port) == ("127.0.0.1", 8000)
    assert serving_config(default) == ServingConfig(
        http={"allowed_hosts": ["localhost", "127.0.0.1", "::1"]})


def test_serve_http_security_flags(monkeypatch):
    """Keys from flags and from this shell's environment (a joined cluster does not see it),
    limits, and the Host default: localhost names on loopback, any beyond it with warnings."""
    monkeypatch.setenv("GLM53_API_KEYS", "env-a,env-b")
    monkeypatch.setenv("GLM53_API_KEY", "env-c")
    args = _parser().parse_args(
        ["serve", "--api-key", "flag-a", "--api-key", "flag-b", "--max-request-bytes", "1M",
         "--body-timeout", "5", "--allowed-origins", "https://a.example,https://b.example",
         "--request-timeout", "900", "--keep-alive-timeout", "75"])
    http = serving_config(args).http
    assert [k.get_secret_value() for k in http.api_keys] == [
        "flag-a", "flag-b", "env-a", "env-b", "env-c"]
    assert (http.max_request_bytes, http.body_timeout_s) == (2**20, 5.0)
    assert http.allowed_origins == ("https://a.example", "https://b.example")
    assert http.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert proxy_options(args) == {"host": "127.0.0.1", "port": 8000,
                                   "request_timeout_s": 900.0, "keep_alive_timeout_s": 75}
    assert exposure_warnings(args, serving_config(args)) == []

    monkeypatch.delenv("GLM53_API_KEYS")
    monkeypatch.delenv("GLM53_API_KEY")
    public = _parser().parse_args(["serve", "--host", "0.0.0.0"])
    config = serving_config(public)
    assert config.http.allowed_hosts is None and config.http.api_keys == ()
    warnings = exposure_warnings(public, config)
    assert len(warnings) == 2 and "without an API key" in warnings[0]
    assert proxy_options(public) == {"host": "0.0.0.0", "port": 8000}
    named = _parser().parse_args(["serve", "--host", "::", "--allowed-hosts", "api.example",
                                  "--api-key", "k"])
    assert serving_config(named).http.allowed_hosts == ("api.example",)
    assert exposure_warnings(named, serving_config(named)) == []


def test_serve_refuses_unimplemented_profile_features_before_starting_ray():
    with pytest.raises(SystemExit, match="dflash .*(not supported yet|drafter checkpoint)"):
        main(["serve", "--profile", "lang-dflash2"])


def test_build_app_is_the_serve_import_path():
    import importlib

    from ray.serve import Application

    module, _, name = "glm53.deployments.app:build_app".partition(":")
    build = getattr(importlib.import_module(module), name)
    app = build({"model": "/ckpt/GLM", "speculative": "none", "device": "cpu"})
    assert isinstance(app, Application)


def test_dflash_needs_its_draft_checkpoint():
    with pytest.raises(NotSupportedYetError, match="needs the drafter checkpoint"):
        ServingConfig(profile="lang-dflash2").check_supported()
    ServingConfig(profile="lang-dflash2", speculative={
        "method": "dflash", "draft_model": "/drafts/dflash2"}).check_supported()


def test_enforce_eager_flag_reaches_the_engine_config():
    eager = serving_config(_parser().parse_args(["serve", "--enforce-eager"]))
    assert eager.engine_config("m", "cuda").enforce_eager
    assert not serving_config(_parser().parse_args(["serve"])).engine_config(
        "m", "cuda").enforce_eager
    gen = ["generate", "--prompt-ids", "1", "--max-tokens", "1"]
    assert _parser().parse_args([*gen, "--enforce-eager"]).enforce_eager
    assert not _parser().parse_args(gen).enforce_eager


def test_async_scheduling_flag_reaches_the_engine_config():
    overlapped = serving_config(_parser().parse_args(["serve", "--async-scheduling"]))
    assert overlapped.engine_config("m", "cuda").async_scheduling
    assert not serving_config(_parser().parse_args(["serve"])).engine_config(
        "m", "cuda").async_scheduling
    gen = ["generate", "--prompt-ids", "1", "--max-tokens", "1"]
    assert _parser().parse_args([*gen, "--async-scheduling"]).async_scheduling
    assert not _parser().parse_args(gen).async_scheduling


def test_probabilistic_mtp_drafts_are_selectable():
    """The reference runtime's MTP profiles drew drafts probabilistically; config, profile,
    shorthand and flag all reach the engine (before, serving always drafted greedily)."""
    for profile in ("lang-mtp3", "long500k"):
        c = ServingConfig(profile=profile)
        assert c.speculative.draft_sampling == "probabilistic"
        assert c.engine_config("m", "cpu").draft_sampling == "probabilistic"
    assert ServingConfig(speculative="mtp:2").speculative.draft_sampling == "greedy"
    short = ServingConfig(speculative="mtp:2:probabilistic").speculative
    assert (short.num_speculative_tokens, short.draft_sampling) == (2, "probabilistic")
    with pytest.raises(ValidationError, match="probabilistic draft sampling is for MTP"):
        ServingConfig(speculative={"method": "dflash", "draft_sampling": "probabilistic"})
    with pytest.raises(ValidationError):
        ServingConfig(speculative="mtp:2:sometimes")
    flag = serving_config(_parser().parse_args(
        ["serve", "--speculative", "mtp:2", "--draft-sampling", "probabilistic"]))
    assert (flag.speculative.num_speculative_tokens, flag.speculative.draft_sampling) == (
        2, "probabilistic")
    greedy = serving_config(_parser().parse_args(["serve", "--speculative", "mtp",
                                                  "--draft-sampling", "greedy"]))
    assert greedy.engine_config("m", "cpu").draft_sampling == "greedy"
    with pytest.raises(SystemExit, match="need --speculative METHOD"):
        serving_config(_parser().parse_args(["serve", "--draft-sampling", "greedy"]))


def test_probabilistic_mtp_reaches_the_served_engine(tiny_checkpoint):
    from glm53.deployments.engine_client import LocalEngine

    path = tiny_checkpoint
    config = ServingConfig(model=str(path), device="cpu", num_blocks=64, max_model_len=128,
                           speculative="mtp:2:probabilistic")
    engine = LocalEngine(config, path, "cpu")
    try:
        proposer = engine.engine.executor.runner.proposer
        assert proposer.probabilistic
    finally:
        engine.shutdown()


def test_profiles_choose_the_nvfp4_cache_and_fall_back_without_a_scale_bank(tmp_path, caplog):
    assert all(p["kv_cache_dtype"] == "nvfp4" for p in PROFILES.values())
    with caplog.at_level("WARNING"):
        e = ServingConfig().engine_config(tmp_path, "cpu")
    assert (e.kv_cache_dtype, e.kv_scale_bank) == ("auto", None)
    assert "no scale bank" in caplog.text
    (tmp_path / "kv_scales_nvfp4.json").write_text("{}")
    assert ServingConfig().engine_config(tmp_path, "cpu").kv_cache_dtype == "nvfp4"
    assert ServingConfig(kv_cache_dtype="fp8").engine_config(tmp_path, "cpu").kv_cache_dtype \
        == "fp8"


def test_an_explicit_nvfp4_cache_needs_its_scale_bank(tmp_path):
    with pytest.raises(ValueError, match="nvfp4 needs a calibrated scale bank.*calibrate-kv"):
        ServingConfig(kv_cache_dtype="nvfp4").engine_config(tmp_path, "cpu")
    bank = tmp_path / "elsewhere.json"
    bank.write_text("{}")
    e = ServingConfig(kv_cache_dtype="nvfp4", kv_scale_bank=str(bank)).engine_config(
        tmp_path, "cpu")
    assert (e.kv_cache_dtype, e.kv_scale_bank) == ("nvfp4", str(bank))


def test_kv_cache_combinations_that_cannot_work_are_refused():
    with pytest.raises(ValidationError, match="fp8 cannot serve profile long500k"):
        ServingConfig(profile="long500k", kv_cache_dtype="fp8")
    with pytest.raises(ValidationError, match="kv_scale_bank holds nvfp4 outer scales"):
        ServingConfig(kv_cache_dtype="fp8", kv_scale_bank="bank.json")


def test_kv_cache_flags_reach_the_serving_config():
    c = serving_config(_parser().parse_args(["serve", "--kv-cache-dtype", "nvfp4",
                                             "--kv-scale-bank", "/b.json"]))
    assert (c.kv_cache_dtype, c.kv_scale_bank) == ("nvfp4", "/b.json")
    assert not c.from_profile("kv_cache_dtype")


def test_draft_kv_cache_dtype_reaches_the_engine_and_survives_speculative_flags(monkeypatch):
    """--draft-kv-cache-dtype sits beside --kv-cache-dtype (not in `speculative`, which a
    --speculative flag replaces whole); the profiles keep the draft's dtype (auto), as the
    reference runtime's DFlash2 profile did; fp8 without a DFlash draft is refused."""
    monkeypatch.delenv("GLM53_API_KEYS", raising=False)
    monkeypatch.delenv("GLM53_API_KEY", raising=False)
    assert all("draft_kv_cache_dtype" not in p for p in PROFILES.values())
    # the flags' choices, written out so that parsing imports no engine, are the engine's
    from glm53.actors.speculative.dflash import DRAFT_KV_CACHE_DTYPES
    from glm53.deployments import engine_args
    assert engine_args.DRAFT_KV_CACHE_DTYPES == DRAFT_KV_CACHE_DTYPES
    args = _parser().parse_args(["serve", "--profile", "lang-dflash2", "--speculative",
                                 "dflash:/d", "--draft-kv-cache-dtype", "fp8",
                                 "--kv-cache-dtype", "bf16"])
    config = serving_config(args)
    assert config.draft_kv_cache_dtype == "fp8"
    assert config.engine_config("m", "cpu").draft_kv_cache_dtype == "fp8"
    default = ServingConfig(profile="lang-dflash2", speculative="dflash:/d", kv_cache_dtype="bf16")
    assert default.engine_config("m", "cpu").draft_kv_cache_dtype == "auto"
    with pytest.raises(ValidationError, match="draft_kv_cache_dtype fp8 is the DFlash draft's"):
        ServingConfig(draft_kv_cache_dtype="fp8")  # lang-mtp3: MTP drafts, no ring


@pytest.mark.parametrize(("text", "expected"), [
    ("mtp:auto", ("mtp", 3, "adaptive", None)),
    ("mtp:5:auto:probabilistic", ("mtp", 5, "adaptive", None)),
    ("mtp:3", ("mtp", 3, "fixed", None)),
    ("dflash:/ckpt/draft:auto", ("dflash", 7, "adaptive", "/ckpt/draft")),
])
def test_speculative_shorthand_selects_the_draft_length_mode(text, expected):
    spec = ServingConfig(speculative=text).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.draft_length,
            spec.draft_model) == expected


def test_adaptive_draft_length_reaches_the_engine_with_its_cost_table(monkeypatch):
    monkeypatch.delenv("GLM53_API_KEYS", raising=False)
    monkeypatch.delenv("GLM53_API_KEY", raising=False)
    args = _parser().parse_args(["serve", "--speculative", "mtp:2:auto",
                                 "--draft-cost-table", "/bench/latency.json"])
    engine = serving_config(args).engine_config("/m", "cpu")
    assert (engine.num_speculative_tokens, engine.adaptive_drafts, engine.draft_cost_table) == (
        2, True, "/bench/latency.json")
    fixed = ServingConfig(speculative="mtp:2").engine_config("/m", "cpu")
    assert not fixed.adaptive_drafts
    with pytest.raises(ValueError, match="needs a speculative method"):
        ServingConfig(speculative={"method": "none", "draft_length": "adaptive"})
    with pytest.raises(ValueError, match="cost_table is for the adaptive"):
        ServingConfig(speculative={"method": "mtp", "cost_table": "/x.json"})
