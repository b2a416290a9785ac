"""Offline validation of k8s/: the real manifests pass, and an injected typo fails (CI gate).

Each typo test edits a copy of a real manifest and runs the same checks CI runs, so the
assertions name the message a person would see.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.k8s.conftest import K8S, REPO, needs_crds, needs_prometheus

needs_promtool = needs_prometheus("promtool")


# every check runs the validator, which reads the KubeRay CRDs first
pytestmark = needs_crds


def _doc(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def _serve(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def _with_serve(doc: dict, serve: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve, sort_keys=False)
    return doc


@pytest.fixture(scope="module")
def repo_report(vk):
    return vk.validate_paths()


def test_all_manifests_pass(repo_report):
    assert repo_report.errors == []


def test_unimplemented_features_are_notes_not_errors(repo_report):
    """The profile names stay in the manifests. `ServingConfig` parses them (schema-valid);
    `check_supported`, which build_app runs at start-up, refuses features not built yet
    (speculation, as of writing), and the validator reports exactly that as a note."""
    from glm53.deployments.config import NotSupportedYetError, ServingConfig

    notes = "\n".join(repo_report.notes)
    for name in ("ray-service.lang-mtp3.yaml", "ray-service.lang-dflash2.yaml"):
        doc = _doc(name)
        config = ServingConfig.model_validate(_serve(doc)["applications"][0]["args"])
        try:
            config.check_supported()
            refusal = None
        except NotSupportedYetError as exc:
            refusal = str(exc)
        line = next((n for n in repo_report.notes
                     if f"RayService {doc['metadata']['name']} " in n), None)
        if refusal is None:
            assert line is None, line
        else:
            assert line is not None and refusal in line and "schema-valid" in line
    assert "serve-config.dev.yaml" not in notes  # the dev config runs today


def test_a_refused_feature_is_a_note(vk, monkeypatch):
    from glm53.deployments.config import NotSupportedYetError, ServingConfig

    def refuse(self):
        raise NotSupportedYetError("vision input is not supported yet")

    monkeypatch.setattr(ServingConfig, "check_supported", refuse)
    report, apps = vk.check_serve_config(_serve(_doc("ray-service.lang-mtp3.yaml")), "x")
    assert report.errors == [] and "glm53" in apps
    assert report.notes == ["x: application 'glm53': schema-valid, but cannot start with this "
                            "build (feature not implemented yet): vision input is not "
                            "supported yet"]


def test_manifest_set_and_naming():
    names = sorted(p.name for p in K8S.glob("*.yaml"))
    assert {"ray-service.lang-mtp3.yaml", "ray-service.lang-dflash2.yaml",
            "ray-cluster.dev.yaml", "kustomization.yaml"} <= set(names)
    for name in names:  # one feature per file, KubeRay's naming
        assert name.split(".")[0] in {"ray-service", "ray-cluster", "model-pvc",
                                      "kustomization", "serve-config", "network-policy"}, name


def test_profiles_share_one_cluster_shape():
    """The two RayServices differ only where the profile does (names, Serve args, drafter)."""
    a, b = _doc("ray-service.lang-mtp3.yaml"), _doc("ray-service.lang-dflash2.yaml")
    ca, cb = a["spec"]["rayClusterConfig"], b["spec"]["rayClusterConfig"]
    mounts = cb["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert mounts[-1]["mountPath"] == "/draft-model"
    cb = copy.deepcopy(cb)
    del cb["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMounts"][-1]
    assert ca == cb
    rest = ("serveConfigV2", "rayClusterConfig")
    assert ({k: v for k, v in a["spec"].items() if k not in rest}
            == {k: v for k, v in b["spec"].items() if k not in rest})
    assert _serve(a)["applications"][0]["args"]["profile"] == "lang-mtp3"
    assert _serve(b)["applications"][0]["args"]["profile"] == "lang-dflash2"


# ----- injected typos -----------------------------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"].update(
        rayStartParamz=d["spec"]["rayClusterConfig"]["headGroupSpec"].pop("rayStartParams")),
     "'rayStartParamz' was unexpected"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="4"),
     "'4' is not of type 'integer'"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0].update(imagePullPolicy=7), "7 is not of type 'string'"),
    (lambda d: d["spec"].update(serveConfigV3=d["spec"]["serveConfigV2"]),
     "'serveConfigV3' was unexpected"),
    (lambda d: d["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"),
     "'Fast' is not one of"),
])
def test_crd_schema_typos_fail(vk, edit, message):
    doc = _doc("ray-service.lang-mtp3.yaml")
    edit(doc)
    errors = vk.validate_document(doc, "typo")
    assert any(message in e for e in errors), errors


def test_dev_raycluster_typo_fails(vk):
    doc = _doc("ray-cluster.dev.yaml")
    doc["spec"]["workerGroupSpecs"][0]["groupname"] = "x"
    assert any("'groupname' was unexpected" in e for e in vk.validate_document(doc, "typo"))


@pytest.mark.parametrize("name, edit, message", [
    ("model-pvc.yaml", lambda d: d["spec"].update(accesModes=["ReadOnlyMany"]),
     "'accesModes' was unexpected"),
    ("monitoring/pod-monitor.serve.yaml",
     lambda d: d["spec"]["podMetricsEndpoints"][0].update(intervl="15s"),
     "'intervl' was unexpected"),
    ("monitoring/prometheus-rule.glm53.yaml",
     lambda d: d["spec"]["groups"][0]["rules"][0].update(fore="10m"), "'fore' was unexpected"),
    ("network-policy.yaml", lambda d: d["spec"]["ingress"][1]["ports"][0].update(prot="TCP"),
     "'prot' was unexpected"),
])
def test_builtin_and_prometheus_operator_typos_fail(vk, name, edit, message):
    doc = _doc(name)
    assert vk.validate_document(doc, name) == []
    edit(doc)
    assert any(message in e for e in vk.validate_document(doc, name))


@pytest.mark.parametrize("name", ["ray-service.lang-mtp3.yaml", "ray-service.lang-dflash2.yaml"])
def test_ray_ports_are_cluster_internal_and_keys_come_from_a_secret(name):
    """Every Ray pod is under the NetworkPolicy (only glm53's pods reach its Ray ports;
    clients only 8000) and every container gets the API keys from the Secret."""
    policy = _doc("network-policy.yaml")
    assert "network-policy.yaml" in _doc("kustomization.yaml")["resources"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert [p["port"] for r in open_rules for p in r["ports"]] == [8000]
    cluster = _doc(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert selected.items() <= labels.items()
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["GLM53_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
            "name": "glm53-api-keys", "key": "keys"}
    assert "api_keys" not in _serve(_doc(name))["applications"][0]["args"].get("http", {})


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["applications"][0]["args"].update(max_num_seq=8),
     "args are not a valid ServingConfig"),
    (lambda s: s["applications"][0]["args"].update(profile="lang-mtp4"), "unknown profile"),
    (lambda s: s["applications"][0]["args"].update(speculative="medusa"),
     "args are not a valid ServingConfig"),
    (lambda s: s["applications"][0]["deployments"][0].update(name="LLMServer:glm-5.3"),
     "Deployment 'LLMServer:glm-5.3' does not exist"),
    (lambda s: s["applications"][0]["deployments"][0].update(autoscalling_config={}),
     "Ray Serve config schema"),
    (lambda s: s["applications"][0].update(import_path="glm53.deployments.app:buildapp"),
     "import_path"),
])
def test_serve_config_typos_fail(vk, edit, message):
    serve = _serve(_doc("ray-service.lang-mtp3.yaml"))
    report, _ = vk.check_serve_config(serve, "ok")
    assert report.errors == []
    edit(serve)
    report, _ = vk.check_serve_config(serve, "typo")
    assert any(message in e for e in report.errors), report.errors


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["spec"]["rayClusterConfig"].update(rayVersion="2.59.0"), "rayVersion"),
    (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(
        {"num-gpus": "1"}), "num-gpus"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0]["resources"]["requests"].update({"nvidia.com/gpu": "1"}),
     "requests != resources.limits"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0]["ports"][0].pop("name"), "has no name"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas=8),
     "autoscaling 1..4 != worker group 1..8"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0].update(image="glm53:latest"), "image 'glm53:latest'"),
    (lambda d: d["spec"]["upgradeStrategy"].update(type="BlueGreen"), "upgradeStrategy.type"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0]["volumeMounts"][1].pop("readOnly"), "/model must be a read-only"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
     .update(terminationGracePeriodSeconds=300), "terminationGracePeriodSeconds 300 must "
     "exceed the preStop sleep (15 s) + RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (310 s)"),
    (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
     ["containers"][0].update(env=[]), "group head container ray-head: "
     "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S 30 < graceful_shutdown_timeout_s 300"),
    (lambda d: d["spec"].update(rayClusterDeletionDelaySeconds=60),
     "rayClusterDeletionDelaySeconds 60 < graceful_shutdown_timeout_s 300"),
])
def test_convention_violations_fail(vk, edit, message):
    doc = _doc("ray-service.lang-mtp3.yaml")
    edit(doc)
    report = vk.check_document(doc, "typo")
    assert any(message in e for e in report.errors), report.errors


def test_drain_timeout_drives_both_deployments_and_the_pods(vk):
    """`drain_timeout_s` in the app's args sets both deployments' graceful shutdown; a longer
    one than the pods' Ray drain fails, as does a dev cluster without a grace period."""
    doc = _doc("ray-service.lang-mtp3.yaml")
    serve = _serve(doc)
    _, apps = vk.check_serve_config(serve, "x")
    _, infos = apps["glm53"]
    assert {name: info.deployment_config.graceful_shutdown_timeout_s
            for name, info in infos.items()} == {"OpenAIIngress": 300,
                                                 "LLMServer:glm-5.3-flash": 300}
    serve["applications"][0]["args"]["drain_timeout_s"] = 600
    report = vk.check_document(_with_serve(doc, serve), "typo")
    assert any("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S 310 < graceful_shutdown_timeout_s 600"
               in e for e in report.errors), report.errors
    dev = _doc("ray-cluster.dev.yaml")
    del dev["spec"]["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"]
    report = vk.check_document(dev, "typo")
    assert any("group gpu-pair container ray-worker: terminationGracePeriodSeconds 30 must "
               "exceed" in e for e in report.errors), report.errors


