"""The OpenAI-compatible Ray Serve app end to end on CPU: the official `openai` client, raw SSE
bytes, concurrency, bad inputs, client disconnect and metrics.

One module-scoped app serves three models: `tiny` (the real engine on a tiny random checkpoint),
`exl3` (the same on a tiny checkpoint whose routed experts are EXL3 K4 codes, as in the seed
checkpoint) and `scripted` (the same server with a scripted engine injected, to force tool calls
and reasoning through the real parsers and HTTP stack).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm53.deployments.app import ingress_app, server_app
from glm53.deployments.config import ServingConfig
from glm53.deployments.provenance import read_manifest, write_manifest
from glm53.deployments.tokenizer import decode, load_tokenizer
from tests.deployments.scripted_engine import ScriptedEngine

# the full tier (make test-all, CI): serves three models through Ray Serve's HTTP proxy
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(serve_url, tmp_path_factory, tiny_checkpoints):
    from ray import serve

    # a copy: the manifest written into it must not reach the other tests
    path = tmp_path_factory.mktemp("serve") / "tiny"
    shutil.copytree(tiny_checkpoints(seed=0, mtp=True), path)
    write_manifest(path, progress=False)
    common = {"model": str(path), "device": "cpu"}
    # the default profile's speculative decoding (MTP), with 2 drafts
    tiny = ServingConfig(served_model_name="tiny", max_model_len=256, max_num_seqs=16,
                         num_blocks=512, speculative="mtp:2", verify=True, **common)
    scripted = ServingConfig(served_model_name="scripted", max_waiting_requests=2,
                             speculative="none", **common)
    exl3_path = tiny_checkpoints(seed=1, mtp=True, exl3=True)
    exl3 = ServingConfig(served_model_name="exl3", model=str(exl3_path), device="cpu",
                         max_model_len=128, num_blocks=128, speculative="mtp:2")
    app = ingress_app({"tiny": server_app(tiny, "cpu"), "exl3": server_app(exl3, "cpu"),
                       "scripted": server_app(scripted, "cpu", ScriptedEngine)})
    serve.run(app, name="openai-test", route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    yield serve_url
    serve.delete("openai-test")


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(base_url, http):
    return load_tokenizer(http.get("/v1/models/tiny").json()["root"])


def metrics(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def metric(m, name: str, model: str = "tiny", **labels) -> float:
    return m.get((name, tuple(sorted({"model_name": model, **labels}.items()))), 0.0)


def chat(messages: str | list, **kw) -> dict:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"model": "tiny", "messages": messages, **kw}


# ----- basics -----
def test_models_tokenize_detokenize(http, tokenizer):
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "exl3", "scripted"}
    digest = read_manifest(cards["tiny"]["root"]).digest
    assert cards["tiny"]["provenance"] == {"model": {"manifest_sha256": digest,
                                                     "verified": True}}
    assert cards["exl3"]["provenance"] is None  # no manifest written
    r = http.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert r["tokens"] == list("héllo".encode()) and r["count"] == 6
    assert r["max_model_len"] == 256
    r = http.post("/tokenize", json={"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert decode(tokenizer, r["tokens"]) == "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>"
    assert http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()[
        "prompt"] == "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>"
    assert http.get("/health").status_code == 200


def test_chat_and_completions_with_the_openai_client(client, http, tokenizer):
    r = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "Hello"}], max_tokens=12, **GREEDY)
    assert r.object == "chat.completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    n_prompt = http.post("/tokenize", json={"model": "tiny", "messages": [
        {"role": "user", "content": "Hello"}]}).json()["count"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)
    # the template opened <think>: the tiny model's output is reasoning until </think>
    assert choice.message.reasoning_content is not None or choice.message.content
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, **GREEDY)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 10
    ids = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "logprobs": 0}).json()["choices"][0]["logprobs"]["tokens"]
    assert len(ids) == 10


def test_exl3_experts_served_with_mtp(client):
    """A checkpoint with EXL3 routed experts serves through the whole stack (MTP drafts on):
    streamed output equals the non-streamed answer."""
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model="exl3", messages=messages, max_tokens=10, **GREEDY)
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    message = r.choices[0].message
    stream = client.chat.completions.create(model="exl3", messages=messages, max_tokens=10,
                                            stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == (message.reasoning_content or "")
    assert content == (message.content or "")
    assert reasoning or content


def test_stream_equals_non_stream_and_usage(client):
    kwargs = dict(model="tiny", prompt="The sky is", max_tokens=20, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(b"The sky is")
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # chat: reasoning + content deltas concatenate to the non-streamed message
    msgs = [{"role": "user", "content": "Why?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, **GREEDY)
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                                stream=True, **GREEDY))
    assert parts[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(p.choices[0].delta, "reasoning_content", None) or ""
                        for p in parts)
    content = "".join(p.choices[0].delta.content or "" for p in parts)
    assert reasoning == (full.choices[0].message.reasoning_content or "")
    assert content == (full.choices[0].message.content or "")


def test_streamed_text_equals_decode_of_all_ids(http, tokenizer):
    """Random tiny-model bytes are often invalid UTF-8: replacement chars appear exactly where
    decoding the whole id sequence puts them, streamed or not."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "logprobs": 0, "skip_special_tokens": False,
            "return_tokens_as_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in whole["logprobs"]["tokens"]]
    assert len(ids) == 40
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == whole["text"] == decode(tokenizer, ids)


