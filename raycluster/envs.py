"""The only place environment variables are read (typed, GLM53_-prefixed)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built artefacts (e.g. the embedded tiny checkpoint) are kept: $GLM53_CACHE_DIR,
    else $XDG_CACHE_HOME/glm53, else ~/.cache/glm53."""
    if explicit := os.environ.get("GLM53_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glm53"
