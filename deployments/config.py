"""Serving configuration: what one LLM-server deployment serves, and how (pydantic, strict).

`ServingConfig` is the single source of truth for `glm53 serve`, `build_app(args)` (the Ray
Serve / KubeRay `import_path`) and the tests. Unknown fields are rejected. A named *profile*
(mirroring the reference runtime's launch scripts) supplies defaults; any field given
explicitly overrides it. Fields that a profile supplied are remembered, because a profile's
`max_model_len` is a ceiling (clamped to what the model and cache allow, with a log line),
whereas an explicit one is a hard requirement.

Parallel sizes pass through to `EngineConfig`.

KV cache dtype: every profile asks for nvfp4, as the reference runtime did; nvfp4 needs the
checkpoint's calibrated scale bank (`glm53 calibrate-kv`), and a profile's nvfp4 without one
falls back to the model dtype with a warning (an explicit nvfp4 without one is an error).
fp8 with long500k is refused, as the reference refused it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

if TYPE_CHECKING:  # imported where used: the CLI reads this module and should start fast
    from glm53.raycluster.api import EngineConfig

logger = logging.getLogger(__name__)

CPU_CACHE_BYTES = 256 * 2**20  # default KV/state budget on CPU when no size is given
DEFAULT_PROFILE = "lang-mtp3"
# the LLM-server deployment's request router with prefix routing on (a Serve import path)
PREFIX_ROUTER_CLASS = "glm53.deployments.prefix_router.PrefixAffinityRouter"
ENGINE_CPUS = 1  # the placement-group bundle of a multi-GPU replica's engine (bundle 0)
TINY_MODEL_NAME = "glm53-tiny"


class NotSupportedYetError(ValueError):
    """A configured feature that this build cannot serve yet."""


_SAMPLINGS = ("greedy", "probabilistic")


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none", "mtp", "dflash"] = "none"
    num_speculative_tokens: int = Field(0, ge=0, le=16)
    draft_model: str | None = None  # DFlash drafter checkpoint
    # MTP drafts: argmax ("greedy", verified by exact match) or drawn from the MTP layer's
    # distribution under the request's sampling settings ("probabilistic", verified by the
    # min(1, p/q) rule: more drafts accepted at temperature > 0; greedy requests get argmax)
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"
    # draft length: "fixed" (every step verifies num_speculative_tokens) or "adaptive" (each
    # step verifies 0..num_speculative_tokens, chosen for tokens/s; raycluster/draft_policy.py)
    draft_length: Literal["fixed", "adaptive"] = "fixed"
    # step times of the adaptive choice: a `glm53 bench latency --json` record of this
    # hardware (none and mtp:K rows); None = the documented estimate (logged as such)
    cost_table: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        # "none", "mtp", "mtp:3", "mtp:3:probabilistic", "dflash:7", "mtp:auto",
        # "mtp:5:auto:probabilistic", "dflash:PATH:auto" as a shorthand (CLI, KubeRay args):
        # after the method, an int is K, "auto" the adaptive draft length, greedy or
        # probabilistic the draft sampling, anything else DFlash's draft checkpoint
        if isinstance(data, str):
            method, *parts = data.split(":")
            data = {"method": method}
            for part in parts:
                key = ("num_speculative_tokens" if part.isdigit() else
                       "draft_length" if part == "auto" else
                       "draft_model" if method == "dflash" and part not in _SAMPLINGS else
                       "draft_sampling")
                data[key] = "adaptive" if part == "auto" else part
        if isinstance(data, dict) and "num_speculative_tokens" not in data:
            default = {"mtp": 3, "dflash": 7}.get(data.get("method", "none"))
            if default is not None:
                data = {**data, "num_speculative_tokens": default}
        return data

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "none" and self.num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs a speculative method")
        if self.method != "none" and self.num_speculative_tokens < 1:
            raise ValueError(f"speculative method {self.method!r} needs "
                             "num_speculative_tokens >= 1")
        if self.draft_length == "adaptive" and self.method == "none":
            raise ValueError("adaptive draft length needs a speculative method")
        if self.cost_table is not None and self.draft_length != "adaptive":
            raise ValueError("cost_table is for the adaptive draft length")
        if self.draft_sampling == "probabilistic" and self.method != "mtp":
            raise ValueError("probabilistic draft sampling is for MTP drafts (DFlash2's "
                             "selector is greedy)")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def graceful_shutdown_options(drain_timeout_s: float) -> dict[str, float]:
    """Serve options that make a stopping replica drain: it takes no new requests and
    shuts down once none is ongoing (checked every wait loop, Ray's default 2 s) or after
    `drain_timeout_s`, when Serve kills it."""
    return {"graceful_shutdown_wait_loop_s": min(2.0, drain_timeout_s),
            "graceful_shutdown_timeout_s": drain_timeout_s}


class HTTPConfig(BaseModel):
    """What the OpenAI ingress accepts over HTTP; `http_guard.py` enforces it. Ingress-wide,
    not per model. The API keys are SecretStr: a logged or printed config shows `**********`."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # Bearer keys; the ingress adds those in its own environment (GLM53_API_KEYS, comma-
    # separated, and GLM53_API_KEY), which keeps them out of manifests and Serve's config store.
    # None configured: every caller is served.
    api_keys: tuple[SecretStr, ...] = ()
    # a larger body is refused with 413 while it is read (never buffered whole)
    max_request_bytes: int = Field(8 * 2**20, ge=1024)
    # the whole body must arrive within this many seconds (slow senders hold a request slot)
    body_timeout_s: float = Field(60.0, gt=0)
    # Host header names served ("*.example.com" matches subdomains); None: any Host
    allowed_hosts: tuple[str, ...] | None = None
    # browser origins allowed cross-origin (CORS); empty: no CORS headers, browsers block
    allowed_origins: tuple[str, ...] = ()


class ImageConfig(BaseModel):
    """Limits on the images of one chat request (vision deployments), each beyond them a 400."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_images: int = Field(8, ge=1)  # per request
    max_bytes: int = Field(20 << 20, ge=1)  # one encoded image (also caps a download)
    max_pixels: int = Field(64 << 20, ge=1)  # width x height, checked before decoding
    # merged tokens per image: larger images are shrunk to fit (the processor's own maximum is
    # 8000; every image's pixels travel to the workers with its prefill steps)
    max_tokens: int = Field(1024, ge=16)
    # http(s) image URLs are fetched only when enabled (data: URLs always work, file paths
    # never); a fetch must finish within fetch_timeout_s
    fetch_urls: bool = False
    fetch_timeout_s: float = Field(10.0, gt=0, le=25)  # under the prepare timeout (30 s)


# the reference runtime drew its MTP drafts probabilistically (exl3-dflash-spec.md A.2)
_MTP3 = {"method": "mtp", "num_speculative_tokens": 3, "draft_sampling": "probabilistic"}
_DFLASH2 = {"method": "dflash", "num_speculative_tokens": 7}

# Reference runtime launch profiles (design/exl3-dflash-spec.md A.2). Parallel sizes are not
# part of a profile: they describe the hardware (the KubeRay manifests set TP2/EP2/DCP2).
# Every reference launcher ran the nvfp4 latent cache with calibrated power-of-two scales.
PROFILES: dict[str, dict[str, Any]] = {
    "lang-mtp3": {"vision": False, "speculative": _MTP3, "max_model_len": 131_072,
                  "max_num_batched_tokens": 2048, "kv_cache_dtype": "nvfp4"},
    "lang-dflash2": {"vision": False, "speculative": _DFLASH2, "max_model_len": 98_304,
                     "max_num_batched_tokens": 2072, "max_num_seqs": 4,
                     "kv_cache_dtype": "nvfp4"},
    "mm-dflash2": {"vision": True, "speculative": _DFLASH2, "max_model_len": 98_304,
                   "max_num_batched_tokens": 2072, "max_num_seqs": 4, "kv_cache_dtype": "nvfp4"},
    # the reference's one 499K needle miss was reasoning that never ended: bound it
    "long500k": {"vision": False, "speculative": _MTP3, "max_model_len": 499_968,
                 "max_num_batched_tokens": 1024, "max_num_seqs": 1,
                 "thinking_token_budget": 32_768, "kv_cache_dtype": "nvfp4"},
}


class ServingConfig(BaseModel):
    """One served model: checkpoint, engine limits, features and Serve deployment knobs."""

    # errors leave the input out: a whole-config error would print the API keys
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    model: str | None = None  # checkpoint directory; None = the embedded tiny checkpoint
    served_model_name: str | None = None  # the OpenAI `model` id; default: directory name
    profile: str = DEFAULT_PROFILE
    # parallelism inside one replica (one engine)
    tensor_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    decode_context_parallel_size: int = Field(1, ge=1)
    # weights and caches
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # default: checkpoint's
    # latent cache rows (actors/caches.py): model dtype, bf16, fp8 (528 B), nvfp4 (304 B)
    kv_cache_dtype: Literal["auto", "bf16", "fp8", "nvfp4"] = "auto"
    # nvfp4 outer scales; default: kv_scales_nvfp4.json in the checkpoint
    kv_scale_bank: str | None = None
    # a DFlash draft's K/V ring (speculative/dflash.py): the draft's dtype, or fp8 rows (e4m3
    # + one fp32 scale per head and position, about half the bytes). Beside kv_cache_dtype
    # rather than in `speculative`, which a --speculative flag replaces whole
    draft_kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: str | None = None  # default: cuda when available, else cpu
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # routed experts of a BF16/FP8 checkpoint quantised to 4 bits while loading
    quantize_experts: Literal["int4"] | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # schedule step N+1 while step N runs (raycluster/engine.py); off until measured on a GPU
    async_scheduling: bool = False
    # check the checkpoint (and DFlash draft) against its SHA-256 manifest before loading
    verify: bool = False
    cache_bytes: int | None = Field(None, gt=0)  # KV + state budget (CPU default 256 MiB)
    num_blocks: int | None = Field(None, ge=2)
    block_size: int = Field(16, ge=1)
    # scheduler limits
    max_model_len: int | None = Field(None, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(16, ge=1)
    max_waiting_requests: int = Field(256, ge=1)  # beyond it: 503 + Retry-After
    # prefix caching: cached blocks + KDA state checkpoints (raycluster/prefix_cache.py).
    # None: on unless the other settings cannot have it (then off, with a logged warning);
    # True where they cannot is refused
    enable_prefix_caching: bool | None = None
    prefix_checkpoints: int | None = Field(None, ge=1)  # default max_num_seqs
    # tokens, a multiple of block_size x decode_context_parallel_size
    prefix_checkpoint_interval: int = Field(2048, ge=1)
    seed: int = 0
    # features
    speculative: SpeculativeConfig = SpeculativeConfig()
    vision: bool = False
    images: ImageConfig = ImageConfig()  # limits on image inputs (with vision)
    # reasoning tokens a chat request may spend before `</think>` is forced (the request's
    # thinking_token_budget overrides); None = unbounded
    thinking_token_budget: int | None = Field(None, ge=0)
    # Ray Serve deployment of the LLM server
    num_replicas: int = Field(1, ge=1)
    # route each request to the replica most likely to hold its prefix (deployments/
    # prefix_router.py), load permitting; default: on with prefix caching. Applies to any
    # replica count, autoscaled ones included (one replica: plain routing)
    prefix_routing: bool | None = None
    # queued requests the preferred replica may exceed the least loaded one by
    prefix_routing_imbalance: int = Field(8, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    # seconds in-flight requests get to finish when a replica or `glm53 serve` stops (Serve's
    # graceful shutdown of both deployments; `glm53 serve`'s drain on SIGTERM); pods that run
    # replicas need a longer terminationGracePeriodSeconds (k8s/, checked by validate_k8s.py)
    drain_timeout_s: float = Field(30.0, ge=0)
    # the OpenAI ingress in front of this model: API keys, size and time limits, hosts, CORS
    http: HTTPConfig = HTTPConfig()

    _from_profile: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _apply_profile(cls, data: Any, handler: Any) -> ServingConfig:
        from_profile: set[str] = set()
        if isinstance(data, dict):
            name = data.get("profile", DEFAULT_PROFILE)
            if name not in PROFILES:
                raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
            from_profile = {k for k in PROFILES[name] if data.get(k) is None}
            data = {**PROFILES[name], **{k: v for k, v in data.items() if v is not None}}
        model = handler(data)
        if from_profile:
            model._from_profile = frozenset(from_profile)
        return model

    @model_validator(mode="after")
    def _check(self) -> ServingConfig:
        if self.cache_bytes is not None and self.num_blocks is not None:
            raise ValueError("give cache_bytes or num_blocks, not both")
        if self.kv_scale_bank is not None and self.kv_cache_dtype != "nvfp4":
            raise ValueError(f"kv_scale_bank holds nvfp4 outer scales; kv_cache_dtype is "
                             f"{self.kv_cache_dtype}")
        if self.draft_kv_cache_dtype != "auto" and self.speculative.method != "dflash":
            raise ValueError(f"draft_kv_cache_dtype {self.draft_kv_cache_dtype} is the DFlash "
                             f"draft's ring; speculative method is {self.speculative.method}")
        if self.kv_cache_dtype == "fp8" and self.profile == "long500k":
            raise ValueError("kv_cache_dtype fp8 cannot serve profile long500k (as in the "
                             "reference runtime): use nvfp4, or another profile")
        return self

    def from_profile(self, field: str) -> bool:
        """Whether `field` holds the profile's value (not an explicit one)."""
        return field in self._from_profile

    # ----- derived -----
    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size,
                   self.decode_context_parallel_size)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else TINY_MODEL_NAME

    def check_supported(self) -> None:
        """Raise NotSupportedYetError for each feature this build cannot serve yet."""
        problems = []

        def origin(field: str) -> str:
            return f" (from profile {self.profile})" if self.from_profile(field) else ""

        if self.speculative.method == "dflash" and not self.speculative.draft_model:
            problems.append(f"speculative decoding with dflash{origin('speculative')} "
                            "needs the drafter checkpoint (--draft-model DIR)")
        if problems:
            raise NotSupportedYetError("; ".join(problems))

    def kv_cache(self, model_dir: str | Path) -> tuple[str, str | None]:
        """(kv_cache_dtype, scale bank path) for the checkpoint in `model_dir`."""
        from glm53.raycluster.api import bank_path

        bank = bank_path(model_dir, self.kv_scale_bank)
        if self.kv_cache_dtype != "nvfp4" or bank.is_file():
            return self.kv_cache_dtype, self.kv_scale_bank
        if self.from_profile("kv_cache_dtype"):
            logger.warning("profile %s asks for the nvfp4 KV cache, but %s has no scale bank "
                           "(glm53 calibrate-kv builds one): the cache keeps the model dtype",
                           self.profile, model_dir)
            return "auto", None
        raise ValueError(f"kv_cache_dtype nvfp4 needs a calibrated scale bank: none at {bank}; "
                         "build one with `glm53 calibrate-kv` or pass --kv-scale-bank PATH")

    def engine_config(self, model_dir: str | Path, device: str,
                      max_model_len: int | None = None) -> EngineConfig:
        """The EngineConfig of one replica (`max_model_len` overrides, e.g. after clamping)."""
        from glm53.raycluster.api import EngineConfig

        cache_bytes = self.cache_bytes
        if cache_bytes is None and self.num_blocks is None and not device.startswith("cuda"):
            cache_bytes = CPU_CACHE_BYTES
        kv_cache_dtype, kv_scale_bank = self.kv_cache(model_dir)
        return EngineConfig(
            model=str(model_dir), dtype=self.dtype, device=device,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len if max_model_len is not None else self.max_model_len,
            block_size=self.block_size, num_blocks=self.num_blocks, cache_bytes=cache_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            quantize_experts=self.quantize_experts,
            kv_cache_dtype=kv_cache_dtype, kv_scale_bank=kv_scale_bank,
            with_mtp=self.speculative.method == "mtp", seed=self.seed, vision=self.vision,
            draft_sampling=self.speculative.draft_sampling,
            adaptive_drafts=self.speculative.draft_length == "adaptive",
            draft_cost_table=self.speculative.cost_table,
            speculative_method=self.speculative.method if self.speculative.enabled else None,
            num_speculative_tokens=self.speculative.num_speculative_tokens,
            tensor_parallel_size=self.tensor_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            max_waiting_requests=self.max_waiting_requests, enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_checkpoints=self.prefix_checkpoints,
            prefix_checkpoint_interval=self.prefix_checkpoint_interval,
            **({"draft_model": self.speculative.draft_model,
                "draft_kv_cache_dtype": self.draft_kv_cache_dtype}
               if self.speculative.method == "dflash" else {}))

    def server_deployment_options(self, device: str) -> dict[str, Any]:
        """Ray Serve options of the LLM-server deployment on `device` (resolved by the caller:
        the driver may sit on a GPU-less head node). One engine per replica. A single-GPU
        engine runs in the replica, which holds the GPU. A multi-GPU replica reserves its whole
        pair: Serve creates one STRICT_PACK placement group per replica, the replica itself in
        bundle 0 (the engine: CPU only) and one GPU bundle per rank after it, which the
        executor finds and fills with its workers. So the engine and its workers share a node
        (the shared-memory step channel needs it), are scheduled all or nothing, and go away
        together when Serve replaces the replica. On CPU the GPUs are Ray's fake ones."""
        options: dict[str, Any] = {"num_replicas": self.num_replicas,
                                   "max_ongoing_requests": self.max_ongoing_requests,
                                   "health_check_period_s": 10, "health_check_timeout_s": 30,
                                   **graceful_shutdown_options(self.drain_timeout_s)}
        if self.world_size > 1:
            # the step loop keeps one core busy; bundle 0 must hold the replica's own request
            options["ray_actor_options"] = {"num_cpus": ENGINE_CPUS}
            options["placement_group_bundles"] = [{"CPU": ENGINE_CPUS}] + [
                {"GPU": 1}] * self.world_size
            options["placement_group_strategy"] = "STRICT_PACK"
        elif device.startswith("cuda"):
            options["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
        else:
            options["ray_actor_options"] = {"num_cpus": 0}
        if self.prefix_routing_enabled:
            options["request_router_config"] = {
                "request_router_class": PREFIX_ROUTER_CLASS,
                "request_router_kwargs": {"imbalance_threshold": self.prefix_routing_imbalance}}
        return options

    @property
    def prefix_caching(self) -> bool:
        """Whether the engines cache prefixes (EngineConfig.prefix_caching's rule)."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        from glm53.raycluster.api import EngineConfig

        return EngineConfig(model="unused", block_size=self.block_size,
                            decode_context_parallel_size=self.decode_context_parallel_size,
                            prefix_checkpoint_interval=self.prefix_checkpoint_interval
                            ).prefix_caching

    @property
    def prefix_routing_enabled(self) -> bool:
        """Whether the LLM-server deployment routes by prefix (explicit, else with caching)."""
        if self.prefix_routing is not None:
            return self.prefix_routing
        return self.prefix_caching
