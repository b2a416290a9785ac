"""The convention checks of validate_k8s.py (its step 4; design/style.md §4.5 rule 10) on
RayCluster specs and RayServices: versions and image, head without GPUs, requests = limits,
named ports, one GPU pair per worker pod, the Serve replicas against the worker groups, and
the drain timings (issue 18). Each check returns error lines; no Kubernetes schema here.
"""

from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# on SIGTERM, `ray start --block` drains its node for this long (Ray's default 30 s)
RAY_DRAIN_ENV, RAY_DRAIN_DEFAULT_S = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", 30.0
K8S_GRACE_DEFAULT_S = 30  # terminationGracePeriodSeconds when not set
DELETION_DELAY_DEFAULT_S = 60  # KubeRay's rayClusterDeletionDelaySeconds when not set


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
