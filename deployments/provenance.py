"""Checkpoint provenance: a SHA-256 manifest of a checkpoint folder, written once, checked
before serving.

The manifest (`glm53-manifest.json` inside the folder) lists every file of the folder by its
relative POSIX path with its size and SHA-256, except the manifest itself and hidden entries
(tool caches such as `.cache/`). Its digest is the SHA-256 of that canonical listing, so the
same files give the same digest wherever the folder lives; that digest identifies what a
replica serves (`/v1/models`, the start-up log). Checking re-hashes every file and reports
each changed, missing and unexpected file: an extra `*.safetensors` shard or an edited
`config.json` changes what loads, so both are mismatches.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MANIFEST_NAME = "glm53-manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 2**20  # hashlib releases the GIL on large updates, so threads hash in parallel


class ProvenanceError(ValueError):
    """A checkpoint does not match its manifest, or has none."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    files: dict[str, FileEntry]  # relative POSIX path -> entry

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical listing (`sha256  size  path` lines, sorted by path)."""
        lines = "".join(f"{e.sha256}  {e.size}  {p}\n" for p, e in sorted(self.files.items()))
        return hashlib.sha256(lines.encode()).hexdigest()

    @property
    def num_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, "digest": self.digest,
                           "files": {p: {"size": e.size, "sha256": e.sha256}
                                     for p, e in sorted(self.files.items())}}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != MANIFEST_FORMAT:
                raise ProvenanceError(f"{source}: unknown manifest format {data.get('format')!r}")
            manifest = cls({p: FileEntry(int(e["size"]), str(e["sha256"]))
                            for p, e in data["files"].items()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ProvenanceError):
                raise
            raise ProvenanceError(f"{source} is not a glm53 manifest: {exc}") from None
        if data.get("digest") != manifest.digest:
            raise ProvenanceError(f"{source}: its digest does not match its file list "
                                  "(the manifest was edited)")
        return manifest


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Every file the manifest covers: relative POSIX path -> path (sorted)."""
    out: dict[str, Path] = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if not name.startswith(".") and rel != MANIFEST_NAME:
                out[rel] = path
    return out


def _sha256(path: Path, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def hash_folder(folder: str | Path, progress: bool = True) -> Manifest:
    """The manifest of `folder` as it is now (files hashed in parallel, a progress bar)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProvenanceError(f"{folder} is not a directory")
    files = checkpoint_files(folder)
    sizes = {rel: path.stat().st_size for rel, path in files.items()}
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, disable=not progress,
              desc=f"sha256 {folder.name}") as bar, ThreadPoolExecutor(
                  min(8, os.cpu_count() or 1)) as pool:
        digests = dict(zip(files, pool.map(lambda p: _sha256(p, bar), files.values()),
                           strict=True))
    return Manifest({rel: FileEntry(sizes[rel], digests[rel]) for rel in files})


def manifest_path(folder: str | Path, path: str | Path | None = None) -> Path:
    return Path(path) if path is not None else Path(folder) / MANIFEST_NAME


def write_manifest(folder: str | Path, path: str | Path | None = None,
                   progress: bool = True) -> Manifest:
    manifest = hash_folder(folder, progress)
    manifest_path(folder, path).write_text(manifest.to_json())
    return manifest


def read_manifest(folder: str | Path, path: str | Path | None = None) -> Manifest | None:
    """The recorded manifest (no hashing), or None when the folder has none."""
    target = manifest_path(folder, path)
    if not target.exists():
        return None
    return Manifest.from_json(target.read_text(), str(target))


def verify(folder: str | Path, path: str | Path | None = None,
           progress: bool = True) -> Manifest:
    """Check `folder` against its manifest; raise ProvenanceError naming every difference."""
    recorded = read_manifest(folder, path)
    if recorded is None:
        raise ProvenanceError(f"{folder} has no manifest ({manifest_path(folder, path)}); "
                              f"write one with `glm53 verify --write {folder}`")
    present = checkpoint_files(Path(folder))
    problems = [f"missing: {p}" for p in sorted(set(recorded.files) - set(present))]
    problems += [f"unexpected: {p}" for p in sorted(set(present) - set(recorded.files))]
    problems += [f"size differs: {p}" for p in sorted(set(present) & set(recorded.files))
                 if present[p].stat().st_size != recorded.files[p].size]
    if not problems:  # sizes match: now the (slow) hashes
        actual = hash_folder(folder, progress)
        problems = [f"content differs: {p}" for p in sorted(recorded.files)
                    if actual.files[p].sha256 != recorded.files[p].sha256]
    if problems:
        shown = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more"
                                            if len(problems) > 20 else "")
        raise ProvenanceError(f"{folder} does not match its manifest "
                              f"(sha256 {recorded.digest[:16]}…): {shown}")
    return recorded
