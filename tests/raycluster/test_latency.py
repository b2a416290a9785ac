"""The latency runner of `glm53 bench latency` on the tiny model, in this process: what it
counts (decode steps, tokens, acceptance) agrees with what the engine did."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm53.raycluster.api import EngineConfig, LatencyCase, LatencyRunner
from glm53.raycluster.latency import random_prompts


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Path) -> str:
    return str(tiny_checkpoint)


def runner(model_dir: str, k: int = 0, **kw) -> LatencyRunner:
    return LatencyRunner(EngineConfig(
        model=model_dir, max_num_seqs=4, num_blocks=256, max_num_batched_tokens=512,
        speculative_method="mtp" if k else None, num_speculative_tokens=k), **kw)


def test_plain_decoding_times_every_step_after_the_prefill(model_dir: str) -> None:
    bench = runner(model_dir)
    try:
        result = bench.measure(LatencyCase(batch=3, context=40, output_len=6))
    finally:
        bench.shutdown()
    # one prefill step (3 x 40 tokens fit the budget) gives each request its first token;
    # the other 5 tokens take 5 decode steps of the full batch
    assert result.decode_steps == 5
    assert result.tokens_per_step == 1.0
    assert result.prefill_ms > 0 and 0 < result.step_ms_median <= result.step_ms_p90
    assert result.tok_s_total == pytest.approx(3 * result.tok_s_per_user)
    assert result.preemptions == 0
    assert result.accepted_per_position is None and result.mean_accepted_length is None
    assert result.acceptance == "none"


def test_speculative_acceptance_is_counted_per_draft_position(model_dir: str) -> None:
    bench = runner(model_dir, k=2)
    try:
        result = bench.measure(LatencyCase(batch=2, context=24, output_len=12))
    finally:
        bench.shutdown()
    assert result.acceptance == "measured"
    assert len(result.accepted_per_position) == 2
    assert all(0.0 <= a <= 1.0 for a in result.accepted_per_position)
    # a later position is accepted only after every earlier one
    assert result.accepted_per_position[1] <= result.accepted_per_position[0]
    # 2 drafts a step, fewer where a request nears output_len
    assert 1.0 < result.mean_draft_length <= 2.0
    assert 1.0 <= result.mean_accepted_length <= 3.0
    assert 1.0 <= result.tokens_per_step <= 3.0


@pytest.mark.parametrize(("p", "tokens_per_step"), [([1.0, 1.0], 3.0), ([0.0], 1.0)])
def test_synthetic_acceptance_drives_the_real_mechanism(model_dir: str, p: list[float],
                                                         tokens_per_step: float) -> None:
    bench = runner(model_dir, k=2, synthetic_acceptance=p)
    try:  # 1 + 3 x 3 tokens: every timed step emits all 3 of a full acceptance
        result = bench.measure(LatencyCase(batch=2, context=24, output_len=10))
    finally:
        bench.shutdown()
    assert result.acceptance == f"synthetic {','.join(f'{x:g}' for x in p)}"
    assert result.accepted_per_position == tuple(p + [0.0] * (2 - len(p)))
    assert result.tokens_per_step == tokens_per_step
    assert result.mean_accepted_length == tokens_per_step


def test_synthetic_acceptance_needs_drafts(model_dir: str) -> None:
    with pytest.raises(ValueError, match="needs speculative decoding"):
        runner(model_dir, synthetic_acceptance=[0.5])


def test_too_short_an_output_has_no_decode_step_to_time(model_dir: str) -> None:
    bench = runner(model_dir)
    try:
        with pytest.raises(ValueError, match="output_len 1 is too short"):
            bench.measure(LatencyCase(batch=1, context=8, output_len=1))
    finally:
        bench.shutdown()


@pytest.mark.parametrize(("k", "context"), [(0, 500), (2, 1000)])
def test_warm_up_outlasts_a_chunked_prefill(model_dir: str, k: int, context: int) -> None:
    """4 x 500 prompt tokens take 4 prefill steps of 512: the first requests decode while the
    last prefills, so a warm-up of a fixed few tokens never saw the full batch decode (the
    H100 run of benchmarks/adaptive.py stopped there at batch 64 x 1024, without drafts and
    again with them: with every draft accepted the first requests decode 1 + k tokens in each
    of the 8 prefill steps of 4 x 1000 tokens)."""
    bench = runner(model_dir, k, **({"synthetic_acceptance": [1.0] * k} if k else {}))
    try:
        bench.warm_up(batch=4, context=context)
    finally:
        bench.shutdown()


def test_random_prompts_have_the_exact_length_and_differ() -> None:
    prompts = random_prompts(batch=3, context=50, vocab_size=272, seed=0)
    assert [len(p) for p in prompts] == [50, 50, 50]
    assert len({tuple(p) for p in prompts}) == 3
    assert all(0 <= t < 272 for p in prompts for t in p)


def test_steps_with_a_preempted_request_are_not_timed(model_dir: str) -> None:
    # 3 requests of 30 prompt tokens grow to 40: two blocks of 16 each at first, then a third
    # that the 7 usable blocks do not have for all of them; one is preempted (recompute) and
    # waits while the others decode as a batch of 2, which must not count as a batch of 3
    bench = LatencyRunner(EngineConfig(model=model_dir, max_num_seqs=4, num_blocks=8,
                                       max_num_batched_tokens=512))
    try:
        result = bench.measure(LatencyCase(batch=3, context=30, output_len=10))
    finally:
        bench.shutdown()
    assert result.preemptions >= 1
    assert result.tokens_per_step == 1.0  # every timed step advanced all three requests
    assert result.decode_steps < 9