def test_engine_size_must_match_the_pair(vk):
    doc = _doc("ray-service.lang-mtp3.yaml")
    serve = _serve(doc)
    serve["applications"][0]["args"]["tensor_parallel_size"] = 4
    report = vk.check_document(_with_serve(doc, serve), "typo")
    assert any("engine world size 4 != GPUs per pod 2" in e for e in report.errors)


@pytest.mark.parametrize("override", [
    {"placement_group_strategy": "PACK"},  # the engine and its GPUs could span nodes
    {"placement_group_bundles": [{"CPU": 1}, {"GPU": 1}]},  # one GPU short of the pair
])
def test_the_replica_reserves_its_pair_in_one_strict_pack_group(vk, override):
    """The app gives a pair replica [{CPU: 1}, {GPU: 1} x 2], STRICT_PACK (Serve's
    placement_group_bundles): engine and workers on one pair pod, never the head. A manifest
    whose override breaks that fails."""
    doc = _doc("ray-service.lang-mtp3.yaml")
    _, apps = vk.check_serve_config(_serve(doc), "x")
    replica = apps["glm53"][1]["LLMServer:glm-5.3-flash"].replica_config
    assert (replica.placement_group_bundles, replica.placement_group_strategy) == (
        [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], "STRICT_PACK")
    serve = _serve(doc)
    serve["applications"][0]["deployments"][0].update(override)
    report = vk.check_document(_with_serve(doc, serve), "typo")
    assert any("must reserve its engine and 2 GPUs in one STRICT_PACK placement group" in e
               for e in report.errors), report.errors


