"""OpenAI request bodies as pydantic models.

Every optional field defaults to `None`, never to a value: `None` means "the
client did not say", so the server's and the model's defaults can apply
(seeds/002). Types and ranges are checked here, so a bad value is a 400 that
names its field; values that need the model (token ids, context length) are
checked by the adapter and the engine. Unknown fields are ignored, not
rejected: clients send many. A known field shoal does not implement
is refused by the adapter rather than silently ignored.

Numbers are strict: a JSON boolean is not an integer or a float (pydantic would
read `true` as 1), and an integer field takes no `1.0` or `"1"`.

The response models at the end are the API's contract: the routes declare them
in the OpenAPI document, and the fuzzer in the tests checks answers against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.server.chat.params import INT64_MAX, INT64_MIN, Float, Int  # noqa: F401  (strict numbers, shared by the adapters)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = None


class SamplingFields(_Request):
    """The fields chat and completions share."""

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    n: Int | None = Field(None, ge=1)  # prompts x n is bounded by --max-sequences-per-request
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Common extras (vLLM / HF names).
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0)
    min_tokens: Int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: Int | None = None
    # Ollama's: how long the model stays loaded once idle (seconds or a duration like "10m"; 0 now; negative: always).
    keep_alive: int | float | str | None = None
    # Structured output (checked by the adapter, which names what is wrong): OpenAI's
    # response_format, and vLLM's extras, `structured_outputs` and the older `guided_*`.
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extra: each prompt token's logprob and the top k (k = 0: the token's own only).
    prompt_logprobs: Int | None = Field(None, ge=0, le=20)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # A string, or a list of parts ({"type": "text", "text": ...}; images are refused by the adapter).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; checked by the adapter
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids or a list of token-id lists:
    # checked by the adapter, which can say which of these it is not.
    prompt: Any = Field(...)
    echo: bool | None = None
    suffix: str | None = None
    # 0 only with echo: the prompt back (and its logprobs), nothing generated.
    max_tokens: Int | None = Field(None, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=20)
    best_of: Int | None = Field(None, ge=1)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as chat renders them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


# ---------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorResponse(BaseModel):
    """Every refusal and failure, whatever the status."""

    error: ErrorDetail


FinishReasonName = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Response):
    """vLLM's entry for one candidate of one prompt position."""

    logprob: float
    rank: int | None = None  # None: the prompt's own token is outside the top k
    decoded_token: str


# One per prompt token, keyed by token id; the first is null (nothing precedes it).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(_Response):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(_Response):
    role: Literal["assistant"]
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for the first prompt token when echoed
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelStatus(_Response):
    value: Literal["loaded", "loading", "unloaded", "unloading", "failed"]
    reason: str | None = None  # why it failed


class ModelModalities(_Response):
    input: list[str]
    output: list[str]


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int  # when it was last loaded (0: never)
    owned_by: str
    root: str  # its file's or folder's name
    status: ModelStatus
    memory_bytes: int  # weights, KV pool and workspace: measured once loaded, estimated before
    memory_measured: bool
    modalities: ModelModalities
    in_flight: int  # HTTP requests using it now
    max_model_len: int | None = None  # while loaded


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int
    prompt: str


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: Literal["ok", "loading", "failed"]
    model_loaded: bool
    error: str | None = None


class StatsResponse(_Response):
    """The HTTP side's counters always; the engine's once the model is loaded."""

    status: str
    model: str
    total_requests: int
    in_flight_requests: int
    finished_requests: int
    client_disconnects: int
    failed_requests: int
    rejected_overloaded: int
    active_requests: int | None = None
    waiting_requests: int | None = None
    aborted_requests: int | None = None
    cache_usage: float | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    tokens_generated: int | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    max_model_len: int | None = None
    kv_used_bytes: int | None = None
    kv_total_bytes: int | None = None
    throughput: dict[str, dict[str, float]] | None = None  # tokens/s over the last 10 s and 60 s
    last_step: dict[str, Any] | None = None  # batch size, prefill and decode tokens, duration
    finished_by_reason: dict[str, int] | None = None
    recent_requests: list[dict[str, Any]] | None = None  # the last 100 finished, newest first: their timing records
    engine: dict[str, Any] | None = None
    prefix_cache: dict[str, Any] | None = None
    prefix_cache_tier: dict[str, Any] | None = None  # the second tier's figures, with --prefix-cache-dir or --prefix-cache-host-bytes


def error_responses(*statuses: int) -> dict:
    """`responses=` for a route: each status answers the error body."""
    return {s: {"model": ErrorResponse, "description": _STATUS_TEXT[s]} for s in statuses}


_STATUS_TEXT = {
    400: "The request is invalid; the message names the field",
    401: "A missing or wrong API key",
    403: "A refused Origin or Host",
    404: "No such model",
    413: "The body is larger than --max-request-bytes",
    500: "The server failed; details are in its log",
    503: "The model is loading, failed to load, or the server is overloaded (Retry-After)",
    507: "The model cannot fit the server's memory budget (--models-memory)",
}
