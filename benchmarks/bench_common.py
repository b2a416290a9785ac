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


def graph_ms(fn, rep: int) -> float:
    """Median ms of fn replayed in a CUDA graph. do_bench_cudagraph runs fn on a fresh stream
    that does not wait for the default stream, so the inputs are synchronized first (without
    it the sparse-MLA benchmark read block tables still being written: an illegal address)."""
    from triton.testing import do_bench_cudagraph  # here: the CPU-only step benchmark skips it

    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
