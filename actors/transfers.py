"""Host <-> device copies that do not wait for the work queued on the device.

A step is launched while the one before it still runs (ModelRunner.launch, overlapped
execution). A copy from pageable host memory may make the host wait for the stream (the driver
stages it through its own pinned buffer), which would hold the next step's launch until the
running step ends; from pinned memory the copy is only queued. torch's caching host allocator
keeps a pinned block from reuse until the copies queued from it have run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A copy of `array` on `device` (never sharing its memory), through pinned memory on CUDA
    (queued behind the stream's work)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return t.to(device, copy=True)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(a host copy of t, the event after which it holds t's values; None when t is on the
    host already). From CUDA the copy goes into pinned memory behind the queued work."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
