"""The adaptive draft-length policy: the step cost model and the choice it drives."""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm53.raycluster.draft_policy import (
    AcceptanceEstimate,
    DraftLengthPolicy,
    StepCostModel,
)


def _linear_cost(base: float, per_draft: float) -> StepCostModel:
    return StepCostModel({(b, w): base + per_draft * w for b in (1, 8) for w in range(4)},
                         "test")


def _policy(conditional: list[float], cost: StepCostModel, ids: list[str]) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(len(conditional), cost)
    for r in ids:
        policy.estimate(r).conditional[:] = conditional
    return policy


def test_cost_model_interpolates_and_extrapolates_in_batch_and_width():
    cost = StepCostModel({(1, 0): 4.0, (8, 0): 8.0, (1, 2): 6.0, (8, 2): 12.0}, "test")
    assert cost.step_ms(1, 0) == 4.0
    assert cost.step_ms(8, 2) == 12.0
    assert cost.step_ms(4, 0) == pytest.approx(4 + 3 * 4 / 7)
    assert cost.step_ms(1, 1) == pytest.approx(5.0)  # between the measured widths
    assert cost.step_ms(15, 0) == pytest.approx(12.0)  # past the largest batch: end slope
    assert cost.step_ms(1, 3) == pytest.approx(7.0)  # past the largest width


def test_cost_model_reads_a_bench_latency_record(tmp_path):
    rows = [("none", 1, 128, 4.0), ("none", 1, 1024, 6.0), ("mtp:3", 1, 128, 7.0),
            ("mtp:3 synthetic", 8, 128, 9.0), ("mtp:auto", 1, 128, 99.0)]
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"results": [
        {"speculative": s, "batch": b, "context": c, "step_ms_median": ms}
        for s, b, c, ms in rows]}))
    cost = StepCostModel.from_bench_record(path)
    assert cost.step_ms(1, 0) == 5.0  # the contexts' mean
    assert cost.step_ms(1, 3) == 7.0  # the adaptive row (99) is not a width
    assert cost.step_ms(8, 3) == 9.0
    assert cost.source == str(path)


def test_default_cost_model_makes_drafts_dearer_at_large_batches():
    cost = StepCostModel.default(3)
    assert cost.source == "default"
    small = cost.step_ms(1, 3) / cost.step_ms(1, 0)
    large = cost.step_ms(256, 3) / cost.step_ms(256, 0)
    assert 1 < small < large


@pytest.mark.parametrize("conditional, cost, expected", [
    ([0.99, 0.99, 0.99], _linear_cost(10, 1), 3),  # near-sure acceptance, cheap verify
    ([0.01, 0.01, 0.01], _linear_cost(10, 1), 0),  # near-zero acceptance
    ([0.5, 0.5, 0.5], _linear_cost(1, 0.4), 1),  # rates 1, 1.07, 0.97, 0.80 tokens per ms
    ([0.9, 0.5, 0.1], _linear_cost(10, 1), 2),  # deep positions rarely pay
])
def test_choice_maximises_expected_tokens_per_ms(conditional, cost, expected):
    policy = _policy(conditional, cost, ["a"])
    assert policy.choose(["a"]) == expected
    rates = [AcceptanceEstimate(np.array(conditional)).expected_tokens(w) / cost.step_ms(1, w)
             for w in range(4)]
    assert int(np.argmax(rates)) == expected


def test_the_same_acceptance_stops_paying_when_the_batch_makes_verify_dear():
    # a verify is nearly free at batch 1 and doubles the step at batch 8 (compute bound)
    cost = StepCostModel({**{(1, w): 4 + 0.5 * w for w in range(4)},
                          **{(8, w): 8 + 8.0 * w for w in range(4)}}, "test")
    assert _policy([0.8] * 3, cost, ["a"]).choose(["a"]) == 3
    ids = [f"r{i}" for i in range(8)]
    assert _policy([0.8] * 3, cost, ids).choose(ids) == 0


def test_observations_move_the_estimate_of_tried_positions_only():
    estimate = AcceptanceEstimate(np.full(3, 0.5))
    estimate.observe(num_drafts=3, num_accepted=1, rate=0.5)  # 1 accepted, 2 rejected
    assert estimate.conditional.tolist() == [0.75, 0.25, 0.5]
    assert estimate.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 0.25)


def test_a_switched_off_sequence_is_probed_again_and_backs_off_after_failing():
    policy = DraftLengthPolicy(3, _linear_cost(10, 2))
    widths = []
    for _ in range(200):
        width = policy.choose(["a"])
        widths.append(width)
        policy.record("a", width, 0)  # nothing is ever accepted
        policy.engine_wide.relax(policy.prior, 0, policy.relax_rate)
    assert widths[0] > 0  # the prior is optimistic
    late = widths[50:]
    assert 0 < sum(w > 0 for w in late) < 0.15 * len(late)  # rare probes, mostly off
