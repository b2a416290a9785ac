"""Shared fixtures: one local Ray instance per test session (loopback only, fake GPUs), and
the tiny checkpoints and tokenizer, each built once per session (tests/tiny.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.tiny import TINY, TinyCheckpoints

# Ray reads these at init: keep it on 127.0.0.1, no token auth, no telemetry.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

FAKE_GPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster with FAKE_GPUS fake GPUs, shared by every Ray test."""
    import ray

    if not ray.is_initialized():
        # address="local": always a private cluster, never a `ray start` one on this machine
        ray.init(address="local", num_cpus=8, num_gpus=FAKE_GPUS, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    # a Ray started implicitly by an earlier test has no fake GPUs: every placement group of a
    # worker or pair test would wait forever, so say so instead
    assert ray.cluster_resources().get("GPU", 0) >= FAKE_GPUS, \
        "Ray was started before ray_session, without its fake GPUs (a Ray API called outside Ray)"
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> TinyCheckpoints:
    """make_tiny(**spec), each distinct spec written once per session (tests/tiny.py)."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints: TinyCheckpoints) -> Path:
    """The tiny checkpoint a test takes unless it needs another (tests/tiny.py: TINY)."""
    return tiny_checkpoints(**TINY)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A directory holding only the tiny GLM-style tokenizer (every tiny checkpoint's)."""
    from glm53.deployments.tiny_tokenizer import write_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    """The tiny tokenizer, loaded (shared: tests must not change it)."""
    from glm53.deployments.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)
