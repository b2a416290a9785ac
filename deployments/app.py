"""`build_app(args)`: the Ray Serve application (the `import_path` KubeRay and `glm53 serve` use).

One OpenAI ingress deployment in front of one LLM-server deployment per served model. `args`
is a `ServingConfig` or its dict form (the `args:` of a Serve config file); unsupported
features fail here, before anything is deployed.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from .config import HTTPConfig, ServingConfig, graceful_shutdown_options
from .ingress import OpenAIIngress
from .llm_server import EngineFactory, LLMServer

INGRESS_OPTIONS: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0},
                                   "max_ongoing_requests": 4096}


def cluster_device() -> str:
    """cuda when the Ray cluster has GPUs (the driver itself may sit on a GPU-less head)."""
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
        return "cuda"
    return "cpu"


def server_app(config: ServingConfig, device: str,
               engine_factory: EngineFactory | None = None) -> Application:
    """The LLM-server deployment of one model (tests inject `engine_factory`)."""
    name = f"LLMServer:{config.model_name}"
    deployment = serve.deployment(LLMServer, name=name).options(
        **config.server_deployment_options(device))
    return deployment.bind(config, device, engine_factory)


def ingress_app(servers: dict[str, Application], http: HTTPConfig | None = None,
                drain_timeout_s: float | None = None) -> Application:
    """The OpenAI ingress in front of `servers`. A stopping ingress replica drains like the
    servers (default: ServingConfig's drain timeout): its streams relay theirs."""
    if drain_timeout_s is None:
        drain_timeout_s = ServingConfig.model_fields["drain_timeout_s"].default
    return serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        **INGRESS_OPTIONS, **graceful_shutdown_options(drain_timeout_s)).bind(
        servers, http or HTTPConfig())


def build_app(args: ServingConfig | dict[str, Any]) -> Application:
    config = args if isinstance(args, ServingConfig) else ServingConfig.model_validate(args)
    config.check_supported()
    device = config.device or cluster_device()
    return ingress_app({config.model_name: server_app(config, device)}, config.http,
                       config.drain_timeout_s)
