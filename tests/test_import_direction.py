"""Import direction of the four layers: kernels <- actors <- raycluster <- deployments.

Static check with `ast` (nothing is imported): a layer may import only itself and the layers
below it. Relative imports are resolved to absolute names first, so `from ..deployments import x`
inside actors/ counts, and so do `importlib.import_module("glm53...")` calls with literal names.
The serving layer (deployments/) sees the engine through one door, `glm53.raycluster.api`: it
imports public names of that module only, and nothing from actors/ or kernels/ directly.
Likewise the kernels have one door, `glm53.kernels.ops`: runtime code outside kernels/ never
imports the references under `glm53.kernels.ref` (tests and benchmarks may, to compare).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "actors", "raycluster", "deployments")  # lowest first
NAMESPACE = "glm53"
ENGINE_API = f"{NAMESPACE}.raycluster.api"  # the one module deployments/ imports from below
KERNEL_REFS = f"{NAMESPACE}.kernels.ref"  # reached only through glm53.kernels.ops outside kernels/


def _source_files() -> list[Path]:
    return sorted(
        p for layer in LAYERS for p in (REPO / layer).rglob("*.py") if "__pycache__" not in p.parts
    )


def _package_of(path: Path) -> list[str]:
    """Dotted package (as parts) that `path`'s relative imports are resolved against."""
    rel = path.relative_to(REPO).with_suffix("").parts
    return [NAMESPACE, *rel[:-1]]


@dataclass(frozen=True)
class Imp:
    target: str  # absolute dotted name
    lineno: int
    relative: bool
    escapes: bool  # a relative import that climbs above glm53.<layer>
    names_source: bool = False  # the `M` of `from M import names` (the names come as well)


def _imports(path: Path, source: str | None = None) -> Iterator[Imp]:
    if source is None:
        source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    package = _package_of(path)
    own_layer = package[:2]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Imp(alias.name, node.lineno, False, False)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
                relative = escapes = False
            else:
                keep = len(package) - (node.level - 1)
                relative = True
                # Climbing above glm53.<layer> leaves the layer (or even the distribution).
                escapes = keep < len(own_layer)
                base_parts = package[:keep] if keep > 0 else ["<above-glm53>"]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            yield Imp(base, node.lineno, relative, escapes, names_source=True)
            # `from glm53 import actors` / `from .. import actors` name a module via the alias.
            for alias in node.names:
                yield Imp(f"{base}.{alias.name}", node.lineno, relative, escapes)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield Imp(first.value, node.lineno, False, False)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _layer_of(target: str) -> str | None:
    parts = target.split(".")
    if len(parts) >= 2 and parts[0] == NAMESPACE and parts[1] in LAYERS:
        return parts[1]
    return None


def _where(path: Path, imp: Imp) -> str:
    return f"{path.relative_to(REPO)}:{imp.lineno} imports {imp.target}"


FILES = _source_files()


def test_there_are_files_to_check() -> None:
    assert any(p.name == "__init__.py" for p in FILES)
    for layer in LAYERS:
        assert (REPO / layer / "__init__.py").is_file(), layer


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_downwards(layer: str) -> None:
    forbidden = set(LAYERS[LAYERS.index(layer) + 1 :])
    bad = [
        _where(path, imp)
        for path in FILES
        if path.relative_to(REPO).parts[0] == layer
        for imp in _imports(path)
        if _layer_of(imp.target) in forbidden
    ]
    assert not bad, f"{layer} may not import {sorted(forbidden)}:\n" + "\n".join(bad)


def _engine_door_violation(imp: Imp) -> str | None:
    """Why a deployments/ import goes around `glm53.raycluster.api`, or None if it does not."""
    layer = _layer_of(imp.target)
    if imp.names_source:  # the imported names are checked instead
        return None
    if layer in ("kernels", "actors"):
        return "reaches below raycluster (re-export it from glm53.raycluster.api)"
    if layer != "raycluster" or imp.target == ENGINE_API:
        return None
    name = imp.target.removeprefix(ENGINE_API + ".")
    if name != imp.target and "." not in name and not name.startswith("_"):
        return None
    return f"is not a public name of {ENGINE_API}"


def test_serving_layer_imports_only_the_engine_api() -> None:
    bad = [
        f"{_where(path, imp)}: {why}"
        for path in FILES
        if path.relative_to(REPO).parts[0] == "deployments"
        for imp in _imports(path)
        if (why := _engine_door_violation(imp))
    ]
    assert not bad, "\n".join(bad)


