"""How `glm53 bench` reports: the record header (what, where, when, which commit), plain-text
tables, and the serving plot."""

from __future__ import annotations

import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's commit, or None outside a git checkout (an installed package)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def record_header(benchmark: str, **fields) -> dict:
    return {"benchmark": benchmark, "host": platform.node(), "commit": git_commit(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), **fields}


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows as aligned text: `columns` are (heading, key); missing values print as '-'."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        if isinstance(value, (list, tuple)):
            return " ".join(cell(v) for v in value)
        return str(value)

    cells = [[heading for heading, _ in columns]]
    cells += [[cell(row.get(key)) for _, key in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(text.rjust(w) for text, w in zip(line, widths, strict=True))
                     for line in cells)


SERVE_PANELS = (("TTFT median (ms)", "ttft_ms", "p50"), ("ITL median (ms)", "itl_ms", "p50"),
                ("output tok/s (all users)", "output_tok_s", None),
                ("tok/s per user (median)", "tok_s_per_user", None))


def plot_serve(record: dict, path: str | Path) -> None:
    """One panel per metric against concurrency, one line per prompt length (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if "skipped" not in r]
    fig, axes = plt.subplots(1, len(SERVE_PANELS), figsize=(5 * len(SERVE_PANELS), 4))
    for ax, (title, key, stat) in zip(axes, SERVE_PANELS, strict=True):
        for prompt_len in sorted({r["prompt_len"] for r in rows}):
            line = sorted((r["concurrency"], r[key][stat] if stat else r[key])
                          for r in rows if r["prompt_len"] == prompt_len and r[key] is not None)
            if line:
                ax.plot(*zip(*line, strict=True), marker="o", label=f"prompt {prompt_len}")
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set(title=title, xlabel="concurrency", xticks=levels, xticklabels=levels)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"glm53 bench serve: {record['model']}, {record['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
