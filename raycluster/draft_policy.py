"""Adaptive draft length: how many drafts each sequence verifies in the next step.

Each step the policy picks one width w in 0..k for the whole batch (uniform, so a decode/verify
batch keeps the shape CUDA graphs are captured for) that maximises expected emitted tokens per
second: sum over sequences of E_s[tokens | w] divided by the step time T(batch, w).

- E_s[tokens | w] = 1 + sum_{j<=w} prod_{i<=j} c_s[i], where c_s[i] is sequence s's estimated
  probability that draft i is accepted given drafts 1..i-1 were (an exponential moving average
  per position, started from the engine-wide estimate, which starts from `prior`).
- T(batch, w) comes from `StepCostModel`: a table of measured step times (the JSON record of
  `glm53 bench latency`: `none` rows are width 0, `mtp:K` / `dflash:PATH:K` rows width K), or
  a documented default table (bandwidth estimates, logged as not measured).

A position that a step did not verify drifts back toward the prior (`relax`), so a sequence
whose drafts were switched off is probed again now and then, and a width never tried is
eventually tried: acceptance can recover (a new topic, a code block) after a bad stretch.
Never touches tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# Default step times (ms) of GLM-5.3-Flash on 2x H200, TP2, plain decode by tokens per step:
# the bandwidth times of design/performance.md §4.3 plus a 1.5 ms floor of collectives and
# small kernels. Not measured: measure with `glm53 bench latency` and pass the record.
DEFAULT_PLAIN_MS = {1: 4.0, 8: 7.4, 16: 10.5, 32: 15.2, 64: 20.6, 128: 25.4, 256: 30.5,
                    512: 36.0, 1024: 42.0}
DRAFT_PASS_FRACTION = 0.08  # one MTP pass (1 of 45 layers + lm_head) as a fraction of a step


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), extrapolated with the end slopes."""
    if len(xs) == 1:
        return float(ys[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + slope * (x - xs[i]))


class StepCostModel:
    """Step time (ms) as a function of (batch, drafts verified per sequence), interpolated
    from a table: linear in batch per measured width, then linear in width."""

    def __init__(self, table: dict[tuple[int, int], float], source: str) -> None:
        if not table or min(table.values()) <= 0:
            raise ValueError("a step cost table needs positive step times")
        self.source = source  # where the numbers come from (a file, or "default")
        self._by_width: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for width in sorted({w for _, w in table}):
            batches = sorted(b for b, w in table if w == width)
            self._by_width[width] = (np.array(batches, float),
                                     np.array([table[b, width] for b in batches], float))

    def step_ms(self, batch: int, width: int) -> float:
        widths = np.array(sorted(self._by_width), float)
        times = np.array([_interp(batch, *self._by_width[int(w)]) for w in widths])
        return max(_interp(width, widths, times), 1e-6)

    @classmethod
    def default(cls, max_width: int) -> StepCostModel:
        """The documented estimate: a verify of w drafts costs a plain step of batch*(1+w)
        tokens plus w draft passes."""
        tokens, plain = np.array(list(DEFAULT_PLAIN_MS), float), np.array(
            list(DEFAULT_PLAIN_MS.values()), float)
        table = {(b, w): _interp(b * (1 + w), tokens, plain)
                 + w * DRAFT_PASS_FRACTION * _interp(b, tokens, plain)
                 for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for w in range(max_width + 1)}
        return cls(table, "default")

    @classmethod
    def from_bench_record(cls, path: str | Path) -> StepCostModel:
        """The median decode step of each (batch, width) of a `glm53 bench latency --json`
        record (averaged over its contexts). Adaptive rows (`:auto`) are skipped: their width
        varies."""
        record = json.loads(Path(path).read_text())
        samples: dict[tuple[int, int], list[float]] = {}
        for row in record.get("results", []):
            width = _width_of(row["speculative"])
            if width is not None:
                samples.setdefault((row["batch"], width), []).append(row["step_ms_median"])
        if not samples:
            raise ValueError(f"{path}: no fixed-width `glm53 bench latency` results")
        return cls({key: float(np.mean(v)) for key, v in samples.items()}, str(path))


def _width_of(spec_name: str) -> int | None:
    """'none' -> 0, 'mtp:3' / 'dflash:PATH:7' (maybe ' synthetic') -> K, adaptive -> None."""
    name = spec_name.split()[0]
    if name == "none":
        return 0
    last = name.rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else None


@dataclass
class AcceptanceEstimate:
    """Per draft position, the probability that it is accepted after the earlier ones were."""

    conditional: np.ndarray  # [k]

    def expected_tokens(self, width: int) -> float:
        """Tokens a step emits with `width` drafts: accepted drafts + the target's own."""
        return 1.0 + float(np.cumprod(self.conditional[:width]).sum())

    def observe(self, num_drafts: int, num_accepted: int, rate: float) -> None:
        """Positions 1..accepted were accepted, the next one (if verified) rejected; later
        positions were not tried."""
        seen = min(num_accepted + 1, num_drafts)
        outcome = (np.arange(seen) < num_accepted).astype(float)
        self.conditional[:seen] += rate * (outcome - self.conditional[:seen])

    def relax(self, toward: np.ndarray, first: int, rate: float) -> None:
        """Positions from `first` on drift toward `toward` (they went untried)."""
        self.conditional[first:] += rate * (toward[first:] - self.conditional[first:])


class DraftLengthPolicy:
    """Chooses the step's draft width from per-sequence acceptance and the step cost model."""

    def __init__(self, max_drafts: int, cost: StepCostModel, prior: float = 0.7,
                 rate: float = 0.5, relax: float = 0.01) -> None:
        """prior: the acceptance assumed per position before any is measured; rate: the
        moving average's weight of a new observation; relax: how fast untried positions drift
        back (the engine-wide estimate toward the prior, a sequence's toward the engine's),
        which paces the probes of a switched-off sequence (with the defaults, after a failed
        probe of a width that needs 20% acceptance to pay, the next comes ~20 steps later)."""
        self.max_drafts, self.cost = max_drafts, cost
        self.rate, self.relax_rate = rate, relax
        self.prior = np.full(max_drafts, prior)
        self.engine_wide = AcceptanceEstimate(self.prior.copy())
        self.sequences: dict[str, AcceptanceEstimate] = {}

    def estimate(self, request_id: str) -> AcceptanceEstimate:
        if request_id not in self.sequences:
            self.sequences[request_id] = AcceptanceEstimate(self.engine_wide.conditional.copy())
        return self.sequences[request_id]

    def choose(self, request_ids: list[str]) -> int:
        """The width (0..k) maximising expected tokens per ms for this batch (ties: fewer)."""
        if not request_ids:
            return self.max_drafts
        estimates = [self.estimate(r) for r in request_ids]
        batch = len(request_ids)
        rates = [sum(e.expected_tokens(w) for e in estimates) / self.cost.step_ms(batch, w)
                 for w in range(self.max_drafts + 1)]
        return int(np.argmax(rates))

    def observe(self, items: Iterable, accepted: list[int] | None) -> None:
        """A step's outcome: its ScheduledRequests and their accepted draft counts."""
        if accepted is None:
            return
        for item, num_accepted in zip(items, accepted, strict=True):
            if item.samples:
                self.record(item.request.request_id, item.num_drafts, num_accepted)
        self.engine_wide.relax(self.prior, 0, self.relax_rate)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One sequence verified `num_drafts` drafts and accepted `num_accepted`."""
        estimate = self.estimate(request_id)
        if num_drafts:
            estimate.observe(num_drafts, num_accepted, self.rate)
            self.engine_wide.observe(num_drafts, num_accepted, self.rate)
        tried = min(num_accepted + 1, num_drafts)
        estimate.relax(self.engine_wide.conditional, tried, self.relax_rate)

    def forget(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
