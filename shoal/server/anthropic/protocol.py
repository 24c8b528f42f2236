"""Anthropic Messages API request bodies as pydantic models.

As in the OpenAI adapter: numbers are strict, unknown fields are ignored (clients send
many), and what needs the model or the conversation (block types, tool ids) is checked
by the adapter, which names the field. The current `anthropic` SDK (2.x) sends
`temperature`/`top_p`/`top_k` through `extra_body`; they arrive in the body either way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shoal.server.chat.params import INT64_MAX, INT64_MIN, Float, Int


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Message(_Request):
    # user and assistant; other conversational roles (Claude Code sends some) count as the user's
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Request):
    model: str | None = None
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Ollama's: how long the model stays loaded once idle (seconds or a duration like "10m"; 0 now; negative: always).
    keep_alive: int | float | str | None = None


class MessagesRequest(CountTokensRequest):
    model: str | None = None
    max_tokens: Int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
    # Extras in shoal's (and vLLM's) spelling, for clients that send them through extra_body.
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0)
    min_tokens: Int | None = Field(None, ge=0)
    ignore_eos: bool | None = None

    @property
    def stop(self) -> list[str] | None:
        """The common name the parameter chain reads (`chat/params.py`)."""
        return self.stop_sequences


# ---------------------------------------------------------------- responses (the OpenAPI contract)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Response):
    type: Literal["text", "thinking", "tool_use"]
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class Usage(_Response):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageResponse(_Response):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(_Response):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """Every refusal and failure on these routes, whatever the status."""

    type: Literal["error"]
    error: ErrorDetail
