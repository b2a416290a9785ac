"""Programmatic dependent launch (`kernels/utils.py: pdl`): a kernel launched with it may run
while the kernel before it still does, so it must wait (`pdl_wait`) before it reads what that
kernel wrote. The GPU checks the timing (scripts/gpu_check.sh pdl); here the rules that keep
it correct: when it is on, that every launch asking for it passes the kernel the same switch,
and that every kernel taking the switch waits."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_pdl_only_on_a_hopper_or_later_gpu_and_when_asked(monkeypatch):
    from glm53.kernels import utils

    cuda = torch.device("cuda", 0)
    every = utils.pdl_families("1")
    monkeypatch.setattr(utils, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(utils, "INTERPRET", False)
    monkeypatch.setattr(utils, "PDL", every)
    assert utils.pdl(cuda, "linear") and not utils.pdl(torch.device("cpu"), "linear")
    monkeypatch.setattr(utils, "device_capability", lambda device: (8, 0))
    assert not utils.pdl(cuda, "linear")
    monkeypatch.setattr(utils, "device_capability", lambda device: (12, 0))
    assert utils.pdl(cuda, "linear")
    monkeypatch.setattr(utils, "PDL", utils.pdl_families("0"))
    assert not utils.pdl(cuda, "linear")
    monkeypatch.setattr(utils, "PDL", utils.pdl_families("int4, mhc"))
    assert utils.pdl(cuda, "int4") and utils.pdl(cuda, "mhc") and not utils.pdl(cuda, "linear")
    monkeypatch.setattr(utils, "PDL", every)
    monkeypatch.setattr(utils, "INTERPRET", True)
    assert not utils.pdl(cuda, "linear")


def test_pdl_setting_names_families():
    """GLM53_PDL: 0 / empty none, 1 all, or a list of families (to bisect a fault); a name
    that is no family is refused with the list."""
    from glm53.kernels import utils

    assert utils.pdl_families("") == utils.pdl_families("0") == frozenset()
    assert utils.pdl_families("1") == frozenset(utils.PDL_FAMILIES)
    assert utils.pdl_families("router,kda") == {"router", "kda"}
    with pytest.raises(ValueError, match="unknown kernel families.*gemv"):
        utils.pdl_families("linear,gemv")


def test_every_dependent_launch_names_a_family():
    """Each `pdl(...)` / `pdl_early(...)` call in kernels/ names one of PDL_FAMILIES, and each
    family has a launch: GLM53_PDL's lists turn real launches on."""
    from glm53.kernels import utils

    named = set()
    for path in KERNELS.glob("*.py"):
        if path.name == "utils.py":
            continue
        named |= set(re.findall(r"\bpdl(?:_early)?\([^,]+, \"(\w+)\"", path.read_text()))
    assert named == set(utils.PDL_FAMILIES)


def _launches(source: str) -> list[str]:
    """The text of every call in `source` that passes launch_pdl."""
    tree = ast.parse(source)
    return [ast.get_source_segment(source, node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and any(k.arg == "launch_pdl" for k in node.keywords)]


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_launch_and_kernel_agree_and_the_kernel_waits(path):
    """launch_pdl=X goes with PDL=X in the same launch (a kernel launched dependent without
    its wait would read the previous kernel's output early), and every jit function taking
    PDL calls pdl_wait(PDL)."""
    source = path.read_text()
    for call in _launches(source):
        launch = re.search(r"launch_pdl=(\w+)", call)[1]
        switch = re.search(r"\bPDL=(\w+)", call)
        assert switch and switch[1] == launch, f"{path.name}: {call[:80]}"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
            body = ast.get_source_segment(source, node)
            if node.name not in ("pdl_start", "pdl_wait"):
                assert "pdl_wait(PDL)" in body, f"{path.name}: {node.name} never waits"


class _Record:
    """Stands in for a jitted kernel: records each launch's keyword arguments, runs nothing."""

    def __init__(self, launches: list[dict]) -> None:
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append(meta)


def test_the_gemv_launches_dependent_when_on(monkeypatch):
    from glm53.kernels import linear

    launches = []
    monkeypatch.setattr(linear, "pdl", lambda device, family: True)
    monkeypatch.setattr(linear, "linear_gemv_kernel", _Record(launches))
    linear.linear(torch.randn(1, 64), torch.randn(32, 64))
    assert [(m["PDL"], m["launch_pdl"]) for m in launches] == [(True, True)]


@pytest.mark.parametrize("fn_dtype,expect", [(torch.float32, True), (torch.bfloat16, False)])
def test_mhc_launches_dependent_only_on_weights_no_kernel_just_wrote(monkeypatch, fn_dtype,
                                                                     expect):
    """The mixing pass reads fn before waiting for the kernel before it (`utils.pdl_early`):
    so it launches dependent only when fn is the caller's own fp32 tensor, not the copy a cast
    launch has just written."""
    from glm53.kernels import mhc, utils

    launches = []
    monkeypatch.setattr(utils, "pdl", lambda device, family: True)
    monkeypatch.setattr(mhc, "hc_mix_kernel", _Record(launches))
    monkeypatch.setattr(mhc, "hc_pre_kernel", _Record(launches))
    n, d = 4, 64
    mhc.hc_pre(torch.randn(1, n, d), torch.randn((2 + n) * n, n * d).to(fn_dtype),
               torch.randn((2 + n) * n), torch.rand(3), 1e-6, 1e-6, 20)
    assert [m["PDL"] for m in launches] == [expect, True]
    assert all(m["PDL"] == m["launch_pdl"] for m in launches)


def test_the_rule_sees_every_dependent_launch():
    """The check above reads the launches it should: the decode step's GEMV, int4 experts
    (w13, w2, reduce), mHC (mix, gates, post+mix), router, top-k, KDA mixer, window and norm."""
    found = sum(len(_launches(p.read_text())) for p in KERNELS.glob("*.py"))
    assert found == 12