def test_n_seed_and_logprobs(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Pick"}], max_tokens=8,
              temperature=1.0, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw, seed=123, n=2)
    b = client.chat.completions.create(**kw, seed=123, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert a.usage.completion_tokens == 16
    text = [(c.message.reasoning_content, c.message.content) for c in a.choices]
    assert text == [(c.message.reasoning_content, c.message.content) for c in b.choices]
    assert text[0] != text[1]  # choice i is seeded with seed + i
    other = client.chat.completions.create(**kw, seed=124, n=1)
    assert (other.choices[0].message.reasoning_content, other.choices[0].message.content) \
        == text[1]
    sampled = client.chat.completions.create(
        model="tiny", messages=kw["messages"], max_completion_tokens=3, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1})
    assert sampled.usage.completion_tokens == 3
    g = client.chat.completions.create(**{**kw, "temperature": 0}, logprobs=True,
                                       top_logprobs=3)
    entries = g.choices[0].logprobs.content
    assert len(entries) == 8
    for e in entries:  # greedy: the sampled token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.logprob <= 0 and isinstance(e.bytes, list)


def test_stop_strings_and_stop_ids(client):
    kw = dict(model="tiny", prompt="Tell me", max_tokens=30, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    visible = [i for i, ch in enumerate(full) if ch.isprintable() and ch != "\ufffd"]
    start = next(i for i in visible if i > 3 and i + 1 in visible)
    stop = full[start:start + 2]
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kw, stop=stop, stream=True) if c.choices)
    assert streamed == full[:full.find(stop)]
    kept = client.completions.create(**{**kw, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}, stop=[stop])
    assert kept.choices[0].text == full[:full.find(stop)] + stop


def test_stop_token_ids(http, tokenizer):
    body = {"model": "tiny", "prompt": "Tell me", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in full["logprobs"]["tokens"]]
    k = next(i for i in range(3, 30) if ids[i] not in ids[:i])
    cut = http.post("/v1/completions", json={**body, "stop_token_ids": [ids[k]]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] == k + 1  # the stop token counts, as in vLLM
    assert cut["choices"][0]["text"] == decode(tokenizer, ids[:k])  # but is not text


def test_echo_with_prompt_logprobs(http):
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "abc", "max_tokens": 3, "echo": True, "logprobs": 1,
        "temperature": 0, "ignore_eos": True}).json()["choices"][0]
    assert r["text"].startswith("abc")
    lp = r["logprobs"]
    assert lp["tokens"][:3] == ["a", "b", "c"] and len(lp["tokens"]) == 6
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][:4] == [0, 1, 2, 3]


# ----- forced output: tool calls and reasoning -----
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TOOL_SCRIPT = ("SCRIPT:Checking.</think><tool_call>get_weather\n<arg_key>city</arg_key>\n"
               "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>"
               "\n</tool_call>")


def test_tool_calls_parsed_from_forced_output(client):
    msgs = [{"role": "user", "content": TOOL_SCRIPT}]
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks = list(client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS,
                                                 stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": no tools in the prompt, no parsing
    plain = client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS,
                                           tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("<tool_call>get_weather")


def test_forced_tool_choice_prefills_the_call(client):
    args = "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="scripted", tools=TOOLS, tool_choice=named,
                                       messages=[{"role": "user", "content": "SCRIPT:" + args}])
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Rome"})
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.reasoning_content is None
    r = client.chat.completions.create(
        model="scripted", tools=TOOLS, tool_choice="required",
        messages=[{"role": "user", "content": "SCRIPT:get_weather\n" + args}])
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_reasoning_split_from_forced_output(client):
    msgs = [{"role": "user", "content": "SCRIPT:step 1, step 2</think>Answer: 4"}]
    r = client.chat.completions.create(model="scripted", messages=msgs)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
        "step 1, step 2", "Answer: 4", "stop")
    assert m.model_extra["reasoning"] == "step 1, step 2"
    off = client.chat.completions.create(model="scripted", messages=[
        {"role": "user", "content": "SCRIPT:plain"}], reasoning_effort="none")
    assert (off.choices[0].message.content, off.choices[0].message.reasoning_content) == (
        "plain", None)


