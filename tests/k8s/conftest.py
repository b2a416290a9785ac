"""Loads scripts/validate_k8s.py, k8s_conventions.py and monitoring.py (scripts/ is not a
package)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
K8S = REPO / "k8s"
# the KubeRay CRDs where validate_k8s.py looks for them: the project's shared copy, else what
# `make k8s-crds` fetched
CRD_DIRS = (REPO.parent / "shared" / "k8s-crds", REPO / ".k8s-crds")
CRDS = next((d for d in CRD_DIRS if d.is_dir()), CRD_DIRS[0])
needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRDs in none of {', '.join(map(str, CRD_DIRS))} "
                              "(`make k8s-crds` fetches them)")


def load_script(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def vk() -> ModuleType:
    return load_script("validate_k8s")


@pytest.fixture(scope="session")
def conventions() -> ModuleType:
    return load_script("k8s_conventions")


@pytest.fixture(scope="session")
def mon() -> ModuleType:
    return load_script("monitoring")


def needs_prometheus(tool: str = "promtool"):
    """Skip without Debian's prometheus package locally; fail in CI, which installs it
    (.ci/run sets GLM53_REQUIRE_PROMETHEUS=1), so a broken install cannot hide as a skip."""
    missing = shutil.which(tool) is None
    if missing and os.environ.get("GLM53_REQUIRE_PROMETHEUS") == "1":
        return pytest.mark.usefixtures("_prometheus_required")
    return pytest.mark.skipif(missing, reason=f"{tool} missing (apt-get install "
                              "--no-install-recommends prometheus; .ci/run installs it)")


@pytest.fixture
def _prometheus_required():
    pytest.fail("GLM53_REQUIRE_PROMETHEUS=1 but Debian's prometheus package is not installed")
