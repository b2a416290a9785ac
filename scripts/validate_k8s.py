#!/usr/bin/env python3
"""Offline validation of Kubernetes manifests (no cluster): run by CI through
tests/k8s/test_validate_k8s.py, or by hand (exit 1 on any error, 2 on a usage error):

    .venv/bin/python scripts/validate_k8s.py [PATH ...] [--crds DIR]

PATHs are files or folders (default: k8s/). DIR holds the KubeRay CRDs; by default the project's
shared copy ../shared/k8s-crds/ when it exists, else .k8s-crds/, which `make k8s-crds` fills
with those of the pinned KubeRay release.

1. YAML lint (yamllint) of every YAML file and of every embedded serveConfigV2.
2. Schemas, strict (an unknown field is an error, as in kubeconform -strict):
   - KubeRay kinds against the KubeRay CRDs (each CRD's openAPIV3Schema converted to JSON
     Schema; never copied into the repository);
   - built-in and Prometheus Operator kinds against JSON Schema generated from cloudcoil's
     models, which are generated from the upstream OpenAPI specs and CRDs.
   Plain files and each `kubectl kustomize` rendering (when kubectl exists) are checked.
3. Every serveConfigV2 (and k8s/serve-config.*.yaml): Ray Serve's ServeDeploySchema; the app is
   built offline and the `deployments:` overrides are applied with Ray's own code, so a wrong
   deployment name or option fails; `args` must validate as glm53's ServingConfig. A config
   that parses but asks for a feature this build does not have yet (`check_supported`, which
   `build_app` calls at start-up) is reported as a note, not an error.
4. Conventions (design/style.md §4.5 rule 10): rayVersion = image Ray = Dockerfile = pyproject
   pin, image tag = Dockerfile label, head without GPUs, GPU requests = limits, named ports, one
   pair per pod matching the engine's parallel size, Serve autoscaling bounds = worker group.
   Drain (issue 18): every pod's terminationGracePeriodSeconds > its preStop sleep + Ray's
   SIGTERM node drain (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S); in a RayService that node drain
   and rayClusterDeletionDelaySeconds are at least the replicas' graceful_shutdown_timeout_s
   (ServingConfig.drain_timeout_s), so neither a pod deletion nor an upgrade cuts a draining
   request.
5. Monitoring (monitoring.py beside this file): promtool check/test rules, PromQL of every
   dashboard panel parses, and every vllm:/glm53: name exists in the app's registry.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monitoring  # noqa: E402  (scripts/ is not a package)

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# where the KubeRay CRDs are looked for without --crds: the project's shared copy, then the
# git-ignored folder `make k8s-crds` fills
CRD_DIRS = (REPO.parent / "shared" / "k8s-crds", REPO / ".k8s-crds")
YAMLLINT_CONFIG = """
extends: default
rules:
  line-length: {max: 120}
  document-start: disable
  comments: {min-spaces-from-content: 1}
  truthy: {check-keys: false}
  braces: {max-spaces-inside: 1}