# ----- SSE framing -----
def test_sse_framing_bytes(http):
    body = chat("Hi", max_tokens=5, temperature=0, stream=True, ignore_eos=True,
                stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event
        obj = json.loads(event[6:])
        assert obj["object"] == "chat.completion.chunk" and obj["model"] == "tiny"
    last = json.loads(events[-3][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    ids = {json.loads(e[6:])["id"] for e in events[:-2]}
    assert len(ids) == 1


# ----- concurrency -----
def test_32_concurrent_streams_match_sequential_greedy(base_url, client):
    prompts = [f"Prompt {i}: tell me" for i in range(8)]
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    sequential = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def one(aclient, prompt):
        text, usage = "", None
        stream = await aclient.completions.create(prompt=prompt, stream=True,
                                                  stream_options={"include_usage": True}, **kw)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    async def all32():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 8]) for i in range(32)))

    results = asyncio.run(all32())
    for i, (text, usage) in enumerate(results):
        assert text == sequential[i % 8]
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens == len(prompts[i % 8].encode())


# ----- errors -----
BAD = [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.1}, 400,
     "temperature"),
    ("/v1/chat/completions", chat("x", frobnicate=True), 400, "frobnicate"),
    ("/v1/chat/completions", chat("x", n="2"), 400, "n"),
    ("/v1/chat/completions", chat("x", max_tokens=1.5), 400, "max_tokens"),
    ("/v1/chat/completions", chat([]), 400, "messages"),
    ("/v1/chat/completions", chat([{"role": "wizard", "content": "x"}]), 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 300}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", chat("x", response_format={"type": "json_schema",
                                                         "json_schema": {}}), 400, None),
    ("/v1/chat/completions", chat("x", tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", chat("x", tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "other"}}), 400, "tool_choice"),
    ("/v1/chat/completions", chat("x", logprobs=False, top_logprobs=2), 400, None),
    ("/v1/chat/completions", chat("x", stop=""), 400, "stop"),
    ("/v1/chat/completions", chat("x", chat_template_kwargs={"nope": 1}), 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 9, "max_tokens": 2},
     400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_inputs_get_the_error_envelope(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_malformed_json_and_unknown_route_and_health_after_errors(http, client):
    r = http.post("/v1/chat/completions", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert http.get("/health").status_code == 200
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_engine_failure_still_ends_every_request(http):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "SCRIPT:abcFAIL!"}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 500
    message = r.json()["error"]["message"]  # the request id (Serve's), never the exception
    assert "scripted engine failure" not in message and r.headers["x-request-id"] in message
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["type"] == "server_error"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("reasoning_content", "")
                   for e in events[:-2])
    assert text == "abc"
    assert http.get("/health").status_code == 200


def test_more_choices_than_the_queue_ever_holds_is_400(http):
    """n = 3 with a waiting bound of 2 could never be admitted: 400, not 503 + Retry-After
    (test_server_isolation checks that a full queue is still 503)."""
    r = http.post("/v1/chat/completions", json={
        "model": "scripted", "n": 3, "messages": [{"role": "user", "content": "SCRIPT:x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ----- disconnect and metrics -----
def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_client_disconnect_aborts_and_frees_the_cache(base_url, http):
    before = metrics(http)
    body = chat("Go on", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with httpx.Client(base_url=base_url, timeout=60) as own, own.stream(
            "POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        m = metrics(http)
        assert metric(m, "vllm:num_requests_running") == 1
        assert metric(m, "vllm:kv_cache_usage_perc") > 0
    # the connection is closed mid-stream: the engine aborts and frees blocks and slot
    def settled():
        m = metrics(http)
        return (metric(m, "vllm:num_requests_running") == 0
                and metric(m, "vllm:kv_cache_usage_perc") == 0
                and metric(m, "glm53:kda_state_slot_usage_perc") == 0
                and metric(m, "vllm:request_success_total", finished_reason="abort")
                == metric(before, "vllm:request_success_total", finished_reason="abort") + 1
                ) and m
    m = wait_for(settled)
    assert m, metrics(http)
    generated = metric(m, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total")
    assert 1 <= generated < 200


def test_metrics_move_as_requests_run(http, client):
    before = metrics(http)
    client.completions.create(model="tiny", prompt="count", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(http)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 5
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count"):
        assert delta(name) == 1, name
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert metric(after, "vllm:num_preemptions_total") == 0
    drafts = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert delta("vllm:spec_decode_num_drafts_total") >= 1 and 0 <= accepted <= drafts
    per_pos = sum(delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                  for p in range(2))
    assert per_pos == accepted
    assert ("vllm:num_requests_waiting", (("model_name", "scripted"),)) in after
