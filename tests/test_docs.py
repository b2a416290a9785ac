"""The documentation keeps pointing at things that exist.

Recorded benchmark results are named by what they measure and the commit they measured
(`<what>_<device>_<commit>.json`), so a newer run adds a file instead of overwriting one, and
every result file the docs or the code name must exist.
"""

from __future__ import annotations

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
