#!/usr/bin/env python3
"""Render the Grafana dashboard's panels to a PNG from a live Prometheus (no Grafana needed).

    .venv/bin/python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        [--dashboard k8s/monitoring/grafana-dashboard.glm53.json] [--out dashboard.png] \
        [--minutes 15] [--rate-interval 1m]

Each panel's targets run through Prometheus' /api/v1/query_range with Grafana's variables
substituted ($__rate_interval, dashboard variables at "All"); panels are laid out by gridPos.
tests/k8s/test_live_monitoring.py renders docs/dashboard.png with it from a live `glm53 serve`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monitoring  # noqa: E402  (scripts/ is not a package)

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "k8s" / "monitoring" / "grafana-dashboard.glm53.json"
UNIT_SCALE = {"percentunit": (100.0, "%"), "percent": (1.0, "%"), "s": (1.0, "s"),
              "reqps": (1.0, "req/s"), "short": (1.0, "")}


@dataclass
class Series:
    legend: str
    times: list[float]
    values: list[float]


def prom_get(url: str, path: str, **params: Any) -> Any:
    """GET a Prometheus API path; returns `data`, raises on an error status."""
    response = httpx.get(url.rstrip("/") + path, params=params, timeout=30)
    body = response.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def legend(fmt: str, metric: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f"{k}={v}" for k, v in metric.items()) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def query_panels(url: str, dashboard: dict, start: float, end: float, step: float,
                 variables: dict[str, str] | None = None) -> dict[int, list[Series]]:
    """Panel id -> series, from query_range of every target."""
    out: dict[int, list[Series]] = {}
    for panel, target, expr in monitoring.panel_queries(dashboard, variables):
        data = prom_get(url, "/api/v1/query_range", query=expr, start=start, end=end, step=step)
        for result in data["result"]:
            points = [(float(t), float(v)) for t, v in result["values"]]
            out.setdefault(panel["id"], []).append(Series(
                legend(target.get("legendFormat", ""), result["metric"]),
                [t for t, _ in points], [v for _, v in points]))
    return out


def render(dashboard: dict, data: dict[int, list[Series]], out: Path, subtitle: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = dashboard.get("panels", [])
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in items)
    unit_h, width = 0.42, 22.0  # inches per grid row, figure width
    height = bottom * unit_h + 0.9
    fig = plt.figure(figsize=(width, height), dpi=80)
    fig.suptitle(f"{dashboard.get('title', '')}  {subtitle}", x=0.01, y=1 - 0.25 / height,
                 ha="left", fontsize=15, fontweight="bold")
    top = 0.7 / height  # room for the title

    def box(grid: dict) -> tuple[float, float, float, float]:
        x0, w = grid["x"] / 24, grid["w"] / 24
        y0 = top + grid["y"] * unit_h / height
        h = grid["h"] * unit_h / height
        return x0, 1 - y0 - h, w, h

    for panel in items:
        x, y, w, h = box(panel["gridPos"])
        if panel.get("type") == "row":
            fig.text(x + 0.005, y + h / 2, panel.get("title", ""), fontsize=12,
                     fontweight="bold", va="center", color="#333")
            continue
        ax = fig.add_axes((x + 0.035, y + 0.22 * h, w - 0.045, 0.62 * h))
        ax.set_title(panel.get("title", ""), fontsize=10, loc="left")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        scale, suffix = UNIT_SCALE.get(unit, (1.0, ""))
        series = data.get(panel["id"], [])
        t0 = min((s.times[0] for s in series if s.times), default=0.0)
        drawn = 0
        for s in series:
            values = [v * scale if math.isfinite(v) else math.nan for v in s.values]
            if all(math.isnan(v) for v in values):
                continue
            ax.plot([t - t0 for t in s.times], values, label=s.legend, linewidth=1.2)
            drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data" if not series else "no samples (NaN: 0/0)",
                    ha="center", va="center", transform=ax.transAxes, color="#888")
        else:
            ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
        ax.set_xlabel("seconds", fontsize=7)
        if suffix:
            ax.set_ylabel(suffix, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", required=True, help="e.g. http://127.0.0.1:9090")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    parser.add_argument("--minutes", type=float, default=15)
    parser.add_argument("--rate-interval", default="1m")
    args = parser.parse_args(argv)
    dashboard = monitoring.load_dashboard(args.dashboard)
    end = time.time()
    start = end - args.minutes * 60
    step = max(1.0, (end - start) / 300)
    data = query_panels(args.prometheus, dashboard, start, end, step,
                        {"__rate_interval": args.rate_interval})
    render(dashboard, data, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
