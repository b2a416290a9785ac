"""The documentation keeps pointing at things that exist.

Recorded benchmark results are named by what they measure and the commit they measured
(`<what>_<device>_<commit>.json`), so a newer run adds a file instead of overwriting one, and
every result file the docs or the code name must exist.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULT_NAME = re.compile(r"^[a-z0-9_]+_(?P<commit>[0-9a-f]{7})\.json$")
# a result file as docs and docstrings name it: `..._<commit>.json`, bare or under results/
NAMED_RESULT = re.compile(r"(?<![\w*<>/])(?:benchmarks/results/)?([a-z0-9_]+_[0-9a-f]{7}\.json)")


def _commits(record) -> Iterator[str]:
    """Every value of a "commit" key, at any depth of a result file."""
    if isinstance(record, dict):
        for key, value in record.items():
            if key == "commit" and isinstance(value, str):
                yield value
            else:
                yield from _commits(value)
    elif isinstance(record, list):
        for item in record:
            yield from _commits(item)


RESULT_FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_result_files() -> None:
    assert RESULT_FILES


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_result_file_is_named_by_what_and_a_commit_it_records(path: Path) -> None:
    match = RESULT_NAME.match(path.name)
    assert match, f"{path.name}: name it <what>_<device>_<commit>.json"
    recorded = list(_commits(json.loads(path.read_text())))
    assert any(c.startswith(match["commit"]) for c in recorded), (
        f"{path.name}: commit {match['commit']} is not among those it records {recorded}")


def _doc_files() -> list[Path]:
    docs = [REPO / "README.md", REPO / "benchmarks" / "README.md"]
    code = [p for folder in ("benchmarks", "kernels", "actors", "scripts")
            for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh")]
    return docs + sorted(code)


def test_result_files_named_in_docs_and_code_exist() -> None:
    named = {(path.relative_to(REPO), name) for path in _doc_files()
             for name in NAMED_RESULT.findall(path.read_text(encoding="utf-8"))}
    assert named, "the checker found no result file names at all"
    missing = [f"{where}: {name}" for where, name in sorted(named)
               if not (RESULTS / name).is_file()]
    assert not missing, "\n".join(missing)


# --- README: one decode step, hop by hop ------------------------------------------------------

STEP_TABLE_HEADING = "### One decode step, from HTTP to kernel and back"
HOP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def _step_table_hops() -> list[tuple[str, str]]:
    """(file, dotted name) of every `file:function` cell in the README's decode-step table."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert STEP_TABLE_HEADING in text, "the README lost its decode-step table"
    section = text.split(STEP_TABLE_HEADING, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [hop for row in rows for hop in HOP.findall(row)]


def _defines(path: Path, dotted: str) -> bool:
    """Whether `path` defines `dotted` (a top-level function or class, or Class.method)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    for part in dotted.split("."):
        found = next((node for node in body if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == part),
            None)
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_step_table_names_hops_from_ingress_to_kernel() -> None:
    files = {file for file, _ in _step_table_hops()}
    assert len(files) >= 15  # the whole way: deployments, raycluster, actors, kernels
    assert {"deployments/ingress.py", "raycluster/scheduler.py", "actors/worker.py",
            "kernels/ops.py"} <= files


@pytest.mark.parametrize("file, name", _step_table_hops(), ids=lambda v: v)
def test_step_table_hop_exists(file: str, name: str) -> None:
    path = REPO / file
    assert path.is_file(), f"README step table: {file} does not exist"
    assert _defines(path, name), f"README step table: {file} defines no {name}"


def test_defines_sees_missing_names(tmp_path: Path) -> None:
    # Guard the checker itself.
    mod = tmp_path / "mod.py"
    mod.write_text("class A:\n    def run(self):\n        def inner(): ...\n"
                   "async def go(): ...\n")
    assert _defines(mod, "A") and _defines(mod, "A.run") and _defines(mod, "go")
    assert not _defines(mod, "A.stop") and not _defines(mod, "run")
    assert not _defines(mod, "A.run.inner") and not _defines(mod, "B")
