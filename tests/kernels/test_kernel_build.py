"""Every Triton kernel compiles for sm_90 (H100/H200) on a machine without a GPU.

`scripts/sm90_build.py` calls each op's wrapper on CPU tensors of the model's real shapes with
the launch replaced by a compile, in a process without the interpreter. The interpreter accepts
code the compiler rejects (a constexpr reassigned in a loop, a variable typed differently in the
two branches of an `if`), so without this a GPU run is the first to find out. Spills are pinned:
a kernel that starts spilling is a performance regression to look at, not to discover on a GPU.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the full tier (make test-all, CI): compiles every Triton kernel for sm_90
pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
# (kernel, case) builds known to spill, and why they stay for now
KNOWN_SPILLS = {
    # the state loop keeps its [BV, 128] fp32 state and the next chunk's loads live
    ("kda_chunk_state_kernel", "kda prefill 4 seqs"),
    # a swept tiling, not the default: 64 rows a step on one warpgroup
    ("sparse_mla_fwd_kernel", "attention decode, 64 rows a step"),
}


def _kernel_names() -> set[str]:
    """Names of the launchable Triton kernels (`*_kernel`) in glm53.kernels."""
    from glm53.kernels import ops

    names = set()
    for mod in (*ops.KERNEL_MODULES, "kda_chunk"):
        module = importlib.import_module(f"glm53.kernels.{mod}")
        names |= {n for n, obj in vars(module).items()
                  if n.endswith("_kernel") and hasattr(obj, "fn")}
    return names


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sm90") / "builds.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm90_build.py"), "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_every_kernel_builds_for_sm90(builds):
    built = {b["kernel"] for b in builds}
    assert not _kernel_names() - built, "kernels no build case reaches"
    # the tensor-core kernels do use Hopper's wgmma
    for name in ("sparse_mla_fwd_kernel", "kda_chunk_intra_kernel"):
        assert all(b["wgmma"] > 0 for b in builds if b["kernel"] == name), name


def test_spills_are_known(builds):
    spilling = {(b["kernel"], b["case"]) for b in builds if b["spill_bytes"] > 0}
    assert spilling <= KNOWN_SPILLS, f"new spills: {spilling - KNOWN_SPILLS}"
    # the default decode attention and select stay in registers
    for b in builds:
        if b["case"] in ("attention decode 1 query", "attention decode 64 queries",
                         "topk 16x32K"):
            assert b["spill_bytes"] == 0 and b["registers"] <= 255, b