def test_yaml_lint_catches_duplicate_keys(vk):
    assert vk.lint_yaml("a: 1\na: 2\n", "dup")


def test_versions_agree_with_dockerfile_and_pyproject(conventions):
    assert conventions.check_versions() == []
    v = conventions.expected_versions()
    assert v["ray"] == "2.60.0" and v["image"].endswith("-ray2.60.0")
    assert "FROM rayproject/ray:2.60.0-py312-gpu" in (REPO / "Dockerfile").read_text()


# ----- monitoring ---------------------------------------------------------------------------


def test_dashboard_exprs_parse_and_use_our_names(mon):
    path = K8S / "monitoring" / "grafana-dashboard.glm53.json"
    assert mon.check_dashboard_text(path.read_text(), "dashboard") == []
    dash = json.loads(path.read_text())
    queries = mon.panel_queries(dash)
    assert len(queries) >= 20
    text = path.read_text()
    for needle in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                   "generation_tokens_total", "num_requests_waiting", "kv_cache_usage_perc",
                   "glm53:kda_state_slot_usage_perc", "accepted_tokens_per_pos",
                   "num_preemptions_total", "finished_reason"):
        assert needle in text, needle


@pytest.mark.parametrize("bad, message", [
    ("sum(rate(vllm:generation_tokens_total[$__rate_interval])", "does not parse"),
    ("sum(vllm:num_request_waiting)", "unknown metric 'vllm:num_request_waiting'"),
    ("sum(vllm:num_requests_waiting{model_name=~\"$modell\"})", "unknown variable $modell"),
])
def test_dashboard_typos_fail(mon, bad, message):
    dash = json.loads((K8S / "monitoring" / "grafana-dashboard.glm53.json").read_text())
    mon.panels(dash)[0]["targets"][0]["expr"] = bad
    assert any(message in e for e in mon.check_dashboard(dash, "typo"))


