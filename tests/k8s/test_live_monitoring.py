"""Live monitoring check: Debian's Prometheus on 127.0.0.1 scrapes a running `glm53 serve`
(the app's /metrics) and the Ray metrics agent of the shared test cluster, evaluates our alert
rules, and answers every dashboard query after traffic; the dashboard is rendered to a PNG.

`glm53 serve` runs as a subprocess that joins the session's Ray cluster (RAY_ADDRESS), like a
driver on a KubeRay head. Set GLM53_DASHBOARD_PNG=docs/dashboard.png to refresh the committed
picture from this run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.k8s.conftest import REPO, load_script, needs_prometheus

pytestmark = [needs_prometheus("prometheus"), pytest.mark.slow]  # starts Prometheus and Grafana

DASHBOARD = REPO / "k8s" / "monitoring" / "grafana-dashboard.glm53.json"
RULE = REPO / "k8s" / "monitoring" / "prometheus-rule.glm53.yaml"
RATE = "20s"  # $__rate_interval here: scrapes every second, a short test
# Targets whose series are legitimately absent today (asserted: the query succeeds).
MAY_BE_EMPTY = {
    ("GPU utilization", "A"): "the session cluster's GPUs are fake; Ray reports no utilization",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None,
          log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, RuntimeError):
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log else ""
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{tail}")
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def serve_url(ray_session, tmp_path_factory):
    """`glm53 serve` (tiny model, CPU, default profile) joined to the session's Ray cluster."""
    node = ray_session._private.worker._global_node
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "RAY_ADDRESS": node.gcs_address}
    # the default profile (lang-mtp3): MTP speculation on the embedded tiny checkpoint
    cmd = [str(Path(sys.executable).parent / "glm53"), "serve", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("glm53 serve /health", lambda: httpx.get(f"{url}/health", timeout=5)
              .status_code == 200, 240, proc, log)
        yield url, node.metrics_export_port
    finally:
        _stop(proc)
        from ray import serve

        serve.shutdown()  # in case the subprocess could not (the cluster is shared)


@pytest.fixture(scope="module")
def prometheus(serve_url, tmp_path_factory):
    url, ray_metrics_port = serve_url
    tmp = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(RULE.read_text())["spec"]
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            # the job names the PodMonitors give (k8s/monitoring/pod-monitor.*.yaml)
            {"job_name": "glm53-serve", "metrics_path": "/metrics",
             "static_configs": [{"targets": [url.removeprefix("http://")],
                                 "labels": {"pod": "local-head"}}]},
            {"job_name": "glm53-ray",
             "static_configs": [{"targets": [f"127.0.0.1:{ray_metrics_port}"],
                                 "labels": {"ray_node_type": "head",
                                            "ray_io_cluster": "local"}}]},
        ]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = _free_port()
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["prometheus", "--config.file=prometheus.yml", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{port}"], cwd=tmp, stdout=out,
            stderr=subprocess.STDOUT)
    prom = f"http://127.0.0.1:{port}"
    try:
        _wait("prometheus ready", lambda: httpx.get(f"{prom}/-/ready", timeout=2).is_success,
              60, proc, log)
        yield prom
    finally:
        _stop(proc, signal.SIGTERM, 30)


def _traffic(url: str, seconds: float) -> None:
    """Bounded load on 127.0.0.1: completions and chat, streamed and not, one request that
    ends by length, one invalid request (400) and one unknown model (404)."""
    bodies = [("/v1/completions", {"model": "glm53-tiny", "prompt": "hello there",
                                   "max_tokens": 12, "temperature": 0}),
              ("/v1/chat/completions", {"model": "glm53-tiny", "max_tokens": 8, "stream": True,
                                        "messages": [{"role": "user", "content": "Hi"}]}),
              ("/v1/completions", {"model": "glm53-tiny", "prompt": [1, 2, 3, 4, 5],
                                   "max_tokens": 24, "ignore_eos": True})]
    with httpx.Client(timeout=120) as client:
        client.post(f"{url}/v1/completions", json={"model": "glm53-tiny", "prompt": "x",
                                                    "max_tokenz": 3})
        client.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            path, body = bodies[i % len(bodies)]
            client.post(f"{url}{path}", json=body).raise_for_status()
            i += 1


def _query(prom: str, expr: str) -> list:
    render = load_script("render_dashboard")
    return render.prom_get(prom, "/api/v1/query", query=expr)["result"]


def test_dashboard_queries_return_data_and_render(serve_url, prometheus, tmp_path):
    url, _ = serve_url
    mon, render = load_script("monitoring"), load_script("render_dashboard")
    start = time.time()
    workers = [threading.Thread(target=_traffic, args=(url, 12)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    # counters must have moved between scrapes and Ray's agent must have reported
    _wait("rate of generated tokens", lambda: any(
        float(r["value"][1]) > 0 for r in _query(
            prometheus, f"rate(vllm:generation_tokens_total[{RATE}])")), 30)
    _wait("Ray Serve replica health", lambda: _query(
        prometheus, "ray_serve_deployment_replica_healthy"), 60)
    _wait("Ray Serve HTTP errors", lambda: _query(
        prometheus, "ray_serve_num_http_error_requests_total"), 60)

    dashboard = mon.load_dashboard(DASHBOARD)
    empty = []
    for panel, target, expr in mon.panel_queries(dashboard, {"__rate_interval": RATE}):
        result = _query(prometheus, expr)  # raises unless the query succeeded
        key = (panel["title"], target["refId"])
        if not result and key not in MAY_BE_EMPTY:
            empty.append(f"{key}: {expr}")
    assert empty == [], "dashboard targets without data:\n" + "\n".join(empty)

    # latency percentiles and throughput carry real numbers
    ttft = _query(prometheus, "histogram_quantile(0.95, sum by (le) "
                              f"(rate(vllm:time_to_first_token_seconds_bucket[{RATE}])))")
    assert 0 < float(ttft[0]["value"][1]) < 60
    reasons = {r["metric"]["finished_reason"] for r in _query(
        prometheus, "vllm:request_success_total > 0")}
    assert {"stop", "length"} & reasons

    # every alert rule evaluates cleanly against the live series
    groups = render.prom_get(prometheus, "/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 8 and all(r["health"] == "ok" for r in rules), rules

    end = time.time()
    data = render.query_panels(prometheus, dashboard, start - 30, end, 1.0,
                               {"__rate_interval": RATE})
    out = tmp_path / "dashboard.png"
    render.render(dashboard, data, out, subtitle="(live: glm53 serve, tiny model with MTP, CPU)")
    assert out.stat().st_size > 50_000
    if os.environ.get("GLM53_DASHBOARD_PNG"):
        target = Path(os.environ["GLM53_DASHBOARD_PNG"])
        target.write_bytes(out.read_bytes())
