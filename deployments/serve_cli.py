"""`glm53 serve`: its flags, the ServingConfig they give (flags given override the profile),
and the run: Ray joined or started on this machine, the app on Ray Serve until a signal drains
it."""

from __future__ import annotations

import argparse
import logging
import sys

from .engine_args import (
    ASYNC_SCHEDULING_HELP,
    DRAFT_KV_CACHE_DTYPES,
    DRAFT_KV_HELP,
    PREFIX_CACHING_HELP,
    QUANTIZE_HELP,
    parse_bytes,
)


def _parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (Ray Serve)",
                         description="Unset options come from the profile, then the defaults.")
    srv.add_argument("--model", default=None,
                     help="checkpoint directory (default: the embedded tiny model)")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--profile", default=None,
                     help="lang-mtp3 (default), lang-dflash2, mm-dflash2, long500k")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=None,
                     metavar="SECONDS",
                     help="on SIGTERM or Ctrl-C, new requests get 503 and those in flight get "
                          "this long to finish before the server stops (default 30; a second "
                          "signal stops at once); also the replicas' graceful shutdown timeout")
    par = srv.add_argument_group("parallelism (one engine per replica)")
    par.add_argument("--tp", dest="tensor_parallel_size", type=int, default=None)
    par.add_argument("--ep", dest="expert_parallel_size", type=int, default=None)
    par.add_argument("--dcp", dest="decode_context_parallel_size", type=int, default=None)
    par.add_argument("--num-replicas", type=int, default=None)
    feat = srv.add_argument_group("features")
    feat.add_argument("--speculative", default=None,
                      help="none | mtp | dflash, optionally METHOD:K, mtp:K:SAMPLING, or "
                           "with :auto an adaptive draft length of up to K (mtp:auto, "
                           "dflash:PATH:auto); overrides the profile")
    feat.add_argument("--num-speculative-tokens", type=int, default=None)
    feat.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default=None,
                      help="MTP drafts: argmax, or drawn from the MTP distribution and "
                           "verified by min(1, p/q) (the lang-mtp3 and long500k default)")
    feat.add_argument("--draft-model", default=None, help="DFlash drafter checkpoint")
    feat.add_argument("--draft-kv-cache-dtype", choices=DRAFT_KV_CACHE_DTYPES, default=None,
                      help=DRAFT_KV_HELP)
    feat.add_argument("--draft-cost-table", dest="cost_table", default=None, metavar="JSON",
                      help="adaptive draft length (--speculative mtp:auto): step times from "
                           "a `glm53 bench latency --json` record of this hardware (default: "
                           "the documented estimate)")
    feat.add_argument("--vision", action=argparse.BooleanOptionalAction, default=None,
                      help="accept images in chat (the checkpoint's vision tower); the "
                           "mm-dflash2 profile turns it on")
    feat.add_argument("--image-urls", dest="fetch_image_urls", action="store_true",
                      default=None, help="with --vision: also fetch http(s) image URLs "
                                         "(default: data: URLs only)")
    feat.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8", "nvfp4"], default=None,
                      help="latent cache rows: model dtype, bf16, fp8 (528 B) or nvfp4 (304 B; "
                           "the profiles' choice, needs a scale bank)")
    feat.add_argument("--kv-scale-bank", default=None, metavar="PATH",
                      help="nvfp4 outer scales (default: kv_scales_nvfp4.json in the "
                           "checkpoint; glm53 calibrate-kv writes it)")
    eng = srv.add_argument_group("engine limits")
    eng.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    eng.add_argument("--device", default=None, help="default: cuda if the cluster has GPUs")
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--max-num-seqs",
                 "--block-size", "--max-waiting-requests", "--seed"):
        eng.add_argument(flag, type=int, default=None)
    size = eng.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None)
    size.add_argument("--cache-bytes", type=parse_bytes, default=None)
    eng.add_argument("--gpu-memory-utilization", type=float, default=None)
    eng.add_argument("--quantize-experts", choices=["int4"], default=None, help=QUANTIZE_HELP)
    eng.add_argument("--enforce-eager", action="store_true", default=None,
                     help="no CUDA graphs for decode steps (every step runs eagerly)")
    eng.add_argument("--async-scheduling", action="store_true", default=None,
                     help=ASYNC_SCHEDULING_HELP)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=None, help=PREFIX_CACHING_HELP)
    eng.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction,
                     default=None, help="send each request to the replica most likely to hold "
                                        "its prefix, load permitting (default: on with "
                                        "prefix caching)")
    eng.add_argument("--prefix-checkpoints", type=int, default=None, metavar="N",
                     help="KDA state checkpoints kept for the prefix cache, each one state "
                          "slot per GPU (default max-num-seqs)")
    eng.add_argument("--prefix-checkpoint-interval", type=int, default=None, metavar="TOKENS",
                     help="checkpoint long prefills every TOKENS tokens, a multiple of "
                          "block-size (default 2048, the default step budget)")
    eng.add_argument("--verify", action="store_true", default=None,
                     help="check the checkpoint (and DFlash draft) against its SHA-256 "
                          "manifest before loading; refuse to start on a mismatch")
    eng.add_argument("--thinking-token-budget", type=int, metavar="N",
                     help="reasoning tokens a chat request may spend before </think> is "
                          "forced (a request's thinking_token_budget overrides; default: the "
                          "profile's, else unbounded)")
    sec = srv.add_argument_group(
        "HTTP limits and security (README: Security)",
        "API keys also come from GLM53_API_KEYS (comma-separated) and GLM53_API_KEY; prefer "
        "them to --api-key, which other local users can read in the process list")
    sec.add_argument("--api-key", dest="api_keys", action="append", default=None,
                     metavar="KEY", help="accept 'Authorization: Bearer KEY' (repeatable); "
                                         "with any key set, every route but /health and "
                                         "/metrics needs one")
    sec.add_argument("--max-request-bytes", type=parse_bytes, default=None, metavar="SIZE",
                     help="largest request body, e.g. 8M (default 8M): 413 beyond it")
    sec.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None,
                     metavar="SECONDS", help="a request body must arrive within this time "
                                             "(default 60): 408 after it")
    sec.add_argument("--allowed-hosts", type=_parse_list, action="extend", default=None,
                     metavar="NAMES", help="Host header names served, comma-separated "
                                           "('*.example.com' for subdomains, '*' for any); "
                                           "default: localhost names when --host is a "
                                           "loopback address, else any (with a warning)")
    sec.add_argument("--allowed-origins", type=_parse_list, action="extend", default=None,
                     metavar="ORIGINS", help="browser origins allowed cross-origin (CORS), "
                                             "comma-separated; default none")
    sec.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="Serve proxy: end-to-end limit of one request, streams included "
                          "(default none: long generations are legitimate)")
    sec.add_argument("--keep-alive-timeout", type=int, default=None, metavar="SECONDS",
                     help="Serve proxy: idle keep-alive connections close after this "
                          "(default Ray's 90, above common load balancers' 60)")


