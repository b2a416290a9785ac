"""The rank-0 emulation builds rank 0's exact shard with the serving code and runs it alone:
same parameter shapes and storage formats as a real rank 0, no collective needed, forced
uniform routing (performance.md §5.1)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm53.actors.config import ModelConfig
from glm53.actors.emulation import build_rank0
from glm53.actors.layers.moe import Router
from glm53.actors.loader import build_model
from glm53.actors.parallel import ParallelConfig, ParallelState
from tests.naive_runner import SequenceRunner

PLAN = ParallelConfig(tp=2, ep=2, dcp=2)


@pytest.fixture(scope="module", params=["dense", "exl3"])
def cfg(request, tiny_checkpoints):
    path = tiny_checkpoints(seed=2, mtp=True, exl3=request.param == "exl3")
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def test_rank0_has_the_real_rank0_shapes(cfg):
    model = build_rank0(cfg, PLAN, dtype=torch.float32, device="cpu")
    real = build_model(cfg, with_mtp=True, device="meta", ps=ParallelState(PLAN, rank=0))
    ours = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    assert ours == {n: (tuple(p.shape), p.dtype) for n, p in real.named_parameters()}
    # materialised and filled, nothing left empty (the routers' selection bias is zeroed)
    for name, p in model.named_parameters():
        zeroed = name.endswith("e_score_correction_bias")
        assert p.device.type == "cpu" and bool(p.float().abs().sum() > 0) != zeroed, name


class RandomDraws(TorchDispatchMode):
    """Counts the random-number launches (aten.rand) dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == "rand"
        return func(*args, **(kwargs or {}))


def test_rank0_runs_alone_with_uniform_routing(cfg):
    """A forward draws every trunk router's logits in one launch (the real step has none), and
    the routers' experts are uniform and differ from layer to layer."""
    torch.manual_seed(0)
    model = build_rank0(cfg, PLAN, dtype=torch.float32, device="cpu")
    runner = SequenceRunner(model, max_seqs=1, max_len=64, block_size=16)
    runner.add(0)
    trunk = [m for m in model.layers.modules() if isinstance(m, Router)]
    assert len(trunk) > 1 and [r.uniform_routing[1] for r in trunk] == list(range(len(trunk)))
    chosen = []
    for router in trunk:
        router.register_forward_hook(lambda _, __, out: chosen.append(out[1]))
    with RandomDraws() as draws:
        logits = runner.step_logits({0: list(range(1, 30))})  # no process group exists
    assert draws.count == 1 and len(chosen) == len(trunk)
    assert not torch.equal(chosen[0], chosen[1])
    assert torch.isfinite(logits).all() and logits.shape == (29, cfg.vocab_size // 2 * 2)
    router = next(m for m in model.modules() if isinstance(m, Router))
    x = torch.randn(64, cfg.hidden_size)
    first, second = router(x)[1], router(x)[1]
    assert not torch.equal(first, second)  # drawn at random, not from the logits
    counts = torch.bincount(torch.cat([router(x)[1] for _ in range(50)]).flatten(),
                            minlength=cfg.n_routed_experts)
    assert counts.min() > 0.5 * counts.float().mean()  # every expert about equally likely
