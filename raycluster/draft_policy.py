"""Adaptive draft length: how many drafts each sequence verifies in the next step.

Each step the policy picks one width w in 0..k for the whole batch (uniform, so a decode/verify
batch keeps the shape CUDA graphs are captured for) that maximises expected emitted tokens per
second: sum over sequences of E_s[tokens | w] divided by the step time T(batch, w).

- E_s[tokens | w] = 1 + sum_{j<=w} prod_{i<=j} c_s[i], where c_s[i] is sequence s's estimated
  probability that draft i is accepted given drafts 1..i-1 were: its decayed counts of
  accepted / verified drafts at position i, shrunk toward the engine-wide estimate (all
  sequences' counts, shrunk toward `prior`) by a few pseudo-verifies (`AcceptanceCounts`).
- T(batch, w) comes from `StepCostModel`: a table of measured step times (the JSON record of
  `glm53 bench latency`: `none` rows are width 0, `mtp:K` / `dflash:PATH:K` rows width K), or
  a documented default table (bandwidth estimates, logged as not measured).

Counts decay, so a position that goes unverified drifts back to its base (a sequence's to the
engine-wide estimate, that to the prior): a sequence whose drafts were switched off is probed
again now and then, and acceptance can recover (a new topic, a code block) after a bad
stretch. Shrinking keeps single outcomes from switching drafting off: an earlier form, a
moving average with weight 0.5 per outcome at both levels, let a few rejections drag the
engine-wide estimate to ~0.2 at a true 0.8, where new sequences started without drafts and,
observing nothing, stayed there. Never touches tensors.
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


@dataclass
class AcceptanceCounts:
    """Decayed counts, per draft position, of drafts verified (after the earlier ones were
    accepted) and of those accepted. The estimate they give is shrunk toward a base estimate
    by `pseudo` verifies: (accepted + pseudo * base) / (verified + pseudo), so one outcome
    moves it by at most 1 / (1 + pseudo), and decayed counts drift back to the base."""

    verified: np.ndarray  # [k]
    accepted: np.ndarray  # [k]

    @classmethod
    def empty(cls, k: int) -> AcceptanceCounts:
        return cls(np.zeros(k), np.zeros(k))

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """Positions 1..accepted were accepted, the next one (if verified) rejected; later
        positions were not tried."""
        self.verified[:min(num_accepted + 1, num_drafts)] += 1.0
        self.accepted[:num_accepted] += 1.0

    def decay(self, keep: float, first: int = 0) -> None:
        """Counts of positions from `first` on are multiplied by `keep`."""
        self.verified[first:] *= keep
        self.accepted[first:] *= keep

    def estimate(self, base: np.ndarray, pseudo: float) -> AcceptanceEstimate:
        return AcceptanceEstimate((self.accepted + pseudo * base) / (self.verified + pseudo))


class DraftLengthPolicy:
    """Chooses the step's draft width from per-sequence acceptance and the step cost model."""

    def __init__(self, max_drafts: int, cost: StepCostModel, prior: float | np.ndarray = 0.7,
                 pseudo: float = 2.0, sequence_keep: float = 0.9,
                 engine_keep: float = 0.995) -> None:
        """prior: the acceptance assumed per position before any is measured; pseudo: how
        many verifies the base estimate weighs (a sequence's base is the engine-wide
        estimate, whose base is the prior); sequence_keep: a sequence's counts of a position
        decay by this at each of its verifies and at each step that left the position
        untried (a memory of ~10 outcomes, and a switched-off sequence returns to the
        engine-wide estimate within ~20 steps); engine_keep: the engine-wide counts decay by
        this once a step (all sequences' outcomes over ~200 steps), so they drift back to the
        prior while no one drafts and a switched-off engine probes again now and then (at
        batch 1 and acceptance ~0, about one step in 30 verifies a draft)."""
        self.max_drafts, self.cost = max_drafts, cost
        self.pseudo, self.sequence_keep, self.engine_keep = pseudo, sequence_keep, engine_keep
        self.prior = np.full(max_drafts, prior)
        self.engine_wide = AcceptanceCounts.empty(max_drafts)
        self.sequences: dict[str, AcceptanceCounts] = {}

    def engine_estimate(self) -> AcceptanceEstimate:
        return self.engine_wide.estimate(self.prior, self.pseudo)

    def estimate(self, request_id: str) -> AcceptanceEstimate:
        """The sequence's estimate: its own counts shrunk toward the engine-wide estimate."""
        counts = self.sequences.get(request_id)
        base = self.engine_estimate()
        return base if counts is None else counts.estimate(base.conditional, self.pseudo)

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
        self.end_step()

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One sequence verified `num_drafts` drafts and accepted `num_accepted`."""
        counts = self.sequences.setdefault(request_id, AcceptanceCounts.empty(self.max_drafts))
        counts.decay(self.sequence_keep)  # every position, tried or not, before the outcome
        counts.add(num_drafts, num_accepted)
        self.engine_wide.add(num_drafts, num_accepted)

    def end_step(self) -> None:
        """Once a step, after its outcomes: the engine-wide counts decay."""
        self.engine_wide.decay(self.engine_keep)

    def forget(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