"""
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
APP_IMPORT_PATH = "glm53.deployments.app:build_app"
# on SIGTERM, `ray start --block` drains its node for this long (Ray's default 30 s)
RAY_DRAIN_ENV, RAY_DRAIN_DEFAULT_S = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", 30.0
K8S_GRACE_DEFAULT_S = 30  # terminationGracePeriodSeconds when not set
DELETION_DELAY_DEFAULT_S = 60  # KubeRay's rayClusterDeletionDelaySeconds when not set


class CrdsNotFound(Exception):
    """No KubeRay CRDs where they were looked for."""


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def extend(self, other: Report) -> None:
        self.errors += other.errors
        self.notes += other.notes


# ----- schemas ------------------------------------------------------------------------------


def strict(schema: Any, override: bool = False) -> Any:
    """A copy in which every object that lists properties forbids others (kubeconform -strict),
    except where Kubernetes keeps unknown fields. `override` also turns an explicit
    `additionalProperties: true` off (pydantic writes it for models that allow extras)."""
    if isinstance(schema, dict):
        out = {k: strict(v, override) for k, v in schema.items()}
        if ("properties" in out and not out.get("x-kubernetes-preserve-unknown-fields")
                and ("additionalProperties" not in out
                     or (override and out["additionalProperties"] is True))):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v, override) for v in schema]
    return schema


def _pin(schema: dict, api_version: str, kind: str) -> dict:
    schema = copy.deepcopy(schema)
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string", "enum": [api_version]}
    props["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind"})
    return schema


def default_crd_dir() -> Path:
    found = next((d for d in CRD_DIRS if d.is_dir()), None)
    if found is None:
        raise CrdsNotFound(
            f"no KubeRay CRDs in {' or '.join(map(str, CRD_DIRS))}: run `make k8s-crds` to fetch "
            "those of the pinned KubeRay release, or pass --crds DIR")
    return found


def crd_schemas(crd_dir: Path) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict JSON Schema, for every served version of every CRD file."""
    if not crd_dir.is_dir():
        raise CrdsNotFound(f"--crds {crd_dir}: no such folder")
    schemas = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        # libyaml's loader: the pure-Python one takes ~20 s for the 3 MB of CRDs
        for crd in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                api_version = f"{group}/{version['name']}"
                schema = strict(version["schema"]["openAPIV3Schema"])
                schemas[(api_version, kind)] = _pin(schema, api_version, kind)
    if not any(api_version.startswith("ray.io/") for api_version, _ in schemas):
        raise CrdsNotFound(f"no KubeRay CRDs (ray.io CustomResourceDefinitions) in {crd_dir}: "
                           "run `make k8s-crds` and pass --crds .k8s-crds")
    return schemas


def model_schemas() -> dict[tuple[str, str], dict]:
    """Built-in and Prometheus Operator kinds used under k8s/, from cloudcoil's models."""
    from cloudcoil.models.kubernetes.core import v1 as core
    from cloudcoil.models.kubernetes.networking import v1 as networking
    from cloudcoil.models.prometheus_operator import v1 as monitoring_v1

    kinds = {("v1", "PersistentVolumeClaim"): core.PersistentVolumeClaim,
             ("v1", "ConfigMap"): core.ConfigMap, ("v1", "Secret"): core.Secret,
             ("v1", "Service"): core.Service,
             ("networking.k8s.io/v1", "NetworkPolicy"): networking.NetworkPolicy,
             ("monitoring.coreos.com/v1", "PodMonitor"): monitoring_v1.PodMonitor,
             ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring_v1.ServiceMonitor,
             ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring_v1.PrometheusRule}
    return {key: _pin(strict(cls.model_json_schema(by_alias=True, mode="validation"), True),
                      *key)
            for key, cls in kinds.items()}


@functools.cache
def all_schemas(crd_dir: Path | None = None) -> dict[tuple[str, str], dict]:
    """Every kind's schema; the KubeRay ones from `crd_dir` (default: `default_crd_dir()`)."""
    return {**model_schemas(), **crd_schemas(crd_dir or default_crd_dir())}


def _path(error: jsonschema.ValidationError) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)


def _messages(schema: dict, instance: Any, source: str) -> list[str]:
    """One line per error; for anyOf/oneOf (pydantic's Optional) the most specific sub-error."""
    out = []
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path)):
        while error.context:  # skip the `null` branch of Optional fields
            real = [e for e in error.context if not (e.validator == "type"
                                                     and e.validator_value == "null")]
            error = jsonschema.exceptions.best_match(real or error.context)
        out.append(f"{source}: {_path(error)}: {error.message}")
    return out


def validate_document(doc: dict, source: str,
                      schemas: dict[tuple[str, str], dict] | None = None) -> list[str]:
    schemas = all_schemas() if schemas is None else schemas
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in schemas:
        return [f"{source}: no schema for apiVersion={key[0]} kind={key[1]}"]
    return _messages(schemas[key], doc, source)


@functools.cache
def serve_schema() -> dict:
    """Ray Serve's config schema, strict: Ray's pydantic models ignore unknown fields, so a
    misspelt deployment option (autoscalling_config) would silently do nothing."""
    from ray.serve.schema import ServeDeploySchema

    return strict(ServeDeploySchema.model_json_schema(), True)


# ----- YAML ---------------------------------------------------------------------------------


def lint_yaml(text: str, source: str) -> list[str]:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(YAMLLINT_CONFIG)
    return [f"{source}:{p.line}:{p.column}: {p.message} ({p.rule})"
            for p in linter.run(text, config) if p.level == "error"]


