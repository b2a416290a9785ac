"""ForwardBatch carries a host copy of cu_seqlens, and every KDA layer hands that same object to
its mixer: fla's chunked prefill plans its chunks from it (cached by identity across the step's
layers) instead of reading the device copy back, a device sync per step."""

from __future__ import annotations

import inspect

import torch

from glm53.actors.forward_batch import ForwardBatch
from glm53.actors.loader import load_model
from glm53.kernels import ops
from tests.naive_runner import SequenceRunner


def test_build_keeps_cu_seqlens_on_the_host():
    batch = ForwardBatch.build(start_positions=[0, 5], num_tokens=[3, 2], state_ids=[1, 0],
                               block_tables=[[0], [1]], block_size=16)
    assert batch.cu_seqlens_host.device.type == "cpu"
    assert batch.cu_seqlens_host.dtype == torch.int64
    assert batch.cu_seqlens_host.tolist() == batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.has_initial_state.tolist() == [False, True]


def test_kda_layers_pass_the_host_copy(tiny_checkpoint, monkeypatch):
    model = load_model(tiny_checkpoint, progress=False)
    kda_layers = len(model.config.kda_layers)
    assert kda_layers
    seen = []
    mixer = ops.kda_mixer

    def spy(*args, **kwargs):
        seen.append(inspect.signature(mixer).bind(*args, **kwargs).arguments["cu_seqlens_host"])
        return mixer(*args, **kwargs)

    monkeypatch.setattr(ops, "kda_mixer", spy)
    runner = SequenceRunner(model, max_seqs=2, max_len=32)
    runner.add(0)
    runner.add(1)
    _, batch = runner.step({0: [5, 6, 7], 1: [8, 9]})
    assert len(seen) == kda_layers
    assert all(host is batch.cu_seqlens_host for host in seen)
