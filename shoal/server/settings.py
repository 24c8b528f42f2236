"""Server settings: one frozen dataclass, validated on construction, never mutated.

These are the HTTP side's knobs (address, access, limits) and the server-level
sampling defaults. Engine settings stay in `shoal.config.EngineConfig`.

Sampling defaults are `None` unless set: a `None` means "no opinion here", so
the next level down applies. The chain for every sampling field is

    request field > ServerSettings > the model's generation_config
        > its model card's (`shoal.model.loader.CARD_DEFAULTS`, only for models that ship none) > built-in default

(the lesson of seeds/002: a default of `False` or `1.0` at any level above the
bottom would silently hide every level below it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

from shoal.server.media import MediaPolicy
from shoal.types import SamplingParams

# Fields of ServerSettings that are server-level sampling defaults, named as in
# SamplingParams.
SAMPLING_DEFAULT_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json", "mistral", "pythonic")

# The automatic --max-request-bytes (see ServerSettings.request_byte_limit).
AUTO_REQUEST_BYTES_PER_TOKEN = 16
AUTO_REQUEST_BYTES_SLACK = 64 << 10
AUTO_REQUEST_BYTES_FLOOR = 1 << 20
AUTO_REQUEST_BYTES_IMAGES = 32 << 20  # base64 images in one body, for a model that takes them


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    ollama_port: int | None = None  # also listen here (Ollama's address, 11434), serving the same app
    api_key: str | None = field(default=None, repr=False)  # None: no authentication; never in logs
    # Browser origins allowed to call the server (CORS, and the Origin check: a
    # request whose Origin is present and not allowed is refused); "*" allows all.
    # Bound to loopback, the loopback origins are allowed too (see middleware.py).
    allowed_origins: tuple[str, ...] = ()
    # None: fit the model's context (`request_byte_limit`), so a body is refused
    # before it is parsed unless its text could fit max_model_len tokens.
    max_request_bytes: int | None = None
    max_waiting: int | None = None  # refuse new requests (503) while this many wait; None: no limit
    # Sequences one request may ask for: prompts x n.
    # One 2 KB body must not hold the server for minutes.
    max_sequences_per_request: int = 128
    # OpenAI's Responses API: the stored responses (server/responses/store.py); past either bound the least
    # recently used go first. Bytes are the records' JSON: a long agent session repeats its context every turn.
    responses_store_max: int = 1024
    responses_store_bytes: int = 64 << 20
    served_model_name: str | None = None  # default: the --model value
    chat_template: Path | None = None  # a Jinja file that replaces the model's template
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: split <think>...</think> out
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | pythonic; None: from the chat template
    # Anthropic: keep a system block starting with x-anthropic-billing-header (Claude Code's per-request
    # value at the front of the system prompt, dropped by default so turns hit the prefix cache).
    keep_billing_header: bool = False
    metrics_public: bool = False  # serve /metrics without the API key
    log_format: str = "text"  # text | json (one JSON object per line, for log shippers)
    log_requests: bool = True  # one INFO line per request
    # Images for vision models (server/media.py). data: URIs are always taken; http(s) URLs only from these
    # host names, and never from loopback, private or link-local addresses unless allowed; file: URLs only
    # under the local folder.
    allowed_media_domains: tuple[str, ...] = ()
    allow_private_media_addresses: bool = False
    allowed_local_media_path: Path | None = None
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 8192 * 8192
    max_images_per_request: int = 8
    media_fetch_timeout: float = 10.0
    # Server-level stopping defaults.
    ignore_eos: bool | None = None
    stop: tuple[str, ...] | None = None
    # Server-level sampling defaults (None: the model's, then the built-in).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.allowed_origins, str):
            object.__setattr__(self, "allowed_origins", (self.allowed_origins,))
        else:
            object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", Path(self.chat_template))
        if isinstance(self.allowed_media_domains, str):
            object.__setattr__(self, "allowed_media_domains", (self.allowed_media_domains,))
        object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains))
        if self.allowed_local_media_path is not None:
            object.__setattr__(self, "allowed_local_media_path", Path(self.allowed_local_media_path))
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)
        errors = []
        if not 0 <= self.port <= 65535:
            errors.append(f"port must be in [0, 65535], got {self.port}")
        if self.ollama_port is not None and not 1 <= self.ollama_port <= 65535:
            errors.append(f"ollama_port must be in [1, 65535], got {self.ollama_port}")
        elif self.ollama_port is not None and self.ollama_port == self.port:
            errors.append(f"ollama_port must differ from port ({self.port}): the app already listens there")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            errors.append(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.max_waiting is not None and self.max_waiting < 0:
            errors.append(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_sequences_per_request < 1:
            errors.append(f"max_sequences_per_request must be at least 1, got {self.max_sequences_per_request}")
        if self.responses_store_max < 1 or self.responses_store_bytes < 1:
            errors.append(f"responses_store_max and responses_store_bytes must be positive, got {self.responses_store_max} "
                          f"and {self.responses_store_bytes}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            errors.append(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            errors.append(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            errors.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        try:  # the server's sampling defaults must make valid SamplingParams on their own
            SamplingParams(**self.sampling_defaults)
        except ValueError as e:
            errors.append(f"invalid server sampling default: {e}")
        if self.chat_template is not None and not self.chat_template.is_file():
            errors.append(f"chat_template file {self.chat_template} does not exist")
        try:
            self.media_policy  # built once, and checked (the local media folder must exist)
        except ValueError as e:
            errors.append(str(e))
        if errors:
            raise ValueError("; ".join(errors))

    def request_byte_limit(self, max_model_len: int | None, images: bool = False) -> int:
        """The body size limit: max_request_bytes when set, else one that fits the context.

        Auto: 16 bytes per token of context (a token is about 4 characters;
        4 bytes each leaves room for non-ASCII text and JSON escapes), plus
        64 KiB for the rest of the request, and never under 1 MiB. SmolLM2's 8k context gets
        1 MiB; a 128k context gets 2 MiB + 64 KiB. Before a model is loaded
        (max_model_len None) the floor applies. Where a loaded model takes images (`images`), the body
        may also carry AUTO_REQUEST_BYTES_IMAGES of them in base64.
        """
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        text = max(AUTO_REQUEST_BYTES_FLOOR, AUTO_REQUEST_BYTES_PER_TOKEN * (max_model_len or 0) + AUTO_REQUEST_BYTES_SLACK)
        return text + (AUTO_REQUEST_BYTES_IMAGES if images else 0)

    @cached_property  # frozen: computed once, as every field it reads never changes
    def media_policy(self) -> MediaPolicy:
        """What image inputs may be fetched or read, and how large they may be."""
        return MediaPolicy(
            allowed_domains=self.allowed_media_domains,
            allow_private_addresses=self.allow_private_media_addresses,
            local_root=self.allowed_local_media_path,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_images=self.max_images_per_request,
            fetch_timeout_s=self.media_fetch_timeout,
        )

    @property
    def sampling_defaults(self) -> dict:
        """The server-level sampling defaults that are set."""
        return {k: getattr(self, k) for k in SAMPLING_DEFAULT_FIELDS if getattr(self, k) is not None}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
