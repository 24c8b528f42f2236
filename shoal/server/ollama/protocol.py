"""Ollama API request bodies and responses as pydantic models (the OpenAPI contract).

Unlike the OpenAI and Anthropic adapters, unknown fields are refused (400 naming the field): Ollama's API is
small and fixed, and a misspelt option (`num_predicts`) would otherwise change nothing without a word. Options
Ollama defines that steer its own runner (threads, GPU layers, memory mapping) are accepted and have no effect
here; `mirostat` other than 0 is refused (shoal has no Mirostat sampler). Numbers are strict, as in every
protocol: a JSON boolean is not a number, and a boolean field takes only true or false.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from shoal.server.chat.params import INT64_MAX, INT64_MIN, Float, Int

# Ollama's options that tune its runner or a sampler shoal does not have: accepted, no effect (docs/guides/ollama.md).
IGNORED_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
                   "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n", "tfs_z", "mirostat_tau",
                   "mirostat_eta", "penalize_newline")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(_Request):
    """The sampling options shoal applies, and Ollama's runner options it accepts without effect."""

    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    typical_p: Float | None = Field(None, gt=0, le=1)
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    num_predict: Int | None = Field(None, ge=-2)  # -1: no limit, -2: fill the context (both: up to the context)
    stop: list[str] | None = None
    repeat_penalty: Float | None = Field(None, gt=0)
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    num_ctx: Int | None = Field(None, ge=1)  # above the served context: clamped to it
    mirostat: Int | None = Field(None, ge=0, le=0)  # 0 (off) only
    # Ollama's runner options: accepted, no effect here.
    numa: StrictBool | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    low_vram: StrictBool | None = None
    f16_kv: StrictBool | None = None
    logits_all: StrictBool | None = None
    vocab_only: StrictBool | None = None
    use_mmap: StrictBool | None = None
    use_mlock: StrictBool | None = None
    embedding_only: StrictBool | None = None
    num_thread: Int | None = None
    num_keep: Int | None = None
    repeat_last_n: Int | None = None
    tfs_z: Float | None = None
    mirostat_tau: Float | None = None
    mirostat_eta: Float | None = None
    penalize_newline: StrictBool | None = None


class ToolCallFunction(_Request):
    name: str = Field(..., min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # an object, as Ollama writes it (a JSON string taken too)
    index: Int | None = None


class ToolCall(_Request):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Message(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None  # base64, without a data: prefix
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool turn: the tool that answered
    tool_call_id: str | None = None  # LangChain's ChatOllama sends it


Think = StrictBool | Literal["high", "medium", "low"]
KeepAlive = Int | Float | str | None


class _Generation(_Request):
    model: str = Field(..., min_length=1)
    stream: StrictBool = True
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    options: Options | None = None
    keep_alive: KeepAlive = None
    think: Think | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    truncate: StrictBool | None = None  # Ollama's: a prompt over num_ctx is cut; here it is refused either way
    shift: StrictBool | None = None  # Ollama's context shift; shoal stops at the context instead


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generation):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Int] | None = None
    raw: StrictBool | None = None
    images: list[str] | None = None


class ShowRequest(_Request):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)  # older clients' spelling of model
    verbose: StrictBool | None = None


class EmbedRequest(_Request):
    model: str = Field(..., min_length=1)
    input: str | list[str] | None = None
    truncate: StrictBool | None = None  # Ollama's: an input over the context is cut (None, true) or refused (false)
    options: Options | None = None
    keep_alive: KeepAlive = None
    dimensions: Int | None = None


class EmbeddingsRequest(_Request):
    model: str = Field(..., min_length=1)
    prompt: str | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


# ---------------------------------------------------------------- responses (the OpenAPI contract)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class OutputToolCall(_Response):
    function: dict[str, Any]


class OutputMessage(_Response):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OutputToolCall] | None = None


class _Final(_Response):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = Field(None, description="stop or length (load or unload for a request without a prompt)")
    total_duration: int | None = Field(None, description="nanoseconds from the request's arrival to its end")
    load_duration: int | None = Field(None, description="nanoseconds spent getting the model loaded")
    prompt_eval_count: int | None = Field(None, description="prompt tokens")
    prompt_eval_duration: int | None = Field(None, description="nanoseconds to compute the prompt")
    eval_count: int | None = Field(None, description="generated tokens")
    eval_duration: int | None = Field(None, description="nanoseconds generating after the first token")


class ChatResponse(_Final):
    message: OutputMessage


class GenerateResponse(_Final):
    response: str
    thinking: str | None = None
    context: list[int] | None = None


class ModelDetails(_Response):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class ModelEntry(_Response):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(_Response):
    models: list[ModelEntry]


class ShowResponse(_Response):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(_Response):
    version: str


class EmbedResponse(_Response):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsResponse(_Response):
    embedding: list[float]


class ErrorResponse(BaseModel):
    """Every refusal and failure on these routes, whatever the status (a streamed answer ends with one as its last line)."""

    error: str
