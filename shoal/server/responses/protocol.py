"""OpenAI Responses API bodies as pydantic models: the request, and the response objects the routes declare in
the OpenAPI document (the HTTP reference is generated from it; the fuzzer checks answers against it).

As in the other adapters: numbers are strict, every optional field defaults to None ("the client did not
say"), unknown fields are ignored (clients send many), and what needs the conversation or the model (item
types, tool kinds, call ids) is checked by the adapter, which names the field. Fields OpenAI defines that a
local server cannot honour (`background`, `conversation`, `prompt`) are refused by the adapter, not ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.server.chat.params import INT64_MAX, INT64_MIN, Float, Int


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponsesRequest(_Request):
    model: str | None = None
    # A string (one user message), or a list of items: messages (input_text / input_image parts), function_call,
    # function_call_output and reasoning items. Checked by the adapter, which names the item.
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's
    stream: bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity"}
    reasoning: dict[str, Any] | None = None  # {"effort": "none" | "minimal" | "low" | "medium" | "high" | "xhigh", "summary"}
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # accepted; shoal has nothing more to include
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    # OpenAI's, which a local server cannot honour: refused by the adapter.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # Extras in shoal's (and vLLM's) spelling, for clients that send them through extra_body.
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    min_tokens: Int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    # Ollama's: how long the model stays loaded once idle (seconds or a duration like "10m"; 0 now; negative: always).
    keep_alive: int | float | str | None = None


# ---------------------------------------------------------------- responses (the OpenAPI contract)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class OutputText(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(_Response):
    type: Literal["reasoning_text"]
    text: str


class OutputItem(_Response):
    """A message (`content`: output_text parts), a function_call (`call_id`, `name`, `arguments` as JSON text) or
    a reasoning item (`content`: reasoning_text parts; `summary` is empty)."""

    id: str
    type: Literal["message", "function_call", "reasoning"]
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["assistant"] | None = None
    content: list[OutputText | ReasoningText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    summary: list[Any] | None = None


class InputTokensDetails(_Response):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class OutputTokensDetails(_Response):
    reasoning_tokens: int


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(_Response):
    code: str
    message: str


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool
    usage: ResponseUsage | None = None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"]
    user: str | None = None


class InputItemList(_Response):
    object: Literal["list"]
    data: list[dict[str, Any]]  # the response's input items, each with its id
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(_Response):
    id: str
    object: Literal["response"]
    deleted: Literal[True]
