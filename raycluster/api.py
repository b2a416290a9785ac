"""The engine as the serving layer sees it: the one module of raycluster (and, through it, of
actors) that deployments/ imports; tests/test_import_direction.py holds it to that.

Engine: `EngineConfig` → `make_executor` (in-process, or one Ray actor per GPU) → `LLMEngine`
(add_request / abort / step / stats) → `AsyncEngine` (asyncio streams of `RequestOutput`
deltas, each with the engine's `RequestTiming`). Requests are refused with
`RequestRejectedError` (`ConstraintError` for a grammar that does not compile); a dead engine
raises `EngineDeadError`, its workers `WorkerError`. `OutputConstraints` is built from the
tokenizer by the serving layer, which owns it.

Benchmarks, for `glm53 bench latency`: `LatencyRunner` measures `LatencyCase`s on one engine
in this process.

Fidelity, for `glm53 kld`: `RunConfig` (a model's runtime configuration), `cut_windows`,
`capture` (teacher logits into a directory) and `score` (a student against it: a receipt);
`KLDInputError` for inputs that cannot be scored together.

Checkpoints and plans, for the CLI (`generate`, `make-tiny`, `plan-memory`): reading a model
directory, the tiny random checkpoints, the release configs and the memory planner.
"""

from glm53.actors.config import UnsupportedConfigError
from glm53.actors.kld_run import (
    KLDInputError,
    RunConfig,
    capture,
    check_window,
    cut_windows,
    read_manifest,
    score,
    sha256_file,
    tokens_sha256,
)
from glm53.actors.kv_scale_bank import BANK_FILE, bank_path, calibrate_checkpoint, write_bank
from glm53.actors.loader import read_config
from glm53.actors.memory_plan import GiB, MemoryPlanError, plan_for_config
from glm53.actors.release import (
    DFLASH2_RELEASE,
    dflash2_release_config,
    exl3_release_config,
    release_config,
)
from glm53.actors.step import ImageInput, SamplingParams, StructuredOutput
from glm53.actors.tiny import (
    exl3_quantization_config,
    tiny_text_config,
    write_tiny_checkpoint,
    write_tiny_draft,
)
from glm53.actors.tiny import release_config as tiny_release_config
from glm53.actors.weights import CheckpointError

from .config import EngineConfig
from .constraints import ConstraintError, OutputConstraints
from .engine import AsyncEngine, EngineDeadError, LLMEngine, RequestOutput, TokenLogprob
from .envs import cache_dir
from .executor import Executor, WorkerError, make_executor
from .latency import LatencyCase, LatencyResult, LatencyRunner, describe_device
from .request import FinishReason, RequestTiming
from .scheduler import RequestRejectedError
from .stats import EngineStats

__all__ = [
    # the engine
    "AsyncEngine", "ConstraintError", "EngineConfig", "EngineDeadError", "EngineStats",
    "Executor", "FinishReason", "ImageInput", "LLMEngine", "OutputConstraints", "RequestOutput",
    "RequestRejectedError", "RequestTiming", "SamplingParams", "StructuredOutput",
    "TokenLogprob", "WorkerError", "make_executor",
    # benchmarks
    "LatencyCase", "LatencyResult", "LatencyRunner", "describe_device",
    # fidelity (glm53 kld)
    "KLDInputError", "RunConfig", "capture", "check_window", "cut_windows", "read_manifest",
    "score", "sha256_file", "tokens_sha256",
    # checkpoints and plans
    "BANK_FILE", "CheckpointError", "GiB", "MemoryPlanError", "UnsupportedConfigError",
    "DFLASH2_RELEASE", "bank_path", "cache_dir", "calibrate_checkpoint", "dflash2_release_config",
    "write_bank",
    "exl3_quantization_config", "exl3_release_config", "plan_for_config", "read_config",
    "release_config", "tiny_release_config", "tiny_text_config", "write_tiny_checkpoint",
    "write_tiny_draft",
]