def load_documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


# ----- serveConfigV2 ------------------------------------------------------------------------


def _built_deployment_infos(app_name: str, config: Any) -> dict[str, Any]:
    """The DeploymentInfos the Serve controller would get from build_app, built offline (no Ray
    cluster) and *without* build_app's `check_supported`, which is a start-up check."""
    from ray.serve._private.build_app import build_app as serve_build_app
    from ray.serve._private.deploy_utils import deploy_args_to_deployment_info

    from glm53.deployments.app import ingress_app, server_app

    device = config.device or "cuda"
    app = ingress_app({config.model_name: server_app(config, device)}, config.http,
                      config.drain_timeout_s)
    built = serve_build_app(app, name=app_name)
    return {d.name: deploy_args_to_deployment_info(
                deployment_name=d.name,
                deployment_config_proto_bytes=d._deployment_config.to_proto_bytes(),
                replica_config_proto_bytes=d._replica_config.to_proto_bytes(),
                deployer_job_id="offline-validation", app_name=app_name,
                ingress=d.name == built.ingress_deployment_name)
            for d in built.deployments}


def check_serve_config(serve_config: Any, source: str) -> tuple[Report, dict[str, Any]]:
    """Validate one Serve config (dict). Returns the report and, per app name, the
    ServingConfig and the final DeploymentInfos (for the convention checks)."""
    from pydantic import ValidationError
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve.schema import ServeDeploySchema

    from glm53.deployments.config import NotSupportedYetError, ServingConfig

    report, apps = Report(), {}
    unknown = _messages(serve_schema(), serve_config, f"{source}: Ray Serve config schema")
    if unknown:
        report.errors += unknown
        return report, apps
    try:
        schema = ServeDeploySchema.model_validate(serve_config)
    except ValidationError as exc:
        report.errors.append(f"{source}: Ray Serve config schema: {exc}")
        return report, apps
    for app in schema.applications:
        where = f"{source}: application {app.name!r}"
        if app.import_path != APP_IMPORT_PATH:
            report.errors.append(f"{where}: import_path {app.import_path!r}, expected "
                                 f"{APP_IMPORT_PATH!r}")
            continue
        try:
            config = ServingConfig.model_validate(app.args or {})
        except ValidationError as exc:
            report.errors.append(f"{where}: args are not a valid ServingConfig: {exc}")
            continue
        try:
            config.check_supported()
        except NotSupportedYetError as exc:
            report.notes.append(f"{where}: schema-valid, but cannot start with this build "
                                f"(feature not implemented yet): {exc}")
        try:
            infos = override_deployment_info(_built_deployment_infos(app.name, config), app)
        except (ValueError, TypeError) as exc:
            report.errors.append(f"{where}: deployments overrides: {exc}")
            continue
        apps[app.name] = (config, infos)
    return report, apps


# ----- conventions (style rule 10) ----------------------------------------------------------


