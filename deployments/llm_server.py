"""The LLM-server replica: one engine, OpenAI requests in, responses or SSE chunks out.

A Ray Serve deployment class (decorated by `app.py`). Each request method is an async
generator called through a streaming handle. Its first item is an `APIError` (answered with
the OpenAI envelope and its status) or, for a streaming request, `True` (accepted); then come
SSE text batches, each holding every chunk ready at that moment (fewer handle round trips under
load). A non-streaming request yields one response dict. Every accepted request ends with a
terminal item: a finish reason and `[DONE]`, or an SSE error event and `[DONE]`.

Owns: chat template rendering, tokenization, sampling defaults, the waiting-queue bound,
the n choices of a request (one engine request each, merged into one stream), metrics.
Client disconnect cancels the generator; that cancels the choices, whose engine streams
abort their requests and free the cache.

Rendering and tokenising run in a small thread pool, bounded in size (prompt characters per
context token) and time, so a huge prompt never stalls the event loop that relays every other
stream. Engine failures reach the client as a message and the request id, never their text
(that goes to the log): 503 + Retry-After when the engine is dead (Serve replaces the replica),
500 when only this request failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from glm53.raycluster.api import (
    ImageInput,
    RequestRejectedError,
    SamplingParams,
    StructuredOutput,
    read_config,
)

from .caller_watch import Caller, CallerWatch
from .chat import (
    MARKER_TOKENS,
    THINK_END,
    THINK_START,
    TOOL_START,
    ChatTemplate,
    ChatTemplateError,
)
from .config import ServingConfig
from .engine_client import EngineClient, LocalEngine
from .image_prompt import NO_VISION, ImagePrompts, image_urls
from .images import ImageError
from .listeners import bind_replica_grpc_to_node_ip
from .metrics import RequestTimes, ServingMetrics
from .openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from .provenance import read_manifest, verify
from .responses import DONE, ChoiceState, Delta, ResponseFormatter, TokenTexts, sse
from .tokenizer import load_tokenizer
from .tool_grammar import tool_call_grammar

logger = logging.getLogger(__name__)
EngineFactory = Callable[[ServingConfig, Path, str], EngineClient]
# a prompt longer than this many characters per token of context cannot fit (GLM's tokenizer
# averages ~4 on text); refusing it before tokenising bounds the work a request can cause
MAX_PROMPT_CHARS_PER_TOKEN = 16
PREPARE_THREADS = 2  # their own pool: the engine's step loop uses the default one
PREPARE_TIMEOUT_S = 30.0  # queue wait included: past it the server is too busy
RETRY_AFTER = {"Retry-After": "1"}


class LLMServer:
    def __init__(self, config: ServingConfig, device: str = "cpu",
                 engine_factory: EngineFactory | None = None) -> None:
        config.check_supported()
        bind_replica_grpc_to_node_ip()
        from .tiny_model import embedded_tiny_model

        self.config = config
        self.model_name = config.model_name
        self.model_dir = Path(config.model) if config.model else embedded_tiny_model()
        self.provenance = checkpoint_provenance(config, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.template = ChatTemplate(self.tokenizer)
        self.images = (ImagePrompts(config.images, self.model_dir, read_config(self.model_dir),
                                    self.tokenizer) if config.vision else None)
        self.texts = TokenTexts(self.tokenizer)
        self.engine: EngineClient = (engine_factory or LocalEngine)(config, self.model_dir,
                                                                    device)
        self.metrics = ServingMetrics(self.model_name, config.speculative.num_speculative_tokens)
        markers = {self.tokenizer.convert_tokens_to_ids(t) for t in MARKER_TOKENS}
        self.special_ids = set(self.tokenizer.all_special_ids) | set(
            self.tokenizer.get_added_vocab().values())
        self.skip_ids = self.special_ids - markers
        self.defaults = _generation_defaults(self.model_dir)
        self.created = int(time.time())
        self._outstanding = 0  # engine requests submitted and not yet finished
        self.callers = CallerWatch()
        self.max_prompt_chars = self.engine.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        logger.info("%s ready on %s: %s; %s", self.model_name, device, self.engine.capacity,
                    describe_provenance(self.provenance))

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        pool = getattr(self, "_prepare_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()  # stops workers, frees shared-memory channels
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.exception("engine shutdown failed")

    # ----- info -----
    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "glm53", "root": str(self.model_dir), "parent": None,
                "max_model_len": self.engine.max_model_len, "provenance": self.provenance}

    def info(self) -> dict[str, Any]:
        return {**self.model_card(), "capacity": self.engine.capacity,
                "profile": self.config.profile}

    def check_health(self) -> None:  # Ray Serve's replica health check
        self.engine.check_health()

    async def health(self) -> bool:
        self.engine.check_health()
        return True

    async def metrics_text(self) -> bytes:
        self.metrics.set_engine_stats(self.engine.stats())
        return self.metrics.render()

    # ----- tokenizer endpoints -----
    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any] | APIError:
        try:
            return await self._off_loop(self._tokenize, request)
        except APIError as exc:
            return exc

    def _tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        try:
            if request.messages is not None:
                text = self.template.render(_messages(request.messages),
                                            add_generation_prompt=request.add_generation_prompt)
                ids = self._encode(text)
            else:
                self._check_size(request.prompt, "prompt")
                ids = list(self.tokenizer.encode(request.prompt,
                                                 add_special_tokens=request.add_special_tokens))
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len,
                               "tokens": ids}
        if request.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, request: DetokenizeRequest) -> dict[str, Any] | APIError:
        try:
            return await self._off_loop(self._detokenize, request.tokens)
        except APIError as exc:
            return exc

    def _detokenize(self, tokens: list[int]) -> dict[str, Any]:
        if any(t >= self.engine.vocab_size for t in tokens):
            raise bad_request(f"token ids must be in [0, {self.engine.vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)}

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the prepare threads, within PREPARE_TIMEOUT_S (APIErrors it raises
        come through)."""
        work = asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)
        try:
            return await asyncio.wait_for(work, PREPARE_TIMEOUT_S)
        except TimeoutError:
            raise APIError(503, "the server is too busy to prepare this prompt; retry later",
                           "service_unavailable_error", None, "server_overloaded",
                           RETRY_AFTER) from None

    # ----- generation endpoints -----
    async def chat(self, request: ChatCompletionRequest, request_id: str = "",
                   caller: Caller | None = None) -> AsyncIterator[Any]:
        """`request_id`: the HTTP request's id, named in errors and logs; `caller`: the
        ingress replica relaying the response (its death aborts the request)."""
        arrival = time.monotonic()
        try:
            prompt_ids, reasoning_start, tools, forced, structured, images = (
                await self._off_loop(self._chat_prompt, request))
            budget = request.thinking_token_budget
            params = self._sampling(
                request, [prompt_ids], request.token_limit,
                logprobs=(request.top_logprobs or 0) if request.logprobs else None,
                structured_output=structured,
                reasoning=reasoning_start,
                thinking_budget=budget if budget is not None else
                self.config.thinking_token_budget)
            await self.engine.check_request(params[0])
        except RequestRejectedError as exc:  # before a stream is accepted: a plain 400
            yield bad_request(str(exc), "response_format" if request.response_format else None)
            return
        except APIError as exc:
            yield exc
            return
        choices = [self._choice(i, request, len(prompt_ids), reasoning_start, tools,
                                tool_prefix=forced) for i in range(request.n)]
        runs = [(prompt_ids, p, images) for p in params]
        async for item in self._respond("chat", request, runs, choices, arrival, request_id,
                                        caller):
            yield item

    async def completions(self, request: CompletionRequest, request_id: str = "",
                          caller: Caller | None = None) -> AsyncIterator[Any]:
        arrival = time.monotonic()
        try:
            if request.suffix is not None:
                raise bad_request("suffix is not supported", "suffix")
            if request.best_of is not None and request.best_of != request.n:
                raise bad_request("best_of other than n is not supported", "best_of")
            prompts = await self._off_loop(self._completion_prompts, request.prompt)
            lp = request.logprobs
            params = self._sampling(request, prompts, request.token_limit, logprobs=lp,
                                    prompt_logprobs=lp if request.echo and lp is not None
                                    else None)
        except APIError as exc:
            yield exc
            return
        runs, choices = [], []
        for p_index, prompt_ids in enumerate(prompts):
            for j in range(request.n):
                index = p_index * request.n + j
                runs.append((prompt_ids, params[index], ()))
                choices.append(self._choice(index, request, len(prompt_ids), None, None,
                                            echo_ids=prompt_ids if request.echo else None))
        async for item in self._respond("completion", request, runs, choices, arrival,
                                        request_id, caller):
            yield item

    # ----- request preparation (in the prepare threads) -----
    def _check_size(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"the {param} has {len(text)} characters; this model's context of "
                f"{self.engine.max_model_len} tokens cannot hold more than "
                f"{self.max_prompt_chars}", param, "context_length_exceeded")

    def _encode(self, text: str, param: str = "messages") -> list[int]:
        self._check_size(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _chat_prompt(self, request: ChatCompletionRequest,
                     ) -> tuple[list[int], bool, list[dict] | None, str, StructuredOutput | None,
                                list[ImageInput]]:
        """(prompt ids, whether the output starts inside <think>, tools to parse, the forced
        tool-call prefix already in the prompt, the output's constraint, the images whose
        placeholders the prompt holds)."""
        if request.logit_bias:
            raise bad_request("logit_bias is not supported yet", "logit_bias")
        fmt = request.response_format
        messages = _messages(request.messages)
        urls = image_urls(messages)
        if urls and self.images is None:
            raise bad_request(NO_VISION, "messages")
        try:
            processed = self.images.process(urls) if urls else []
        except ImageError as exc:
            raise bad_request(str(exc), "messages") from exc
        if fmt is not None and fmt.type == "json_object" and "json" not in json.dumps(
                messages).lower():
            # OpenAI's rule for JSON mode: the conversation must ask for JSON
            raise bad_request("'messages' must contain the word 'json' in some form to use "
                              "'response_format' of type 'json_object'", "response_format")
        choice = request.tool_choice
        tools = None
        if request.tools and choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
        # A forced call is a prefix of the assistant turn (GLM's call syntax starts with the
        # marker and the name), and the rest of the call follows the tool's parameter schema
        # under a grammar (tool_grammar.py).
        forced, structured = "", _structured_output(fmt)
        if choice == "required" or hasattr(choice, "function"):
            if not tools:
                raise bad_request("tool_choice requires tools", "tool_choice")
            if structured is not None:
                raise bad_request("response_format cannot be combined with a forced "
                                  "tool_choice", "response_format")
            forced, name = TOOL_START, None
            if hasattr(choice, "function"):
                name = choice.function.name
                if name not in {t["function"]["name"] for t in tools}:
                    raise bad_request(f"tool_choice names an unknown tool {name!r}",
                                      "tool_choice")
                forced += f"{name}\n"
            structured = StructuredOutput("grammar", tool_call_grammar(tools, name))
        try:
            text = self.template.render(
                messages, tools=tools, reasoning_effort=request.reasoning_effort,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        if forced:
            text += (THINK_END if text.endswith(THINK_START) else "") + forced
        ids, images = self._encode(text), []
        if processed:
            try:
                ids, images = self.images.expand(ids, processed)
            except ImageError as exc:
                raise bad_request(str(exc), "messages") from exc
        return ids, text.endswith(THINK_START), tools, forced, structured, images

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self._encode(prompt, "prompt")]
        elif isinstance(prompt[0], str):
            prompts = [self._encode(p, "prompt") for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        if any(not p for p in prompts):
            raise bad_request("the prompt is empty", "prompt")
        return prompts

    def _sampling(self, request: Any, prompts: list[list[int]], limit: int | None, *,
                  logprobs: int | None, prompt_logprobs: int | None = None,
                  structured_output: StructuredOutput | None = None, reasoning: bool = False,
                  thinking_budget: int | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (n per prompt; seed + i for the i-th choice).
        reasoning: the output starts inside `<think>` (the budget applies only then)."""
        max_len = self.engine.max_model_len
        longest = max(len(p) for p in prompts)
        max_tokens = limit if limit is not None else max_len - longest
        if longest + max(max_tokens, 1) > max_len or max_tokens < 1:
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {longest + max_tokens} tokens ({longest} in the {param}, "
                f"{max_tokens} in the completion). Please reduce the length of the {param} "
                "or completion.", param, "context_length_exceeded")
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in request.stop_token_ids or ()):
            raise bad_request(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        d = self.defaults
        top_k = request.top_k if request.top_k is not None else d.get("top_k", 0)
        stop_ids = tuple(dict.fromkeys(request.stop_token_ids or ()))
        base = dict(
            max_tokens=max_tokens,
            temperature=(request.temperature if request.temperature is not None
                         else d.get("temperature", 1.0)),
            top_p=request.top_p if request.top_p is not None else d.get("top_p", 1.0),
            top_k=max(top_k, 0),
            min_p=request.min_p if request.min_p is not None else 0.0,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty, min_tokens=request.min_tokens,
            stop_token_ids=stop_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_output=structured_output,
            reasoning=reasoning, thinking_budget=thinking_budget if reasoning else None)
        out = []
        for _ in prompts:
            for i in range(request.n):
                seed = request.seed + i if request.seed is not None else None
                try:
                    out.append(SamplingParams(**base, seed=seed))
                except ValueError as exc:
                    raise bad_request(str(exc)) from exc
        return out

    def _choice(self, index: int, request: Any, num_prompt_tokens: int,
                reasoning_start: bool | None, tools: list[dict] | None,
                echo_ids: list[int] | None = None, tool_prefix: str = "") -> ChoiceState:
        stop_ids = set(request.stop_token_ids or ())
        if not request.ignore_eos:
            stop_ids |= set(self.engine.eos_token_ids)
        choice = ChoiceState(
            index, self.tokenizer, stop_strings=request.stop_strings,
            include_stop_str=request.include_stop_str_in_output, stop_token_ids=stop_ids,
            skip_ids=self.skip_ids if request.skip_special_tokens else set(),
            reasoning_start=reasoning_start, tools=tools, echo_ids=echo_ids,
            tool_prefix=tool_prefix)
        choice.num_prompt_tokens = num_prompt_tokens
        return choice

    # ----- running the choices -----
    async def _respond(self, kind: str, request: Any, runs: list, choices: list[ChoiceState],
                       arrival: float, http_id: str,
                       caller: Caller | None = None) -> AsyncIterator[Any]:
        http_id = http_id or uuid.uuid4().hex  # callers other than the ingress may give none
        try:
            self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - Serve's health check replaces this replica
            logger.warning("request %s refused: engine unhealthy: %s", http_id, exc)
            yield _engine_unavailable(http_id)
            return
        bound = self.config.max_waiting_requests
        if len(runs) > bound:  # would be refused as overloaded even on an idle server
            yield bad_request(f"this request runs {len(runs)} sequences (n choices per prompt); "
                              f"this server queues at most {bound}", "n")
            return
        stats = self.engine.stats()
        waiting = max(0, self._outstanding - stats.num_running)
        if waiting + len(runs) > self.config.max_waiting_requests:
            yield APIError(503, f"the server is overloaded ({waiting} requests waiting, bound "
                           f"{self.config.max_waiting_requests}); retry later",
                           "service_unavailable_error", None, "server_overloaded",
                           {"Retry-After": "1"})
            return
        self.metrics.request_params(request.n, runs[0][1].max_tokens)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._outstanding += len(runs)
        tasks = [asyncio.create_task(self._run_choice(
            f"{response_id}-{c.index}", ids, params, c, queue, arrival, http_id, images))
            for (ids, params, images), c in zip(runs, choices, strict=True)]
        fmt = ResponseFormatter(kind, response_id, self.created, self.model_name, request, choices,
                         self.texts)
        try:
            with self.callers.watch(caller, tasks):
                if request.stream:
                    yield True
                    async for batch in self._stream(queue, len(tasks), fmt):
                        yield batch
                else:
                    yield await self._collect(queue, len(tasks), fmt)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          choice: ChoiceState, queue: asyncio.Queue, arrival: float,
                          http_id: str, images: list[ImageInput] | tuple = ()) -> None:
        times = RequestTimes(arrival)
        stream = self.engine.generate(prompt_ids, params, request_id, images)
        try:
            async for out in stream:
                now = time.monotonic()
                if out.timing is not None:
                    times.engine_arrival = out.timing.queued
                    times.scheduled = out.timing.first_scheduled
                self.metrics.tokens(times, len(out.new_token_ids), out.num_prompt_tokens, now)
                delta = choice.feed(out)
                if choice.error is not None:
                    queue.put_nowait(self._engine_error(http_id, request_id, choice.error))
                    break
                queue.put_nowait(delta)
                if choice.done:
                    break
        except RequestRejectedError as exc:
            queue.put_nowait(bad_request(str(exc)))
        except Exception as exc:  # noqa: BLE001 - every request must get a terminal answer
            logger.exception("request %s (%s) failed", http_id, request_id)
            queue.put_nowait(self._engine_error(http_id, request_id, type(exc).__name__))
        finally:
            await stream.aclose()  # aborts the engine request if it is still running
            if not choice.done:
                # cancelled before the engine even queued it: this abort is queued behind the
                # submission, so the request cannot run on unobserved
                await self.engine.abort(request_id)
            self._outstanding -= 1
            reason = "error" if choice.error else choice.finish_reason or "abort"
            self.metrics.finished(times, reason, time.monotonic())
            queue.put_nowait(None)  # this choice is over

    def _engine_error(self, http_id: str, request_id: str, detail: str) -> APIError:
        """The client's error for an engine failure: 503 if the engine is dead (the replica is
        being replaced: retrying helps), else 500; the detail goes to the log only."""
        logger.error("request %s (%s) failed in the engine: %s", http_id, request_id, detail)
        try:
            self.engine.check_health()
        except Exception:  # noqa: BLE001 - any failure means dead
            return _engine_unavailable(http_id)
        return APIError(500, f"the engine failed on this request (request id {http_id})",
                        "server_error")

    async def _items(self, queue: asyncio.Queue, num_tasks: int) -> AsyncIterator[list]:
        """Batches of whatever the choices produced, until every choice is over."""
        remaining = num_tasks
        while remaining:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            remaining -= sum(item is None for item in items)
            yield [item for item in items if item is not None]

    async def _stream(self, queue: asyncio.Queue, num_tasks: int,
                      fmt: ResponseFormatter) -> AsyncIterator[str]:
        async for items in self._items(queue, num_tasks):
            error = next((i for i in items if isinstance(i, APIError)), None)
            if error is not None:
                yield fmt.stream_chunks([d for d in items if isinstance(d, Delta)]) + sse(
                    error.body()) + DONE
                return
            if chunk := fmt.stream_chunks(items):
                yield chunk
        yield fmt.stream_end() + DONE

    async def _collect(self, queue: asyncio.Queue, num_tasks: int,
                       fmt: ResponseFormatter) -> dict[str, Any] | APIError:
        async for items in self._items(queue, num_tasks):
            for item in items:
                if isinstance(item, APIError):
                    return item
                fmt.accumulate(item)
        return fmt.response()


def _engine_unavailable(http_id: str) -> APIError:
    return APIError(503, f"the engine is unavailable and being restarted; retry later "
                    f"(request id {http_id})", "service_unavailable_error", None,
                    "engine_unavailable", RETRY_AFTER)


def checkpoint_provenance(config: ServingConfig, model_dir: Path,
                          ) -> dict[str, Any] | None:
    """The checkpoint's manifest digest for the model card: checked against every file first
    when `config.verify` (raising ProvenanceError on a mismatch, so the replica never starts),
    else as recorded. None when the checkpoint has no manifest (and verify is off)."""
    folders = {"model": model_dir}
    if config.speculative.draft_model:
        folders["draft_model"] = Path(config.speculative.draft_model)
    out: dict[str, Any] = {}
    for name, folder in folders.items():
        manifest = verify(folder, progress=False) if config.verify else read_manifest(folder)
        if manifest is not None:
            out[name] = {"manifest_sha256": manifest.digest, "verified": config.verify}
    return out or None


def describe_provenance(provenance: dict[str, Any] | None) -> str:
    if not provenance:
        return "no checkpoint manifest (glm53 verify --write DIR records one)"
    return ", ".join(f"{name} sha256 {p['manifest_sha256']} "
                     f"({'verified' if p['verified'] else 'not verified'})"
                     for name, p in provenance.items())


def _structured_output(fmt: Any) -> StructuredOutput | None:
    """The engine constraint of a chat `response_format` (text: none)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json")
    return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))


def _messages(messages: list) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults from the checkpoint's generation_config.json (vLLM does the same)."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in ("temperature", "top_p", "top_k") if k in config}
