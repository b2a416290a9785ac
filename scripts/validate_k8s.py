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
4. Conventions (k8s_conventions.py beside this file; design/style.md §4.5 rule 10): rayVersion =
   image Ray = Dockerfile = pyproject pin, image tag = Dockerfile label, head without GPUs, GPU
   requests = limits, named ports, one pair per pod matching the engine's parallel size, Serve
   autoscaling bounds = worker group.
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
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monitoring  # noqa: E402  (scripts/ is not a package)
from k8s_conventions import (  # noqa: E402
    check_cluster_spec,
    check_drain,
    check_serve_against_cluster,
    check_versions,
)

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
