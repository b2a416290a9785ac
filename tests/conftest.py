"""Shared fixtures: one local Ray instance per test session (loopback only, fake GPUs)."""

from __future__ import annotations

import logging
import os

import pytest

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
    yield ray
    ray.shutdown()
