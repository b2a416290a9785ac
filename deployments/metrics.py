"""Prometheus metrics of one LLM-server replica, with vLLM's names and meanings.

Existing vLLM dashboards, Ray's TTFT autoscaling query and gateway tooling read these names, so
they are kept verbatim (`vllm:` prefix, label `model_name`, counters ending in `_total`,
seconds). Our own series: `glm53:kda_state_slot_usage_perc` (the second resource ledger) and
`glm53:kv_cache_tokens_per_gib` (cache capacity under the KV cache dtype).;
the prefix cache's KDA checkpoint hits and evictions (`glm53:prefix_checkpoint_*`).
Labels stay low-cardinality: model name, finish reason, draft position — never request ids.

Engine gauges are read from the engine when scraped; per-request latencies are observed by the
server from the delta stream (server clock, `time.monotonic`) plus the engine's queue and
schedule timestamps (`RequestOutput.timing`: same clock, same process).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from glm53.raycluster.api import EngineStats

prometheus_client.disable_created_metrics()  # vLLM exports no `_created` series either

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile results compare
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000, 500000]


@dataclass
class RequestTimes:
    """One engine request, in `time.monotonic` seconds (engine times may be unknown)."""

    arrival: float  # the server received the HTTP request
    engine_arrival: float | None = None  # the engine queued it
    scheduled: float | None = None  # first admitted by the scheduler
    first_token: float | None = None
    last_token: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    itl: list[float] = field(default_factory=list)


class ServingMetrics:
    def __init__(self, model_name: str, num_spec_positions: int = 0) -> None:
        self.registry = CollectorRegistry()
        reg, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=reg).labels(model_name)

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage: fraction of paged blocks in use (0-1).")
        self.slot_usage = gauge("glm53:kda_state_slot_usage_perc",
                                "KDA state-slot usage: fraction of state slots in use (0-1).")
        self.kv_tokens_per_gib = gauge("glm53:kv_cache_tokens_per_gib",
                                       "Tokens one GiB of paged KV cache holds on a rank "
                                       "(follows --kv-cache-dtype).")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self._seen: dict[int, int] = {}  # engine totals already counted, by counter
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Time to first token (from arrival at the server).", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Time in the waiting queue before first being scheduled.",
                          LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.",
                           LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "First scheduled to last token.", LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.",
                               TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                            TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n parameter of requests.",
                             [1, 2, 5, 10, 20])
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "The max_tokens parameter of requests.", TOKEN_BUCKETS)
        # speculative decoding (zero without it, but exported so dashboards resolve)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Speculative draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Accepted draft tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted draft tokens by draft position.",
                          ["model_name", "position"], registry=reg)
        self.spec_per_pos = [per_pos.labels(model_name, str(p))
                             for p in range(num_spec_positions)]
        # per-position acceptance rate = accepted_per_pos / draft_tokens_per_pos
        drafts_per_pos = Counter("glm53:spec_decode_num_draft_tokens_per_pos",
                                 "Verified draft tokens by draft position.",
                                 ["model_name", "position"], registry=reg)
        self.spec_drafts_per_pos = [drafts_per_pos.labels(model_name, str(p))
                                    for p in range(num_spec_positions)]
        # adaptive draft length: engine steps by the drafts per sequence they chose (0..k)
        draft_length = Counter("glm53:spec_decode_draft_length_steps",
                               "Engine steps by the draft length chosen (adaptive mode).",
                               ["model_name", "draft_length"], registry=reg)
        self.spec_draft_length = [draft_length.labels(model_name, str(w))
                                  for w in range(num_spec_positions + 1)]
        # prefix caching (zero with it off)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens looked up.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in prompt tokens served from the cache.")
        self.checkpoint_hits = counter("glm53:prefix_checkpoint_hits",
                                       "Requests that resumed from a cached KDA state checkpoint.")
        self.checkpoint_evictions = counter("glm53:prefix_checkpoint_evictions",
                                            "KDA state checkpoints evicted for newer ones.")

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.slot_usage.set(stats.state_slot_usage)
        self.kv_tokens_per_gib.set(stats.kv_cache_tokens_per_gib)
        # engine counters are cumulative: advance ours by what is new since the last scrape
        totals = [(self.preemptions, stats.num_preemptions),
                  (self.spec_drafts, stats.spec_num_drafts),
                  (self.spec_draft_tokens, stats.spec_num_draft_tokens),
                  (self.spec_accepted, stats.spec_num_accepted_tokens),
                  (self.prefix_queries, stats.prefix_cache_queries),
                  (self.prefix_hits, stats.prefix_cache_hits),
                  (self.checkpoint_hits, stats.prefix_checkpoint_hits),
                  (self.checkpoint_evictions, stats.prefix_checkpoint_evictions),
                  *zip(self.spec_per_pos, stats.spec_accepted_per_pos, strict=False),
                  *zip(self.spec_drafts_per_pos, stats.spec_draft_tokens_per_pos, strict=False),
                  *zip(self.spec_draft_length, stats.spec_draft_length_steps, strict=False)]
        for i, (counter, total) in enumerate(totals):
            if total > self._seen.get(i, 0):
                counter.inc(total - self._seen.get(i, 0))
                self._seen[i] = total

    def request_params(self, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def tokens(self, times: RequestTimes, num_new: int, num_prompt: int, now: float) -> None:
        """A delta with `num_new` generated tokens arrived for one engine request."""
        if num_new <= 0:
            return
        if times.first_token is None:
            times.first_token = now
            times.num_prompt_tokens = num_prompt
            self.prompt_tokens.inc(num_prompt)
            self.ttft.observe(now - times.arrival)
        else:
            self.itl.observe(now - times.last_token)
        times.last_token = now
        times.num_generation_tokens += num_new
        self.generation_tokens.inc(num_new)

    def finished(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        self.success[finish_reason if finish_reason in self.success else "error"].inc()
        self.e2e.observe(now - times.arrival)
        self.req_prompt.observe(times.num_prompt_tokens)
        self.req_gen.observe(times.num_generation_tokens)
        if times.scheduled is not None and times.engine_arrival is not None:
            self.queue.observe(max(0.0, times.scheduled - times.engine_arrival))
        if times.first_token is not None and times.last_token is not None:
            self.decode.observe(times.last_token - times.first_token)
            if times.scheduled is not None:
                self.prefill.observe(max(0.0, times.first_token - times.scheduled))
                self.inference.observe(max(0.0, times.last_token - times.scheduled))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """Several replicas'/models' expositions as one (each family's HELP/TYPE once)."""
    families: dict[str, list[str]] = {}
    current: list[str] | None = None
    for text in texts:
        for line in text.decode().splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                if name not in families:
                    families[name] = []
                current = families[name]
                if line not in current:
                    current.append(line)
            elif line.strip() and current is not None:
                current.append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines).encode()