SERVE_FIELDS = ("model", "served_model_name", "profile", "tensor_parallel_size",
                "expert_parallel_size", "decode_context_parallel_size", "num_replicas",
                "vision", "kv_cache_dtype", "kv_scale_bank", "draft_kv_cache_dtype", "dtype",
                "device", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                "block_size", "max_waiting_requests", "seed", "num_blocks", "cache_bytes",
                "gpu_memory_utilization", "enforce_eager", "async_scheduling",
                "quantize_experts", "verify", "thinking_token_budget", "drain_timeout_s",
                "enable_prefix_caching", "prefix_routing", "prefix_checkpoints",
                "prefix_checkpoint_interval")


def serving_config(args: argparse.Namespace):
    """The ServingConfig of `glm53 serve` flags: only flags given override the profile."""
    from .config import ServingConfig

    values = {k: getattr(args, k) for k in SERVE_FIELDS if getattr(args, k) is not None}
    spec = None
    if args.speculative is not None:
        spec = {"method": args.speculative} if ":" not in args.speculative else args.speculative
    if (args.num_speculative_tokens is not None or args.draft_model is not None
            or args.draft_sampling is not None or args.cost_table is not None):
        if spec is None:
            raise SystemExit("--num-speculative-tokens/--draft-model/--draft-sampling/"
                             "--draft-cost-table need --speculative METHOD")
        if isinstance(spec, str):
            from .config import SpeculativeConfig

            spec = SpeculativeConfig.model_validate(spec).model_dump(exclude_defaults=True)
        given = {"num_speculative_tokens": args.num_speculative_tokens,
                 "draft_model": args.draft_model, "draft_sampling": args.draft_sampling,
                 "cost_table": args.cost_table}
        spec = {**spec, **{k: v for k, v in given.items() if v is not None}}
    if spec is not None:
        values["speculative"] = spec
    values["http"] = http_config(args)
    if args.fetch_image_urls:
        values["images"] = {"fetch_urls": True}
    return ServingConfig.model_validate(values)


def http_config(args: argparse.Namespace) -> dict:
    """The ingress's HTTPConfig fields of `glm53 serve` flags. Keys from this shell's
    environment are included: a cluster joined through RAY_ADDRESS does not see it."""
    from .http_guard import LOOPBACK_NAMES, api_keys_from_env, is_loopback

    http = {"api_keys": [*(args.api_keys or []), *api_keys_from_env()]}
    for field in ("max_request_bytes", "body_timeout_s", "allowed_hosts", "allowed_origins"):
        if getattr(args, field) is not None:
            http[field] = getattr(args, field)
    if args.allowed_hosts is None and is_loopback(args.host):
        # a loopback server is reached by name only through DNS rebinding: refuse other names
        http["allowed_hosts"] = list(LOOPBACK_NAMES)
    return http


