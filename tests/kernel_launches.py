"""A Triton kernel's stand-in that records its launches (tests monkeypatch it over the kernel)."""

from __future__ import annotations


class KernelLaunches:
    """Stands in for a Triton kernel: records each launch's constexprs, then runs it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls.append(meta)
            return self.kernel[grid](*args, **meta)
        return run