@functools.cache
def expected_versions() -> dict[str, str]:
    """Ray version and image tag, from pyproject.toml and the Dockerfile (which must agree)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pin = next(d for d in project["dependencies"] if d.startswith("ray["))
    ray_version = pin.split("==")[1]
    dockerfile = (REPO / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:([0-9.]+)-\S+", dockerfile, re.M)
    label = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', dockerfile)
    return {"ray": ray_version, "image": f"glm53:{project['version']}-ray{ray_version}",
            "dockerfile_ray": base.group(1) if base else "",
            "dockerfile_tag": f"glm53:{label.group(1)}" if label else ""}


def check_versions() -> list[str]:
    v = expected_versions()
    errors = []
    if v["dockerfile_ray"] != v["ray"]:
        errors.append(f"Dockerfile: base image Ray {v['dockerfile_ray']!r} != pyproject pin "
                      f"{v['ray']!r}")
    if v["dockerfile_tag"] != v["image"]:
        errors.append(f"Dockerfile: image version label gives {v['dockerfile_tag']!r}, "
                      f"expected {v['image']!r}")
    return errors


def _containers(pod_template: dict) -> list[dict]:
    spec = pod_template.get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def check_cluster_spec(spec: dict, where: str, image: str | None = None) -> list[str]:
    """Rule 10 on a RayClusterSpec: versions, head without GPUs, requests = limits, named
    ports, one GPU pair per worker pod with /dev/shm and a read-only model volume."""
    v, errors = expected_versions(), []
    image = image or v["image"]
    if spec.get("rayVersion") != v["ray"]:
        errors.append(f"{where}: rayVersion {spec.get('rayVersion')!r} != image Ray {v['ray']!r}")
    head = spec.get("headGroupSpec", {})
    if head.get("rayStartParams", {}).get("num-gpus") != "0":
        errors.append(f"{where}: the head must start with num-gpus: \"0\"")
    groups = [("head", head)] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        template = group.get("template", {})
        for c in _containers(template):
            cw = f"{where}: group {name} container {c.get('name')}"
            if c.get("image") != image:
                errors.append(f"{cw}: image {c.get('image')!r}, expected {image!r}")
            res = c.get("resources", {})
            if res.get("requests") != res.get("limits"):
                errors.append(f"{cw}: resources.requests != resources.limits")
            errors += [f"{cw}: port {p.get('containerPort')} has no name"
                       for p in c.get("ports", []) if not p.get("name")]
        errors += _check_termination(template, f"{where}: group {name}")
        if name == "head":
            continue
        errors += _check_pair_pod(template, f"{where}: group {name}")
    return errors


def pre_stop_s(container: dict) -> float:
    """Seconds a container's preStop hook sleeps (Kubernetes' sleep action or `sleep N`)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)\b",
                      " ".join(hook.get("exec", {}).get("command", [])))
    return float(match.group(1)) if match else 0.0


def ray_drain_s(container: dict) -> float:
    """How long `ray start` in this container drains its node on SIGTERM."""
    value = next((e.get("value") for e in container.get("env", [])
                  if e.get("name") == RAY_DRAIN_ENV), None)
    return float(value) if value is not None else RAY_DRAIN_DEFAULT_S


def _check_termination(template: dict, where: str) -> list[str]:
    """Kubernetes sends SIGKILL terminationGracePeriodSeconds after the deletion; the preStop
    hook and then Ray's node drain must both fit before it."""
    spec = template.get("spec", {})
    grace = spec.get("terminationGracePeriodSeconds", K8S_GRACE_DEFAULT_S)
    errors = []
    for c in spec.get("containers", []):
        pre_stop, drain = pre_stop_s(c), ray_drain_s(c)
        if grace <= pre_stop + drain:
            errors.append(f"{where} container {c.get('name')}: terminationGracePeriodSeconds "
                          f"{grace} must exceed the preStop sleep ({pre_stop:g} s) + "
                          f"{RAY_DRAIN_ENV} ({drain:g} s): Kubernetes would kill Ray mid-drain")
    return errors


def check_drain(apps: dict[str, Any], spec: dict, where: str) -> list[str]:
    """A RayService's replicas drain for up to graceful_shutdown_timeout_s: Ray's node drain
    on every pod (replicas and proxies may run on any) and the old cluster's life after an
    upgrade switched traffic must be at least that long."""
    timeouts = {f"{app_name!r} deployment {name!r}": info.deployment_config
                .graceful_shutdown_timeout_s
                for app_name, (_, infos) in apps.items() for name, info in infos.items()}
    if not timeouts:
        return []
    longest = max(timeouts, key=timeouts.get)
    need = timeouts[longest]
    errors = []
    delay = spec.get("rayClusterDeletionDelaySeconds", DELETION_DELAY_DEFAULT_S)
    if delay < need:
        errors.append(f"{where}: rayClusterDeletionDelaySeconds {delay} < graceful_shutdown_"
                      f"timeout_s {need:g} of application {longest}: an upgrade would delete "
                      "the old cluster while its requests drain")
    cluster = spec.get("rayClusterConfig", {})
    groups = [("head", cluster.get("headGroupSpec", {}))] + [
        (g.get("groupName"), g) for g in cluster.get("workerGroupSpecs", [])]
    for group_name, group in groups:
        for c in group.get("template", {}).get("spec", {}).get("containers", []):
            if ray_drain_s(c) < need:
                errors.append(f"{where}: group {group_name} container {c.get('name')}: "
                              f"{RAY_DRAIN_ENV} {ray_drain_s(c):g} < graceful_shutdown_"
                              f"timeout_s {need:g} of application {longest}: a pod deletion "
                              "would stop Ray before its replicas drained")
    return errors


