"""Checkpoint provenance: the SHA-256 manifest (`glm53 verify`), what it catches, and the
LLM server refusing a checkpoint that does not match when `verify` is on."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from glm53.deployments import tiny_model
from glm53.deployments.cli import _parser, main
from glm53.deployments.config import ServingConfig
from glm53.deployments.llm_server import LLMServer, checkpoint_provenance, describe_provenance
from glm53.deployments.provenance import (
    MANIFEST_NAME,
    ProvenanceError,
    read_manifest,
    verify,
    write_manifest,
)
from glm53.deployments.serve_cli import serving_config
from tests.deployments.scripted_engine import ScriptedEngine


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A fresh copy with a manifest, free to be tampered with."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, out)
    (out / "sub").mkdir()
    (out / "sub" / "extra.json").write_text("{}")
    write_manifest(out, progress=False)
    return out


def test_manifest_lists_every_file_with_its_sha256(ckpt: Path):
    manifest = read_manifest(ckpt)
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME)
    assert sorted(manifest.files) == files and "sub/extra.json" in files
    for rel, entry in manifest.files.items():
        data = (ckpt / rel).read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    lines = "".join(f"{e.sha256}  {e.size}  {p}\n" for p, e in sorted(manifest.files.items()))
    assert manifest.digest == hashlib.sha256(lines.encode()).hexdigest()
    assert json.loads((ckpt / MANIFEST_NAME).read_text())["digest"] == manifest.digest
    assert verify(ckpt, progress=False).digest == manifest.digest


def test_digest_does_not_depend_on_where_the_folder_lives(ckpt: Path, tmp_path: Path):
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(ckpt, moved)
    assert verify(moved, progress=False).digest == read_manifest(ckpt).digest
    (moved / ".cache").mkdir()  # hidden tool caches are not part of the checkpoint
    (moved / ".cache" / "x").write_text("x")
    assert verify(moved, progress=False).digest == read_manifest(ckpt).digest


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("tamper", "problem"), [
    (lambda d: _flip_one_byte(d / "model.safetensors"), "content differs: model.safetensors"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text() + " "),
     "size differs: config.json"),
    (lambda d: (d / "sub" / "extra.json").unlink(), "missing: sub/extra.json"),
    (lambda d: (d / "model-00002.safetensors").write_bytes(b"x"),
     "unexpected: model-00002.safetensors"),
])
def test_verify_names_each_difference(ckpt: Path, tamper, problem: str):
    tamper(ckpt)
    with pytest.raises(ProvenanceError, match=problem):
        verify(ckpt, progress=False)


def test_a_missing_or_edited_manifest_is_refused(ckpt: Path, tmp_path: Path):
    with pytest.raises(ProvenanceError, match="has no manifest.*glm53 verify --write"):
        verify(tmp_path, progress=False)
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    data["files"]["config.json"]["sha256"] = "0" * 64
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ProvenanceError, match="manifest was edited"):
        verify(ckpt, progress=False)
    (ckpt / MANIFEST_NAME).write_text("not json")
    with pytest.raises(ProvenanceError, match="is not a glm53 manifest"):
        read_manifest(ckpt)


def test_glm53_verify_command(tiny_checkpoint: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]):
    model, draft = tmp_path / "model", tmp_path / "draft"
    shutil.copytree(tiny_checkpoint, model)
    shutil.copytree(tiny_checkpoint, draft)
    assert main(["verify", "--write", str(model), str(draft)]) == 0
    digest = read_manifest(model).digest
    assert f"sha256 {digest}" in capsys.readouterr().out
    assert main(["verify", str(model), str(draft)]) == 0
    assert capsys.readouterr().out.count(": OK,") == 2
    _flip_one_byte(draft / "model.safetensors")
    assert main(["verify", str(model), str(draft)]) == 1  # every folder is still checked
    captured = capsys.readouterr()
    assert f"{model}: OK" in captured.out and "content differs" in captured.err
    elsewhere = tmp_path / "manifests" / "m.json"
    elsewhere.parent.mkdir()
    assert main(["verify", "--write", "--manifest", str(elsewhere), str(model)]) == 0
    assert main(["verify", "--manifest", str(elsewhere), str(model)]) == 0
    with pytest.raises(SystemExit, match="exactly one DIR"):
        main(["verify", "--manifest", str(elsewhere), str(model), str(draft)])


def test_serve_verify_flag_and_the_model_card(ckpt: Path):
    config = serving_config(_parser().parse_args(["serve", "--verify", "--model", str(ckpt)]))
    assert config.verify and not ServingConfig().verify
    digest = read_manifest(ckpt).digest
    prov = checkpoint_provenance(config, ckpt)
    assert prov == {"model": {"manifest_sha256": digest, "verified": True}}
    assert f"model sha256 {digest} (verified)" in describe_provenance(prov)
    unverified = ServingConfig(model=str(ckpt), speculative="none")
    assert checkpoint_provenance(unverified, ckpt)["model"]["verified"] is False
    server = LLMServer(ServingConfig(model=str(ckpt), speculative="none", verify=True),
                       engine_factory=ScriptedEngine)
    assert server.model_card()["provenance"] == prov
    (ckpt / MANIFEST_NAME).unlink()
    assert checkpoint_provenance(unverified, ckpt) is None
    assert "no checkpoint manifest" in describe_provenance(None)


def test_serve_verify_refuses_a_tampered_checkpoint_before_loading(ckpt: Path):
    _flip_one_byte(ckpt / "model.safetensors")
    built = []

    def factory(*args):
        built.append(args)
        return ScriptedEngine(*args)

    with pytest.raises(ProvenanceError, match="content differs: model.safetensors"):
        LLMServer(ServingConfig(model=str(ckpt), speculative="none", verify=True),
                  engine_factory=factory)
    assert not built  # nothing was loaded
    # without --verify the replica starts (the manifest only labels what is served)
    LLMServer(ServingConfig(model=str(ckpt), speculative="none"), engine_factory=factory)
    assert len(built) == 1


def test_verify_covers_the_dflash_draft(ckpt: Path, tiny_checkpoint: Path, tmp_path: Path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_checkpoint, draft)
    config = ServingConfig(model=str(ckpt), verify=True, speculative={
        "method": "dflash", "draft_model": str(draft)})
    with pytest.raises(ProvenanceError, match="draft.*has no manifest"):
        checkpoint_provenance(config, ckpt)
    write_manifest(draft, progress=False)
    prov = checkpoint_provenance(config, ckpt)
    assert prov["draft_model"]["manifest_sha256"] == read_manifest(draft).digest


def test_the_embedded_tiny_model_carries_a_manifest(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    path = tiny_model.embedded_tiny_model()
    assert verify(path, progress=False).files  # written at build time, and it matches
