"""Helpers the benchmark scripts share (run as `python benchmarks/X.py`, so this folder is on
the import path)."""

from __future__ import annotations

import subprocess

import torch


def git_commit() -> str | None:
    """The checkout's short commit, or None without git (the device copy has no .git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or None
    except OSError:
        return None


def unit_scale_bank(cfg) -> dict[str, float]:
    """An nvfp4 scale bank of outer scale 1 for every DSA layer and the MTP layer: the timing
    runs decode over zero or random caches, which need no calibration (`glm53 calibrate-kv`
    builds a real bank)."""
    from glm53.actors.caches import MTP_LAYER

    return {**{str(i): 1.0 for i in cfg.dsa_layers}, MTP_LAYER: 1.0}


def graph_ms(fn, rep: int) -> float:
    """Median ms of fn replayed in a CUDA graph. do_bench_cudagraph runs fn on a fresh stream
    that does not wait for the default stream, so the inputs are synchronized first (without
    it the sparse-MLA benchmark read block tables still being written: an illegal address)."""
    from triton.testing import do_bench_cudagraph  # here: the CPU-only step benchmark skips it

    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def device_ms(fn, reps: int = 20) -> float:
    """Median ms the GPU spends executing fn, host launch cost hidden: a GPU sleep covering the
    host's enqueueing of every repetition runs first, so the repetitions' kernels sit queued
    back to back and the events around each time only the device. (do_bench's time is the
    wall clock of a host-bound call when launching costs more than the kernels run.) Retries
    with a longer sleep if the GPU woke before the host had queued everything."""
    import statistics
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    sleep_s = 2 * reps * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    for _ in range(4):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        woke = torch.cuda.Event()
        torch.cuda._sleep(int(min(sleep_s, 2.0) * 2e9))  # ~2e9 cycles/s at the SM clock
        woke.record()
        for start, end in events:
            start.record()
            fn()
            end.record()
        queued_in_time = not woke.query()
        torch.cuda.synchronize()
        if queued_in_time:
            return statistics.median(start.elapsed_time(end) for start, end in events)
        sleep_s *= 2
    raise RuntimeError("the host could not queue the repetitions ahead of the GPU")


def device_kernels(events) -> list:
    """The kernel entries of a profiler's events (or `key_averages()`), largest self device
    time first. A CPU op's self device time is the time of the kernels it launched itself, and
    those kernels are entries of their own too (torch.autograd.profiler_util): summing both
    counted each kernel twice."""
    from torch.autograd import DeviceType

    kernels = [e for e in events
               if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    return sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)


def kernel_profile(fn, top: int = 20) -> dict:
    """One call of fn under torch.profiler: device time per kernel, the `top` largest and the
    total, in ms, and how many kernels the call launched."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()  # compiled and warm before the profiled call
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = device_kernels(prof.key_averages())
    total = sum(e.self_device_time_total for e in events) / 1e3
    kernels = [dict(name=e.key[:120], calls=e.count, ms=e.self_device_time_total / 1e3)
               for e in events[:top]]
    launches = sum(e.count for e in events)
    return dict(device_ms=total, launches=launches, kernels=kernels)
