"""scripts/validate_k8s.py as a user runs it: it validates the files and folders it is given,
reads the KubeRay CRDs from --crds (default: ../shared/k8s-crds/, else what `make k8s-crds`
fetched) and says how to get them when they are missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.k8s.conftest import CRDS, K8S, REPO, needs_crds

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _copy_with(tmp_path, name: str, edit) -> str:
    doc = yaml.safe_load((K8S / name).read_text())
    edit(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def _rename_worker_groups(doc: dict) -> None:
    doc["spec"]["workerGroupSpecs"][0]["groupname"] = "x"


@needs_crds
def test_only_the_named_file_is_validated(tmp_path):
    bad = _copy_with(tmp_path, "ray-cluster.dev.yaml", _rename_worker_groups)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "validate_k8s.py"), bad],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{bad}#0: $.spec.workerGroupSpecs[0]: Additional properties are not allowed " \
           "('groupname' was unexpected)" in proc.stderr
    assert "1 error(s)" in proc.stdout  # k8s/ itself was not read: no other file reported


@needs_crds
def test_a_named_folder_is_validated(vk, tmp_path, capsys):
    _copy_with(tmp_path, "model-pvc.yaml", lambda d: d["spec"].update(accesModes=["x"]))
    (tmp_path / "notes.txt").write_text("not a manifest")  # a folder's other files are skipped
    assert vk.main([str(tmp_path), "--crds", str(CRDS)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'model-pvc.yaml'}#0: $.spec: " in err and "'accesModes'" in err
    assert "k8s/" not in err


@needs_crds
def test_crds_come_from_the_option(vk, tmp_path, capsys):
    """A RayCluster CRD without `enableInTreeAutoscaling` makes the dev cluster fail."""
    crds = tmp_path / "crds"
    crds.mkdir()
    crd = yaml.load((CRDS / "ray.io_rayclusters.yaml").read_text(), Loader=_LOADER)
    for version in crd["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "enableInTreeAutoscaling"]
    (crds / "ray.io_rayclusters.yaml").write_text(yaml.dump(crd, Dumper=_DUMPER))
    manifest = str(K8S / "ray-cluster.dev.yaml")
    assert vk.main([manifest, "--crds", str(CRDS)]) == 0
    assert vk.main([manifest, "--crds", str(crds)]) == 1
    assert "'enableInTreeAutoscaling' was unexpected" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_crd_folder_without_crds_is_a_usage_error(vk, tmp_path, capsys, folder):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        vk.main([str(K8S / "model-pvc.yaml"), "--crds", str(tmp_path / folder)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / folder) in err and ("no such folder" in err or "make k8s-crds" in err)


def test_without_crds_the_error_says_how_to_fetch_them(vk, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vk, "CRD_DIRS", (tmp_path / "shared" / "k8s-crds", tmp_path / "mine"))
    with pytest.raises(SystemExit) as exc:
        vk.main([])
    assert exc.value.code == 2
    assert "run `make k8s-crds`" in capsys.readouterr().err


def _pinned_kuberay() -> str:
    """The KubeRay release the README and the RayService manifests name (they must agree)."""
    named = set(re.findall(r"KubeRay operator (v\d+\.\d+\.\d+)", (REPO / "README.md").read_text()))
    for path in K8S.glob("ray-service.*.yaml"):
        named |= set(re.findall(r"KubeRay operator (v\d+\.\d+\.\d+)", path.read_text()))
    assert len(named) == 1, named
    return named.pop()


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("curl")), reason="make, curl")
def test_make_k8s_crds_fetches_the_pinned_release(tmp_path):
    version = _pinned_kuberay()
    dry = subprocess.run(["make", "-n", "k8s-crds"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    base = f"https://raw.githubusercontent.com/ray-project/kuberay/{version}/helm-chart/" \
           "kuberay-operator/crds"
    files = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml")
    assert base in dry and all(f in dry for f in files), dry
    ignored = subprocess.run(["git", "check-ignore", ".k8s-crds/ray.io_rayservices.yaml"],
                             cwd=REPO, capture_output=True, text=True)
    assert ignored.returncode == 0  # the fetched copy never lands in a commit
    if CRDS.is_dir():  # the same recipe, from the shared copy instead of GitHub
        out = tmp_path / "crds"
        subprocess.run(["make", "k8s-crds", f"KUBERAY_CRDS={out}",
                        f"KUBERAY_CRD_URL=file://{CRDS}"], cwd=REPO, capture_output=True,
                       check=True)
        for name in files:
            assert (out / name).read_bytes() == (CRDS / name).read_bytes()
