"""Checks and helpers for k8s/monitoring/: alert rules (promtool) and the Grafana dashboard
(PromQL of every panel, metric names, Grafana variables). Used by validate_k8s.py,
render_dashboard.py and tests/k8s/.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

# Grafana's variables, replaced before parsing / querying: $__rate_interval by a window that
# holds several scrapes, dashboard variables by their "All" value.
DEFAULT_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
OUR_METRIC = re.compile(r"\b((?:vllm|glm53):[A-Za-z0-9_:]+)")


def promtool() -> str | None:
    return shutil.which("promtool")


# ----- alert rules --------------------------------------------------------------------------


def check_rules(rule: dict, test_file: Path, where: str) -> tuple[list[str], list[str]]:
    """`promtool check rules` and `promtool test rules` on a PrometheusRule's spec. Returns
    (errors, notes); without promtool only the metric names are checked (and a note says so)."""
    errors, notes = [], []
    groups = (rule.get("spec") or {}).get("groups", [])
    for group in groups:
        for r in group.get("rules", []):
            errors += [f"{where}: rule {r.get('alert') or r.get('record')}: {e}"
                       for e in unknown_metric_names(str(r.get("expr", "")))]
    tool = promtool()
    if tool is None:
        notes.append(f"{where}: promtool not found, rules not checked (apt-get install "
                     "prometheus)")
        return errors, notes
    with tempfile.TemporaryDirectory() as tmp:
        rules_path = Path(tmp) / "glm53.rules.yaml"
        rules_path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        shutil.copy(test_file, Path(tmp) / test_file.name)
        for args in (["check", "rules", rules_path.name], ["test", "rules", test_file.name]):
            proc = subprocess.run([tool, *args], cwd=tmp, capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                errors.append(f"{where}: promtool {' '.join(args[:2])} failed:\n"
                              f"{proc.stdout}{proc.stderr}")
    return errors, notes


# ----- metric names -------------------------------------------------------------------------


@functools.cache
def app_metric_names() -> frozenset[str]:
    """Every sample name the serving app exports (histograms' _bucket/_sum/_count, counters'
    _total), from a ServingMetrics registry with one draft position."""
    from glm53.deployments.metrics import ServingMetrics

    registry = ServingMetrics("probe", num_spec_positions=1).registry
    return frozenset(s.name for family in registry.collect() for s in family.samples)


def unknown_metric_names(expr: str) -> list[str]:
    return [f"unknown metric {name!r} (not exported by glm53.deployments.metrics)"
            for name in sorted(set(OUR_METRIC.findall(expr))) if name not in app_metric_names()]


# ----- dashboard ----------------------------------------------------------------------------


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana's `$name`, `${name}` and `[[name]]` forms (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        value = variables[name]
        expr = expr.replace("${" + name + "}", value).replace("[[" + name + "]]", value)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", lambda _m, v=value: v, expr)
    return expr


def dashboard_variables(dashboard: dict, overrides: dict[str, str] | None = None) -> dict:
    """Grafana built-ins plus each templating variable at its "All" value (.*)."""
    variables = dict(DEFAULT_VARIABLES)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "datasource":
            variables[var["name"]] = var.get("allValue", ".*")
    variables.update(overrides or {})
    return variables


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, including those inside collapsed rows."""
    out = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def panel_queries(dashboard: dict, overrides: dict[str, str] | None = None
                  ) -> list[tuple[dict, dict, str]]:
    """(panel, target, PromQL with variables substituted) for every target."""
    variables = dashboard_variables(dashboard, overrides)
    return [(p, t, substitute(t["expr"], variables)) for p in panels(dashboard)
            for t in p.get("targets", [])]


def check_dashboard(dashboard: dict, where: str) -> list[str]:
    import promql_parser

    errors = []
    rows = [p for p in dashboard.get("panels", []) if p.get("type") == "row"]
    ids = [p.get("id") for p in rows + panels(dashboard)]
    if len(ids) != len(set(ids)):
        errors.append(f"{where}: panel ids are not unique")
    known = set(dashboard_variables(dashboard)) | {"datasource"}
    for panel in panels(dashboard):
        pw = f"{where}: panel {panel.get('title')!r}"
        grid = panel.get("gridPos", {})
        if grid.get("x", 0) + grid.get("w", 0) > 24:
            errors.append(f"{pw}: gridPos wider than 24 columns")
        targets = panel.get("targets", [])
        if not targets:
            errors.append(f"{pw}: no targets")
        if len({t.get("refId") for t in targets}) != len(targets):
            errors.append(f"{pw}: duplicate refId")
        for target in targets:
            expr = target.get("expr", "")
            used = set(re.findall(r"\$\{?(\w+)", expr))
            errors += [f"{pw}: unknown variable ${v}" for v in sorted(used - known)]
            errors += [f"{pw}: {e}" for e in unknown_metric_names(expr)]
    for panel, target, expr in panel_queries(dashboard):
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            errors.append(f"{where}: panel {panel.get('title')!r} {target.get('refId')}: "
                          f"PromQL does not parse: {exc}: {expr}")
    return errors


def check_dashboard_text(text: str, where: str) -> list[str]:
    try:
        dashboard = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"{where}: not JSON: {exc}"]
    return check_dashboard(dashboard, where)


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