def _check_pair_pod(template: dict, where: str) -> list[str]:
    errors, spec = [], template.get("spec", {})
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("containers", []):
        if c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") != "2":
            errors.append(f"{where}: a worker pod is one GPU pair (nvidia.com/gpu: \"2\")")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        shm = volumes.get(mounts.get("/dev/shm", {}).get("name"), {})
        if shm.get("emptyDir", {}).get("medium") != "Memory":
            errors.append(f"{where}: /dev/shm must be a memory-backed emptyDir")
        model = mounts.get("/model")
        pvc = volumes.get(model["name"], {}).get("persistentVolumeClaim") if model else None
        if not model or not model.get("readOnly") or not pvc or not pvc.get("readOnly"):
            errors.append(f"{where}: /model must be a read-only mount of a read-only PVC")
    return errors


def _pod_gpus(group: dict) -> str | None:
    return group["template"]["spec"]["containers"][0]["resources"]["limits"].get(
        "nvidia.com/gpu")


def check_serve_against_cluster(apps: dict[str, Any], cluster: dict, where: str) -> list[str]:
    """Each engine replica = one pair pod: a multi-GPU replica reserves its engine and one GPU
    per rank in one STRICT_PACK placement group (so all of it lands on one GPU pod, never on
    the GPU-less head), every GPU worker group's pods offer exactly that many GPUs (one replica
    per pod), and the autoscaling bounds = the group's bounds."""
    errors = []
    groups = [g for g in cluster.get("workerGroupSpecs", []) if _pod_gpus(g)]
    for app_name, (config, infos) in apps.items():
        for name, info in infos.items():
            if not name.startswith("LLMServer:"):
                continue
            dw = f"{where}: application {app_name!r} deployment {name!r}"
            replica = info.replica_config
            bundles = replica.placement_group_bundles or []
            if config.world_size > 1 and (
                    replica.placement_group_strategy != "STRICT_PACK"
                    or sum(b.get("GPU", 0) for b in bundles) != config.world_size):
                errors.append(f"{dw}: the replica must reserve its engine and "
                              f"{config.world_size} GPUs in one STRICT_PACK placement group "
                              f"(placement_group_bundles), not {bundles} "
                              f"{replica.placement_group_strategy}")
            if not groups:
                errors.append(f"{dw}: no worker group offers GPUs")
            for group in groups:
                if str(config.world_size) != _pod_gpus(group):
                    errors.append(f"{dw}: engine world size {config.world_size} != GPUs per "
                                  f"pod {_pod_gpus(group)} of group {group.get('groupName')}")
                auto = info.deployment_config.autoscaling_config
                if auto is not None and (auto.min_replicas, auto.max_replicas) != (
                        group.get("minReplicas", 0), group.get("maxReplicas")):
                    errors.append(f"{dw}: autoscaling {auto.min_replicas}..{auto.max_replicas} "
                                  f"!= worker group {group.get('minReplicas', 0)}.."
                                  f"{group.get('maxReplicas')}")
    return errors


# ----- documents and files ------------------------------------------------------------------


def check_document(doc: dict, source: str, image: str | None = None,
                   schemas: dict[tuple[str, str], dict] | None = None) -> Report:
    report = Report(errors=validate_document(doc, source, schemas))
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    where = f"{source}: {kind} {doc.get('metadata', {}).get('name')}"
    if kind == "RayService":
        if spec.get("upgradeStrategy", {}).get("type") not in UPGRADE_TYPES:
            report.errors.append(f"{where}: upgradeStrategy.type must be one of "
                                 f"{sorted(UPGRADE_TYPES)}")
        text = spec.get("serveConfigV2", "")
        report.errors += lint_yaml(text, f"{where} serveConfigV2")
        serve_report, apps = check_serve_config(yaml.safe_load(text) or {},
                                                f"{where} serveConfigV2")
        report.extend(serve_report)
        cluster = spec.get("rayClusterConfig", {})
        report.errors += check_cluster_spec(cluster, where, image)
        report.errors += check_serve_against_cluster(apps, cluster, where)
        report.errors += check_drain(apps, spec, where)
    elif kind == "RayCluster":
        report.errors += check_cluster_spec(spec, where, image)
    elif kind == "PrometheusRule":
        test_file = K8S / "monitoring" / "prometheus-rule.glm53.promtool-test.yaml"
        rules_report = monitoring.check_rules(doc, test_file, where)
        report.extend(Report(rules_report[0], rules_report[1]))
    elif kind == "ConfigMap" and any(k.endswith(".json") for k in doc.get("data", {})):
        for key, text in doc["data"].items():
            report.errors += monitoring.check_dashboard_text(text, f"{where} {key}")
    return report


