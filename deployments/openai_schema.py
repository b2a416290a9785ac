"""OpenAI request models (strict: wrong types and unknown fields are 400s) and the error type.

Every field is bounded to what the engine can represent, so no request can fail inside the
engine on its numbers: integers at the sampler's type limits (top_k and token counts are int32
there, seeds int64), floats finite (NaN and infinities refused), lists by length, strings by size.

Requests accept OpenAI's fields plus the vLLM extras clients commonly send (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, chat_template_kwargs). Fields OpenAI defines but this server cannot
honour yet (logit_bias, suffix; image parts where the deployment has no vision) are accepted by
the schema and refused by the server with a clear message. Responses and stream chunks are built as
plain dicts by the server (`responses.py`), which keeps the hot path free of model validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI's efforts plus GLM's "max"; chat.py REASONING_EFFORTS says what each one means
Effort = Literal["none", "minimal", "low", "medium", "high", "max"]
MAX_N = 128
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 4096
MAX_TOOLS = 256
MAX_PROMPTS = 128  # prompts of one completions request (each runs n choices)
MAX_PROMPT_TOKENS = 1 << 21  # a token-id prompt; the server refuses more than max_model_len
MAX_TEXT_CHARS = 1 << 23  # any one text field; the server caps a whole prompt by its context
MAX_NAME_CHARS = 256  # ids, names, model, user
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
MAX_REPETITION_PENALTY = 100.0


class _Strict(BaseModel):
    # allow_inf_nan=False: 1e999 parses to inf; no float field may carry it to the sampler
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class APIError(Exception):
    """An error answered with OpenAI's envelope. A plain exception whose args are its fields,
    so it pickles across the Serve handle (the server yields it; the ingress answers it)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, type, param, code, headers)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: Name


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class FunctionCall(_Strict):
    name: Name
    arguments: Text


class ToolCallIn(_Strict):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # what `_check` enforces, stated in the OpenAPI document: content unless from the assistant
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})

    role: Literal["system", "developer", "user", "assistant", "tool", "observation"]
    content: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for part in self.content if isinstance(self.content, list) else ():
            kind = part.get("type")
            if kind == "image_url":
                _check_image_part(part)
                continue
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (text and "
                                 "image_url)")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError("a text content part is {'type': 'text', 'text': str}")
            if len(part["text"]) > MAX_TEXT_CHARS:
                raise ValueError(f"a text content part has at most {MAX_TEXT_CHARS} characters")
        return self


def _check_image_part(part: dict[str, Any]) -> None:
    image = part.get("image_url")
    if (set(part) - {"type", "image_url"} or not isinstance(image, dict)
            or not isinstance(image.get("url"), str) or set(image) - {"url", "detail"}
            or image.get("detail", "auto") not in ("auto", "low", "high")):
        raise ValueError("an image content part is {'type': 'image_url', 'image_url': "
                         "{'url': str, 'detail': 'auto' | 'low' | 'high'}}")


class _Sampling(_Strict):
    """Fields shared by chat and completions."""

    model: Name
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] = 1.0
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:{id}" (vLLM)
    logit_bias: Annotated[dict[Name, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Name | None = None

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Effort | None = None
    # reasoning tokens allowed before the server forces </think> (default: the profile's)
    thinking_token_budget: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    store: bool | None = None
    metadata: Annotated[dict[Name, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None  # OpenAI's limits

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


TokenPrompt = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
Prompt = (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
          | TokenPrompt
          | Annotated[list[TokenPrompt], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: Text | None = None

    @property
    def token_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default


class TokenizeRequest(_Strict):
    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