@needs_promtool
def test_promtool_rules_and_unit_tests_pass(mon):
    rule = _doc("monitoring/prometheus-rule.glm53.yaml")
    test_file = K8S / "monitoring" / "prometheus-rule.glm53.promtool-test.yaml"
    assert mon.check_rules(rule, test_file, "rules") == ([], [])


@needs_promtool
def test_promtool_catches_a_broken_rule_and_a_changed_threshold(mon):
    test_file = K8S / "monitoring" / "prometheus-rule.glm53.promtool-test.yaml"
    rule = _doc("monitoring/prometheus-rule.glm53.yaml")
    kv = "max by (model_name) (vllm:kv_cache_usage_perc"
    rule["spec"]["groups"][0]["rules"][2]["expr"] = kv + " > 0.95"  # unclosed parenthesis
    errors, _ = mon.check_rules(rule, test_file, "broken")
    assert any("promtool check rules failed" in e for e in errors)
    rule = _doc("monitoring/prometheus-rule.glm53.yaml")
    rule["spec"]["groups"][0]["rules"][2]["expr"] = kv + ") > 0.99"  # the unit test expects 0.95
    errors, _ = mon.check_rules(rule, test_file, "threshold")
    assert any("promtool test rules failed" in e for e in errors)


def test_prefix_caching_in_the_rayservice_routes_by_prefix(vk):
    """With `enable_prefix_caching` in the app's args, the manifest stays valid and the
    autoscaled LLM-server deployment gets the prefix-affinity request router (the
    `deployments:` overrides keep it)."""
    from glm53.deployments.prefix_router import PrefixAffinityRouter

    serve = _serve(_doc("ray-service.lang-mtp3.yaml"))
    serve["applications"][0]["args"]["enable_prefix_caching"] = True
    report, apps = vk.check_serve_config(serve, "x")
    assert report.errors == []
    server = apps["glm53"][1]["LLMServer:glm-5.3-flash"].deployment_config
    assert server.autoscaling_config.max_replicas == 4
    assert server.request_router_config.get_request_router_class() is PrefixAffinityRouter
    assert apps["glm53"][1]["OpenAIIngress"].deployment_config.request_router_config \
        .get_request_router_class() is not PrefixAffinityRouter
