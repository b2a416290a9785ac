"""Serving load (`glm53 bench serve`): time to first token, inter-token latency and tokens per
second of an OpenAI-compatible server (ours, or any that speaks vLLM's dialect) at each
concurrency level and prompt length.

Prompts are token-id lists, which the completions API takes, so each has exactly the length
asked for; the ids are drawn from the server's own tokenization of plain text (POST /tokenize),
so they are ordinary tokens of the served vocabulary and need no local tokenizer. Every prompt
is drawn afresh: no two requests share a prefix. Requests stream with
`stream_options.continuous_usage_stats`, so every chunk states how many tokens were generated
so far and a chunk bringing several (speculative decoding, SSE batching) counts them all.

Per request: TTFT (sent -> first chunk with a token), TPOT ((last token - first token) /
(tokens - 1)), e2e latency, and inter-token latencies: each gap between chunks divided by the
tokens that chunk brought, once per token (so a chunk of 3 tokens after 30 ms gives three
10 ms entries). Per level: percentiles of those, output tokens per second of the whole level
(tokens / wall time from the first request sent to the last one finished), tokens per second
per user (the median over requests of (tokens - 1) / (last token - first token)) and failures.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

# plain text whose tokens seed the prompts (any text would do: only its token ids are used)
SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee reviews the annual budget, "
    "and seven engineers debate whether the new parser handles nested lists, unicode names, "
    "numbers like 3.14159 or 2048, and punctuation such as semicolons; questions? answers! "
    "Meanwhile a river flows past old mills, orchards and quiet villages toward the distant sea.")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    sent: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)  # seconds, one entry per token after the 1st
    error: str | None = None


@dataclass(frozen=True)
class Server:
    base_url: str  # up to and without /v1
    model: str
    max_model_len: int | None
    card: dict  # the /v1/models entry (root, provenance...)
    headers: dict[str, str]


async def connect(client, base_url: str, model: str | None = None,
                  api_key: str | None = None) -> Server:
    """The server's model card (the first served model unless `model` is given)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    if card is None:
        raise ValueError(f"model {model!r} is not served (served: "
                         f"{', '.join(c['id'] for c in cards)})")
    return Server(base_url, card["id"], card.get("max_model_len"), card, headers)


async def token_pool(client, server: Server) -> np.ndarray:
    """Distinct ids of ordinary tokens of the served vocabulary (SEED_TEXT tokenized)."""
    response = await client.post(f"{server.base_url}/tokenize", headers=server.headers,
                                 json={"model": server.model, "prompt": SEED_TEXT})
    response.raise_for_status()
    return np.unique(np.array(response.json()["tokens"], dtype=np.int64))


def make_prompts(pool: np.ndarray, count: int, length: int,
                 rng: np.random.Generator) -> list[list[int]]:
    return rng.choice(pool, (count, length)).tolist()


async def stream_one(client, server: Server, prompt: list[int], output_len: int) -> RequestRecord:
    payload = {"model": server.model, "prompt": prompt, "max_tokens": output_len,
               "temperature": 0.0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    record = RequestRecord(time.perf_counter())
    try:
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=payload,
                                 headers=server.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return record
                _count(record, (chunk.get("usage") or {}).get("completion_tokens", 0))
    except Exception as exc:  # noqa: BLE001 - one failed request is counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.finished = time.perf_counter()
    if record.tokens == 0:
        record.error = "no token came back (does the server report continuous usage stats?)"
    return record


def _count(record: RequestRecord, total: int) -> None:
    new = total - record.tokens
    if new <= 0:
        return
    now = time.perf_counter()
    if record.first_token is None:
        record.first_token = now
    else:
        record.itl.extend([(now - record.last_token) / new] * new)
    record.last_token, record.tokens = now, total


async def run_level(client, server: Server, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> tuple[list[RequestRecord], float]:
    """The prompts with at most `concurrency` in flight; (records, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestRecord:
        async with gate:
            return await stream_one(client, server, prompt, output_len)

    start = time.perf_counter()
    records = await asyncio.gather(*(gated(p) for p in prompts))
    return records, time.perf_counter() - start


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ms = np.array(values) * 1e3
    return {"mean": float(ms.mean()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    per_user = [(r.tokens - 1) / (r.last_token - r.first_token) for r in ok
                if r.tokens > 1 and r.last_token > r.first_token]
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records), "failed": len(errors), "errors": sorted(set(errors))[:5],
        "duration_s": duration_s, "output_tokens": tokens,
        "output_tok_s": tokens / duration_s if duration_s > 0 else 0.0,
        "tok_s_per_user": float(np.median(per_user)) if per_user else None,
        "request_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _stats_ms([r.first_token - r.sent for r in ok]),
        "tpot_ms": _stats_ms([(r.last_token - r.first_token) / (r.tokens - 1)
                              for r in ok if r.tokens > 1]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats_ms([r.finished - r.sent for r in ok]),
    }


async def bench_serve(base_url: str, concurrencies: list[int], prompt_lens: list[int],
                      output_len: int, requests_per_level: int | None = None,
                      model: str | None = None, api_key: str | None = None, seed: int = 0,
                      progress=None) -> dict:
    """Every (prompt length, concurrency) cell; a cell the server's context cannot hold is
    recorded as skipped. `requests_per_level`: default twice the concurrency (at least 4).
    `progress(row)` is called after each cell."""
    import httpx

    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=max(concurrencies), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                                 limits=limits) as client:
        server = await connect(client, base_url, model, api_key)
        pool = await token_pool(client, server)
        warm = await stream_one(client, server, make_prompts(pool, 1, 16, rng)[0], 4)
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        rows = []
        for prompt_len in prompt_lens:
            for concurrency in concurrencies:
                row = {"prompt_len": prompt_len, "concurrency": concurrency,
                       "output_len": output_len}
                if server.max_model_len and prompt_len + output_len > server.max_model_len:
                    row["skipped"] = (f"prompt + output {prompt_len + output_len} > "
                                      f"max_model_len {server.max_model_len}")
                else:
                    count = requests_per_level or max(2 * concurrency, 4)
                    prompts = make_prompts(pool, count, prompt_len, rng)
                    records, duration = await run_level(client, server, prompts, output_len,
                                                        concurrency)
                    row.update(summarize(records, duration))
                rows.append(row)
                if progress is not None:
                    progress(row)
    return {"model": server.model, "server": server.card, "results": rows}