def test_engine_door_checker_sees_violations() -> None:
    # Guard the rule itself: a would-be deployments/mod.py, one import per line.
    source = (
        "from glm53.raycluster.api import LLMEngine, SamplingParams\n"  # 1 fine
        "from glm53.raycluster import api\n"  # 2 fine
        "import glm53.raycluster.api\n"  # 3 fine
        "from glm53.raycluster.engine import LLMEngine\n"  # 4 another raycluster module
        "from glm53.raycluster import engine\n"  # 5 the same, by alias
        "from glm53.raycluster.api import _private\n"  # 6 a private name
        "from glm53.actors.step import SamplingParams\n"  # 7 around the door
        "import glm53.kernels.ops\n"  # 8 around the door
        "import glm53.raycluster\n"  # 9 the package, whose modules are then reachable
        "from .config import ServingConfig\n"  # 10 its own layer
    )
    flagged = {imp.lineno for imp in _imports(REPO / "deployments" / "mod.py", source)
               if _engine_door_violation(imp)}
    assert flagged == {4, 5, 6, 7, 8, 9}


def _reaches_kernel_refs(imp: Imp) -> bool:
    return imp.target == KERNEL_REFS or imp.target.startswith(KERNEL_REFS + ".")


def test_runtime_reaches_kernel_references_only_through_ops() -> None:
    bad = [
        f"{_where(path, imp)}: use glm53.kernels.ops"
        for path in FILES
        if path.relative_to(REPO).parts[0] != "kernels"
        for imp in _imports(path)
        if _reaches_kernel_refs(imp)
    ]
    assert not bad, "\n".join(bad)


def test_kernel_refs_checker_sees_violations() -> None:
    # Guard the rule itself: a would-be actors/mod.py, one import per line.
    source = (
        "from glm53.kernels import ops\n"  # 1 fine
        "from glm53.kernels.ops import sample\n"  # 2 fine
        "from glm53.kernels.ref.sampling import sample\n"  # 3 around the door
        "from glm53.kernels import ref\n"  # 4 the same, by alias
        "import glm53.kernels.ref.rejection\n"  # 5 the same, plain import
        "import glm53.kernels.reference_free\n"  # 6 a different name that starts alike
    )
    flagged = {imp.lineno for imp in _imports(REPO / "actors" / "mod.py", source)
               if _reaches_kernel_refs(imp)}
    assert flagged == {3, 4, 5}


def test_relative_imports_stay_inside_their_layer() -> None:
    # Cross-layer imports must be spelled `glm53.<layer>...` so the direction is visible.
    bad = [
        _where(path, imp) + " (relative import leaves its layer)"
        for path in FILES
        for imp in _imports(path)
        if imp.relative and imp.escapes
    ]
    assert not bad, "\n".join(bad)


def test_no_bare_top_level_layer_imports() -> None:
    # `import kernels` only works with the repository root on sys.path (e.g. `python -m pytest`
    # from it); installed, the code lives under glm53. PyPI also has unrelated `kernels`/`actors`.
    bad = [
        _where(path, imp)
        for path in FILES
        for imp in _imports(path)
        if not imp.relative and imp.target.split(".")[0] in LAYERS
    ]
    assert not bad, "use glm53.<layer> imports:\n" + "\n".join(bad)


def test_resolver_sees_violations() -> None:
    # Guard the checker itself: a would-be actors/sub/mod.py with every kind of upward import.
    source = (
        "import glm53.raycluster.x\n"
        "from glm53 import deployments\n"
        "from ...deployments import cli\n"
        "from .. import raycluster\n"
        "import importlib\n"
        "importlib.import_module('glm53.deployments.cli')\n"
    )
    imps = list(_imports(REPO / "actors" / "sub" / "mod.py", source))
    layers = {(i.lineno, _layer_of(i.target)) for i in imps}
    assert {(1, "raycluster"), (2, "deployments"), (3, "deployments"), (6, "deployments")} <= layers
    # `from .. import raycluster` inside actors/sub names glm53.actors.raycluster: no violation.
    assert (4, "raycluster") not in layers
    assert any(i.lineno == 3 and i.escapes for i in imps)
    assert not any(i.lineno == 4 and i.escapes for i in imps)