def exposure_warnings(args: argparse.Namespace, config) -> list[str]:
    """What an operator binding beyond loopback should know at start-up."""
    from .http_guard import is_loopback

    if is_loopback(args.host):
        return []
    warnings = []
    if not config.http.api_keys:
        warnings.append(f"serving on {args.host} without an API key: anyone who reaches port "
                        f"{args.port} is served (set GLM53_API_KEYS or --api-key)")
    if config.http.allowed_hosts is None:
        warnings.append("any Host header is accepted (set --allowed-hosts to the names "
                        "clients use)")
    return warnings


def proxy_options(args: argparse.Namespace) -> dict:
    """Serve's HTTP proxy (uvicorn) options. Its idle keep-alive timeout is the only read
    timeout uvicorn has: it does not bound slow request heads (a fronting proxy does, README
    Security); the guard bounds the body."""
    options = {"host": args.host, "port": args.port}
    if args.request_timeout is not None:
        options["request_timeout_s"] = args.request_timeout
    if args.keep_alive_timeout is not None:
        options["keep_alive_timeout_s"] = args.keep_alive_timeout
    return options


def local_placement(config, has_cuda: bool) -> tuple[str, int | None]:
    """(device, fake GPUs) of a private Ray on this machine. A multi-GPU engine on CPU places
    its ranks exactly as on a pair: Ray gets one fake GPU per rank of every replica, so the
    replicas' placement groups reserve their GPU bundles, and the workers run on CPU (gloo).
    Without fake GPUs those bundles could never be placed. None: Ray counts the real GPUs."""
    device = config.device or ("cuda" if has_cuda else "cpu")
    if device.startswith("cuda") or config.world_size == 1:
        return device, None
    return device, config.world_size * config.num_replicas


def _joining() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _start_ray(num_gpus: int | None = None):
    """Joins the cluster named by RAY_ADDRESS; otherwise starts a private one on this machine
    whose Ray listeners (GCS, raylet, workers, agents) bind 127.0.0.1 only, with `num_gpus`
    fake GPUs if given (`local_placement`)."""
    import os

    joining = _joining()
    if not joining:
        # Ray binds its listeners to the node IP, which it takes from the network unless this
        # switch (Ray's own, for single-machine use) is off; it is read when ray is imported
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(address=None if joining else "local", num_gpus=None if joining else num_gpus,
             include_dashboard=False)
    if not joining and ray.util.get_node_ip_address() != "127.0.0.1":
        logging.getLogger(__name__).warning(
            "the local Ray listens on %s, not only loopback (ray was imported before "
            "glm53 serve could set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)",
            ray.util.get_node_ip_address())
    return ray


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .config import NotSupportedYetError
    from .drain import StopSignals, drain_ingress

    try:
        config = serving_config(args)
        config.check_supported()
    except ValidationError as exc:
        raise SystemExit(f"error: invalid serving config:\n{exc}") from exc
    except NotSupportedYetError as exc:
        raise SystemExit(f"error: {exc}") from exc
    for warning in exposure_warnings(args, config):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    fake_gpus = None
    if not _joining():
        # the device is fixed before Ray starts: fake GPUs would read as CUDA to build_app
        import torch

        device, fake_gpus = local_placement(config, torch.cuda.is_available())
        config = config.model_copy(update={"device": device})
    ray = _start_ray(fake_gpus)
    from ray import serve

    from .app import build_app

    # from here on (Ray's own SIGTERM handler would kill the driver without any cleanup); a
    # signal during start-up drains once the app is up, when nothing is in flight yet
    stop = StopSignals()
    stop.install()
    status, graceful = 0, True
    try:
        serve.start(http_options=proxy_options(args))
        try:
            handle = serve.run(build_app(config), name="glm53", route_prefix="/")
        except RuntimeError as exc:  # the replicas' own errors are in the log above
            raise SystemExit(f"error: the app did not start: {exc}") from exc
        for card in handle.server_info.remote().result():
            print(f"serving {card['id']} (profile {card['profile']}) at "
                  f"http://{args.host}:{args.port}/v1\n{card['capacity']}", flush=True)
        print(f"SIGTERM or Ctrl-C drains the server (up to {config.drain_timeout_s:g} s), a "
              "second one stops it at once", flush=True)
        stop.requested.wait()
        try:
            drain_ingress(handle, config.drain_timeout_s)
        except Exception:  # noqa: BLE001 - a failed drain must not prevent the shutdown
            logging.getLogger(__name__).exception("the drain failed; stopping")
    except KeyboardInterrupt:
        print("stopping at once", flush=True)
        status, graceful = 1, False
    finally:
        _shutdown(ray, serve, graceful)
    return status


def _shutdown(ray, serve, graceful: bool) -> None:
    """Serve (its replicas drain first: nothing is in flight after a drain), then Ray; a
    signal during Serve's shutdown skips the rest of it."""
    try:
        if graceful:
            serve.shutdown()
    except KeyboardInterrupt:
        print("stopping at once", flush=True)
    finally:
        ray.shutdown()
