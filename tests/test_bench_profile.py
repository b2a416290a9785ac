"""benchmarks/bench_common.py's kernel profile counts each kernel once: a CPU op's self device
time is the time of the kernels it launched, which are profiler entries of their own."""

from __future__ import annotations

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent


def _kernel(name: str, start: int, end: int) -> FunctionEvent:
    return FunctionEvent(id=start, name=name, thread=0, start_us=start, end_us=end,
                         use_device="cuda", device_type=DeviceType.CUDA)


def test_device_time_counts_kernels_not_the_ops_that_launched_them(monkeypatch):
    monkeypatch.syspath_prepend("benchmarks")
    from bench_common import device_kernels

    op = FunctionEvent(id=1, name="aten::mm", thread=0, start_us=0, end_us=10, use_device="cuda")
    op.append_kernel("gemm", 0, 7)
    gemm, triton = _kernel("gemm", 1, 8), _kernel("fused_moe_kernel", 9, 12)
    idle = FunctionEvent(id=4, name="aten::view", thread=0, start_us=12, end_us=13,
                         use_device="cuda")
    assert op.self_device_time_total == 7  # what the old sum added on top of gemm's own 7
    kernels = device_kernels([op, gemm, triton, idle])
    assert [e.key for e in kernels] == ["gemm", "fused_moe_kernel"]
    assert sum(e.self_device_time_total for e in kernels) == pytest.approx(10)
