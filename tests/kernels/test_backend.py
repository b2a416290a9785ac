"""The kernel backend switch: every Triton kernel has a reference twin with the same signature,
and `ops` routes to Triton on CUDA tensors (or when forced) and to the reference otherwise."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from glm53.kernels import ops

pytest.importorskip("triton")


@pytest.mark.parametrize("module", ops.KERNEL_MODULES)
def test_every_triton_kernel_has_a_reference_twin(module):
    fast = importlib.import_module(f"glm53.kernels.{module}")
    slow = importlib.import_module(f"glm53.kernels.ref.{module}")
    assert fast.__all__, f"kernels/{module}.py exports no kernel"
    for name in fast.__all__:
        twin = getattr(slow, name, None)
        assert twin is not None, f"kernels/{module}.py:{name} has no twin in kernels/ref"
        assert inspect.signature(getattr(fast, name)) == inspect.signature(twin), name
        assert name in ops.__all__, f"{name} is not an op"


def test_ops_dispatch_follows_the_backend(monkeypatch):
    calls = []
    kernels = dict(ops.triton_kernels())
    kernels["gated_rms_norm"] = lambda *a, **k: calls.append("triton") or a[0]
    monkeypatch.setattr(ops, "_triton", kernels)
    x = torch.ones(2, 4)
    try:
        ops.gated_rms_norm(x, x, x[0], 1e-6)  # CPU tensor under "auto": the reference
        assert calls == []
        ops.use("triton")
        assert ops.gated_rms_norm(x, x, x[0], 1e-6) is x and calls == ["triton"]
        ops.use("ref")
        ops.gated_rms_norm(x, x, x[0], 1e-6)
        assert calls == ["triton"]
        with pytest.raises(ValueError, match="unknown kernel backend"):
            ops.use("cuda")
    finally:
        ops.use("auto")
    assert ops.gated_rms_norm.ref is importlib.import_module("glm53.kernels.ref.kda").gated_rms_norm


def test_every_kernel_module_is_registered():
    from pathlib import Path

    folder = Path(ops.__file__).parent
    # a module with a reference twin holds ops; the others (utils, kda_chunk) are their helpers
    found = {p.stem for p in folder.glob("*.py") if (folder / "ref" / p.name).exists()}
    assert found - {"__init__"} == set(ops.KERNEL_MODULES)
