"""Metrics of one replica: vLLM names, label, how requests move them, and merging expositions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from glm53.deployments.metrics import RequestTimes, ServingMetrics, merge_expositions
from glm53.raycluster.api import EngineStats

VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:num_preemptions", "vllm:request_success",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
    "glm53:kda_state_slot_usage_perc",
}


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def test_names_and_a_request_lifecycle():
    m = ServingMetrics("tiny", num_spec_positions=2)
    assert families(m.render()) >= VLLM_NAMES
    t = RequestTimes(arrival=10.0, engine_arrival=10.1, scheduled=10.3)
    m.tokens(t, 1, 7, now=10.5)
    m.tokens(t, 1, 7, now=10.6)
    m.tokens(t, 2, 7, now=10.8)
    m.finished(t, "length", now=11.0)
    m.set_engine_stats(EngineStats(3, 2, 0.25, 0.5, num_preemptions=4))
    m.set_engine_stats(EngineStats(3, 2, 0.25, 0.5, num_preemptions=5, spec_num_drafts=2,
                                   spec_num_draft_tokens=4, spec_num_accepted_tokens=3,
                                   spec_accepted_per_pos=(2, 1), prefix_cache_queries=90,
                                   prefix_cache_hits=64, prefix_checkpoint_hits=2,
                                   prefix_checkpoint_evictions=1))
    s = samples(m.render())
    tiny = (("model_name", "tiny"),)
    assert s[("vllm:prompt_tokens_total", tiny)] == 7
    assert s[("vllm:generation_tokens_total", tiny)] == 4
    assert s[("vllm:num_preemptions_total", tiny)] == 5
    assert s[("vllm:request_success_total", (("finished_reason", "length"),) + tiny)] == 1
    assert s[("vllm:time_to_first_token_seconds_sum", tiny)] == 0.5
    assert s[("vllm:inter_token_latency_seconds_count", tiny)] == 2
    assert abs(s[("vllm:request_queue_time_seconds_sum", tiny)] - 0.2) < 1e-9
    assert abs(s[("vllm:request_prefill_time_seconds_sum", tiny)] - 0.2) < 1e-9
    assert abs(s[("vllm:request_decode_time_seconds_sum", tiny)] - 0.3) < 1e-9
    assert s[("vllm:e2e_request_latency_seconds_sum", tiny)] == 1.0
    assert s[("vllm:num_requests_running", tiny)] == 3
    assert s[("vllm:kv_cache_usage_perc", tiny)] == 0.25
    assert s[("glm53:kda_state_slot_usage_perc", tiny)] == 0.5
    assert s[("vllm:spec_decode_num_drafts_total", tiny)] == 2
    assert s[("vllm:spec_decode_num_draft_tokens_total", tiny)] == 4
    assert s[("vllm:spec_decode_num_accepted_tokens_total", tiny)] == 3
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert s[(per_pos, (("model_name", "tiny"), ("position", "1")))] == 1
    assert s[("vllm:prefix_cache_queries_total", tiny)] == 90
    assert s[("vllm:prefix_cache_hits_total", tiny)] == 64
    assert s[("glm53:prefix_checkpoint_hits_total", tiny)] == 2
    assert s[("glm53:prefix_checkpoint_evictions_total", tiny)] == 1


def test_merge_keeps_one_header_per_family():
    a, b = ServingMetrics("a"), ServingMetrics("b")
    merged = merge_expositions([a.render(), b.render()])
    text = merged.decode()
    assert text.count("# TYPE vllm:kv_cache_usage_perc gauge") == 1
    s = samples(merged)
    assert s[("vllm:kv_cache_usage_perc", (("model_name", "a"),))] == 0
    assert s[("vllm:kv_cache_usage_perc", (("model_name", "b"),))] == 0


def test_kv_cache_capacity_is_exported():
    m = ServingMetrics("tiny")
    m.set_engine_stats(EngineStats(kv_cache_tokens_per_gib=3_000_000.0))
    s = samples(m.render())
    assert s[("glm53:kv_cache_tokens_per_gib", (("model_name", "tiny"),))] == 3_000_000.0


def test_per_position_drafts_and_chosen_draft_lengths_are_exported():
    m = ServingMetrics("tiny", num_spec_positions=3)
    m.set_engine_stats(EngineStats(spec_accepted_per_pos=(5, 2, 0),
                                   spec_draft_tokens_per_pos=(8, 5, 2),
                                   spec_draft_length_steps=(4, 0, 1, 2)))
    m.set_engine_stats(EngineStats(spec_accepted_per_pos=(6, 2, 0),
                                   spec_draft_tokens_per_pos=(9, 5, 2),
                                   spec_draft_length_steps=(7, 0, 1, 3)))
    s = samples(m.render())

    def value(name: str, label: str, key: str) -> float:
        return s[(name, tuple(sorted((("model_name", "tiny"), (label, key)))))]

    drafts = "glm53:spec_decode_num_draft_tokens_per_pos_total"
    assert [value(drafts, "position", str(p)) for p in range(3)] == [9, 5, 2]
    chosen = "glm53:spec_decode_draft_length_steps_total"
    assert [value(chosen, "draft_length", str(w)) for w in range(4)] == [7, 0, 1, 3]
