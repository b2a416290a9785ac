"""Packaging: the four top-level folders install as glm53.<folder>, editable and as a wheel.

The regular-install check builds a wheel from a copy of the sources (so the repository gets no
build/ or *.egg-info), installs it with `pip --target`, and imports it in a child interpreter
started with `-S`: no .pth file runs, so the editable finder of the development install cannot
answer, and the venv's site-packages is appended only for third-party dependencies.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "actors", "raycluster", "deployments")
NAMESPACE = "glm53"


def _pyproject() -> dict:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _package_dirs() -> dict[str, Path]:
    """Dotted package name -> folder, for every folder with an __init__.py under FOLDERS."""
    found = {}
    for folder in FOLDERS:
        for init in sorted((REPO / folder).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(REPO).parts
            found[".".join((NAMESPACE, *rel))] = init.parent
    return found


def _module_names() -> list[str]:
    """Dotted names of every module under FOLDERS (packages and plain modules)."""
    names = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            names.append(".".join((NAMESPACE, *rel)))
    return names


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# --- (a) editable install ------------------------------------------------------------------


@pytest.mark.parametrize("folder", FOLDERS)
def test_editable_install_maps_to_repository(folder: str) -> None:
    module = importlib.import_module(f"{NAMESPACE}.{folder}")
    assert Path(module.__file__).resolve().parent == REPO / folder


# --- (d) pyproject's package list matches the folders --------------------------------------


def test_pyproject_lists_exactly_the_packages_on_disk() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = set(_package_dirs())
    assert not on_disk - listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"listed but no __init__.py: {sorted(listed - on_disk)}"


def test_every_folder_with_python_files_is_a_package() -> None:
    # A folder without __init__.py is left out of the explicit package list, so its modules
    # would work in the editable install and vanish from the wheel.
    missing = sorted(
        str(d.relative_to(REPO))
        for folder in FOLDERS
        for d in {p.parent for p in (REPO / folder).rglob("*.py")}
        if "__pycache__" not in d.parts and not (d / "__init__.py").is_file()
    )
    assert not missing, f"folders with .py files but no __init__.py: {missing}"


def test_package_dir_maps_each_folder() -> None:
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert mapping == {f"{NAMESPACE}.{f}": f for f in FOLDERS}


# --- (b), (c) regular install from a wheel -------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    pip = (sys.executable, "-m", "pip", "-q", "--disable-pip-version-check")
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src, cwd=src)
    (built,) = dist.glob("glm53-*.whl")
    return built


@pytest.fixture(scope="module")
def target(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("target")
    pip = (sys.executable, "-m", "pip", "-q", "--disable-pip-version-check")
    _run(*pip, "install", "--no-deps", "--no-index", "--target", out, wheel, cwd=out)
    return out


# Runs under `python -S`: the target goes first on sys.path, site-packages (plain directory,
# no .pth processing) last, for torch & co.
_CHILD = textwrap.dedent(
    """
    import importlib, importlib.util, json, sys
    target, site_dir, packages, modules = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    sys.path.insert(0, target)
    sys.path.append(site_dir)
    origins = {}
    for name in packages.split(","):
        origins[name] = importlib.import_module(name).__file__
    for name in modules.split(","):
        spec = importlib.util.find_spec(name)
        origins[name] = None if spec is None else spec.origin
    loaded = {
        n: getattr(m, "__file__", None) for n, m in sys.modules.items() if n.startswith("glm53.")
    }
    editable = sorted(n for n in sys.modules if "__editable__" in n)
    print(json.dumps({"origins": origins, "loaded": loaded, "editable": editable}))
    """
)


def test_wheel_installs_under_glm53_and_imports_from_target(target: Path, tmp_path: Path) -> None:
    packages = sorted(_package_dirs())
    modules = _module_names()
    site_dir = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = _run(
        sys.executable, "-S", "-c", _CHILD, target, site_dir, ",".join(packages), ",".join(modules),
        cwd=tmp_path, env=env,
    )  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert report["editable"] == []
    target_prefix = str(target.resolve()) + os.sep
    for name in (*packages, *modules):
        origin = report["origins"][name]
        assert origin is not None, f"{name} is missing from the wheel"
        assert str(Path(origin).resolve()).startswith(target_prefix), f"{name} from {origin}"
    for name, origin in report["loaded"].items():
        assert origin is None or str(Path(origin).resolve()).startswith(target_prefix), name
    assert (target / NAMESPACE / "deployments" / "templates" / "glm53_chat.jinja").is_file()
    # glm53 stays a namespace: no __init__.py, so other distributions could add to it.
    assert not (target / NAMESPACE / "__init__.py").exists()


def test_wheel_has_no_top_level_folders(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
        tops = zf.read(top_level).decode().split() if top_level else []
    roots = {n.split("/", 1)[0] for n in names}
    assert not roots & set(FOLDERS), sorted(roots)
    assert {r for r in roots if not r.endswith(".dist-info")} == {NAMESPACE}
    assert not set(tops) & set(FOLDERS), tops
    module_files = {f"{'/'.join(m.split('.'))}" for m in _module_names()}
    for module in module_files:
        assert f"{module}.py" in names or f"{module}/__init__.py" in names, module


def test_venv_has_no_top_level_layer_modules_from_us(tmp_path: Path) -> None:
    # Child interpreter with the normal site setup (editable finder active), started outside
    # the repository so the working directory cannot put our folders on sys.path.
    code = textwrap.dedent(
        """
        import importlib.util, json, sys
        found = {}
        for name in sys.argv[1].split(","):
            spec = importlib.util.find_spec(name)
            where = None if spec is None else spec.origin or spec.submodule_search_locations
            found[name] = None if where is None else str(where)
        mapped = []
        for finder in sys.meta_path:
            mod = sys.modules.get(getattr(finder, "__module__", ""))
            mapped += list(getattr(mod, "MAPPING", {}))
        print(json.dumps({"found": found, "mapped": mapped}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run(sys.executable, "-c", code, ",".join(FOLDERS), cwd=tmp_path, env=env)
    report = json.loads(out.strip().splitlines()[-1])
    for name, origin in report["found"].items():
        assert origin is None or str(REPO) not in origin, f"top-level {name} comes from {origin}"
    assert all(m.startswith(f"{NAMESPACE}.") for m in report["mapped"]), report["mapped"]