def kustomize(directory: Path) -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {proc.stderr.strip()}")
    return proc.stdout


def _shown(path: Path) -> str:
    """How a file is named in messages: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def expand(paths: Iterable[Path]) -> list[Path]:
    """The named files and the YAML and JSON files under the named folders, each once."""
    files = set()
    for path in paths:
        if path.is_dir():
            files |= {p for p in path.rglob("*") if p.suffix in (".yaml", ".json")}
        elif path.is_file():
            files.add(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")
    return sorted(files)


def check_file(path: Path, schemas: dict[tuple[str, str], dict]) -> Report:
    shown, text = _shown(path), path.read_text()
    if path.suffix == ".json":
        return Report(errors=monitoring.check_dashboard_text(text, shown))
    if path.suffix != ".yaml":
        return Report(errors=[f"{shown}: neither a .yaml nor a .json file"])
    report = Report(errors=lint_yaml(text, shown))
    if path.name == "kustomization.yaml":
        report.extend(check_kustomization(path, schemas))
    elif path.name.startswith("serve-config."):
        report.extend(check_serve_config(yaml.safe_load(text), shown)[0])
    elif not path.name.endswith(".promtool-test.yaml"):  # read by the PrometheusRule's check
        for i, doc in enumerate(load_documents(text)):
            report.extend(check_document(doc, f"{shown}#{i}", schemas=schemas))
    return report


def check_kustomization(kustomization: Path, schemas: dict[tuple[str, str], dict]) -> Report:
    """The `kubectl kustomize` rendering of the folder (a note when kubectl is missing)."""
    directory = kustomization.parent
    try:
        rendered = kustomize(directory)
    except RuntimeError as exc:
        return Report(errors=[str(exc)])
    if rendered is None:
        return Report(notes=[f"kubectl not found: {_shown(directory)} not rendered"])
    report, where = Report(), f"kustomize {_shown(directory)}"
    images = {d["newName"] + ":" + d["newTag"] for d in
              yaml.safe_load(kustomization.read_text()).get("images", [])}
    for i, doc in enumerate(load_documents(rendered)):
        report.errors += validate_document(doc, f"{where}#{i}", schemas)
        if doc.get("kind") in ("RayService", "RayCluster"):
            # serveConfigV2 etc. were checked on the plain file; only the rendering is new
            spec = doc["spec"].get("rayClusterConfig", doc["spec"])
            report.errors += check_cluster_spec(spec, f"{where}#{i}", next(iter(images), None))
    return report


def validate_paths(paths: Iterable[Path] = (K8S,), crd_dir: Path | None = None) -> Report:
    """Every file named in `paths` or under its folders, and the repository's version pins."""
    schemas = all_schemas(crd_dir or default_crd_dir())
    report = Report(errors=check_versions())
    for path in expand(paths):
        report.extend(check_file(path, schemas))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate Kubernetes manifests offline.")
    parser.add_argument("paths", nargs="*", type=Path, default=[K8S], metavar="PATH",
                        help="files or folders to validate (default: k8s/)")
    parser.add_argument("--crds", type=Path, metavar="DIR",
                        help="folder of the KubeRay CRDs (default: ../shared/k8s-crds/ when it "
                             "exists, else .k8s-crds/ as filled by `make k8s-crds`)")
    args = parser.parse_args(argv)
    try:
        report = validate_paths(args.paths, args.crds and args.crds.resolve())
    except (CrdsNotFound, FileNotFoundError) as exc:
        parser.error(str(exc))
    for note in report.notes:
        print(f"note: {note}")
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    print(f"validate_k8s: {len(report.errors)} error(s), {len(report.notes)} note(s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
