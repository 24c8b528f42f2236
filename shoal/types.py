"""Plain data shared by every layer of shoal.

This module imports nothing of shoal's (and no torch), so the dependency arrows
only point down: cli -> server -> engine -> runner/model -> types.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# Below this temperature sampling is greedy (vLLM's rule): the draw is the argmax up to
# exact ties anyway, and logits / temperature could overflow float32.
MIN_SAMPLING_TEMPERATURE = 1e-5


class FinishReason(str, enum.Enum):
    STOP = "stop"
    """EOS, a stop token id or a stop string."""
    LENGTH = "length"
    """`max_tokens` or the context limit."""
    ABORT = "abort"
    """Client went away or abort() was called."""
    ERROR = "error"
    """This request alone failed; RequestOutput.error says why."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output: exactly one of the fields is set.

    Plain data (text, hashable): the engine compiles it into a grammar once and caches
    it by value (engine/structured.py), so equal constraints share one compilation.
    """

    json_schema: str | None = None
    """A JSON schema, serialized."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    """A regular expression the whole reply matches."""
    choice: tuple[str, ...] | None = None
    """Exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar, or llama.cpp's GBNF (`root ::= ...`)."""
    # How a JSON constraint (json_schema, json_object) is turned into a grammar:
    layout: str | None = None
    """`compact` (one line), `flexible` (the model's whitespace, bounded), or None: the server's default."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace allowed at each place in the JSON (vLLM's `whitespace_pattern`); overrides layout."""
    strict: bool = False
    """OpenAI's strict mode: no property the schema does not name, and every property required."""
    extra_properties: bool = False
    """Objects that do not say (no `additionalProperties`) may take extra properties, as JSON Schema reads them.
    By default they take none, as llama.cpp, xgrammar and Outlines have it."""

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"a structured output constraint needs exactly one of json_schema, json_object, regex, choice, grammar; got {set_ or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.layout not in (None, "compact", "flexible"):
            raise ValueError(f"layout must be compact or flexible, not {self.layout!r}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class ThinkingBudget:
    """Cap a reply's reasoning: after `max_tokens` tokens of it, the sequence is made to write
    `end_ids` (the model's `</think>`), and the answer follows. `start_ids` empty: the reply
    starts inside the reasoning (the template opened it); otherwise it starts when the model
    writes them. The tags are matched as token ids, so they should be tokens of their own
    (they are for the models that think this way: Qwen3, DeepSeek-R1)."""

    max_tokens: int
    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or not self.end_ids:
            raise ValueError("a thinking budget needs max_tokens >= 0 and the end tag's token ids")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction, never mutated.

    Defaults are the neutral values (no penalty, no truncation) so a field left
    alone changes nothing; the server layer fills request > server > model
    defaults before building one of these.
    """

    n: int = 1
    """Independent choices; they share the prompt's KV blocks."""
    max_tokens: int | None = 16
    """Tokens to generate at most; None: up to the context limit."""
    temperature: float = 1.0
    """Sampling temperature; 0 (or below MIN_SAMPLING_TEMPERATURE) is greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1: off)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this (1: off)."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one (0: off)."""
    typical_p: float = 1.0
    """Typical sampling, as in transformers (1: off)."""
    repetition_penalty: float = 1.0
    """HF/CTRL style, over prompt and output tokens."""
    presence_penalty: float = 0.0
    """OpenAI style, over output tokens."""
    frequency_penalty: float = 0.0
    """OpenAI style, over output tokens, growing with each repeat."""
    logit_bias: dict[int, float] | None = None
    """Added to these token ids' logits before sampling."""
    no_repeat_ngram_size: int = 0
    """Ban any n-gram of this size from appearing twice (0: off)."""
    seed: int | None = None
    """Per request: the same seed gives the same text alone, in a batch, or after preemption."""
    logprobs: int | None = None
    """Per generated token, the chosen token's logprob plus the top k (None: none)."""
    prompt_logprobs: int | None = None
    """Each prompt token's logprob plus the top k at its position (None: none)."""
    min_tokens: int = 0
    """No end of sequence (EOS, stop ids) before this many tokens."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    stop: tuple[str, ...] = ()
    """Stop strings; the text ends before them unless include_stop_str_in_output."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the choice, besides the model's EOS set."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    num_beams: int = 1
    """Beam search when above 1, returning the n best hypotheses."""
    length_penalty: float = 1.0
    """Beam search: scores are divided by length to this power, as in transformers."""
    early_stopping: bool = False
    """Beam search: stop once num_beams hypotheses are finished."""
    structured: StructuredOutput | None = None
    """Grammar-constrained decoding: every sampled token keeps the output inside this constraint, and the choice ends
    when the grammar is complete."""
    thinking_budget: ThinkingBudget | None = None
    """Reasoning capped at a number of tokens (Anthropic's thinking.budget_tokens); a `structured` constraint, when
    both are given, takes precedence."""

    def __post_init__(self) -> None:
        # Normalize the list-ish fields so equal params compare and hash equal.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k < 0:
            object.__setattr__(self, "top_k", 0)
        errors = self._errors()
        if errors:
            raise ValueError("; ".join(errors))

    def _errors(self) -> list[str]:
        e = []
        if self.n < 1:
            e.append(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            e.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # written so that NaN fails too
            e.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            e.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            e.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            e.append(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 0 < self.repetition_penalty < math.inf:
            e.append(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            e.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            e.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.no_repeat_ngram_size < 0:
            e.append(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            e.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            e.append(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        bad_bias = [v for v in (self.logit_bias or {}).values() if not math.isfinite(v)]
        if bad_bias:
            e.append(f"logit_bias values must be finite numbers, got {bad_bias[0]}")
        if not math.isfinite(self.length_penalty):
            e.append(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.min_tokens < 0:
            e.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            e.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.num_beams < 1:
            e.append(f"num_beams must be at least 1, got {self.num_beams}")
        if self.num_beams > 1 and self.n > self.num_beams:
            e.append(f"n ({self.n}) must not exceed num_beams ({self.num_beams})")
        return e

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's token history: penalties, n-gram bans, and min_tokens (EOS is banned
        while the output is shorter)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.no_repeat_ngram_size > 0 or self.min_tokens > 0)


POOLING_MODES = ("last", "mean", "cls", "score")


@dataclass(frozen=True)
class Pooling:
    """How a model turns a prompt's final hidden states (after the final norm) into one vector: what an embedding
    model's files say (sentence-transformers' modules, a GGUF's `pooling_type`), or `--embeddings`' default."""

    mode: str  # "last": the last token's hidden state; "mean": the mean over every prompt token; "cls": the first's (an encoder's)
    # "score": a cross-encoder's classifier logits on its input (a query and document pair), num_labels of them: it reranks
    normalize: bool  # L2-normalized (a sentence-transformers Normalize module; llama.cpp's default)
    hidden_size: int = 0  # the vector's full length
    # The lengths the model was trained to be cut to (Matryoshka), where its files list them; None: any up to hidden_size
    matryoshka_dimensions: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless `dimensions` (None: the whole vector) is a length this model's vectors may be cut to."""
        if dimensions is None:
            return
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be between 1 and the model's {self.hidden_size}, got {dimensions}")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"this model's vectors may be cut to {list(self.matryoshka_dimensions)} dimensions, not {dimensions}")


@dataclass(frozen=True)
class PoolingParams:
    """A prompt-only request's ask: its pooled hidden state instead of tokens (an embedding)."""

    mode: str = "last"  # POOLING_MODES
    normalize: bool = True  # L2-normalize the vector (after any truncation)
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka), then normalize again

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {self.mode!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


@dataclass(frozen=True)
class GenerationRequest:
    """What every protocol adapter turns a request into."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0  # lower runs first; ties are FIFO
    prompt: str | None = None  # the rendered text, for logs and echo only
    arrival_time: float | None = None
    images: tuple = ()  # multimodal.ImageSpan per image in the prompt, in order
    # Set: a prompt-only request for the prompt's pooled hidden state (RequestOutput.embedding); `params` unused.
    pooling: PoolingParams | None = None


class Logprob(NamedTuple):
    token_id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    top: list[Logprob]


@dataclass
class CompletionOutput:
    """One of the n choices of a request: cumulative, with the newest delta."""

    index: int
    """Which of the n choices this is."""
    text: str = ""
    """The text so far."""
    token_ids: list[int] = field(default_factory=list)
    """The generated token ids so far."""
    logprobs: list[TokenLogprobs] | None = None
    """Per generated token, with `SamplingParams.logprobs`: the chosen token's logprob and the top k."""
    finish_reason: FinishReason | None = None
    """Set once the choice is finished."""
    stop_reason: str | int | None = None
    """The stop string or token id that matched."""
    delta_text: str = ""
    """The text this step added."""
    delta_token_ids: list[int] = field(default_factory=list)
    """The token ids this step added."""
    cumulative_logprob: float = 0.0
    """The sum of the chosen tokens' logprobs."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step."""

    request_id: str
    """The id the request was given."""
    prompt_token_ids: Sequence[int]
    """The prompt as token ids: the request's own (a tuple), shared by every output of it, not copied each step."""
    outputs: list[CompletionOutput]
    """The n choices (or the n best beams)."""
    finished: bool
    """True once every choice is finished."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: RequestMetrics | None = None
    """The request's timing record (RequestMetrics), a copy."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """One entry per prompt token (the first None: nothing predicts it) when the params ask for prompt_logprobs; set
    on every output once complete (from the end of the prefill on), the same list each time."""
    error: str | None = None
    """Set, with finished=True and every choice's finish_reason ERROR, when this request alone failed: a message safe
    to show the client (the details are in the log)."""
    embedding: list[float] | None = None
    """A pooling request's vector (GenerationRequest.pooling), on its finished output."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class RequestMetrics:
    """One request's timings and counts, filled by the engine as it goes (times in seconds on the
    engine's clock, `time.monotonic` unless it was given another). Exporters only read them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Gaps between the steps that gave this request tokens, after the first.
    inter_token_latencies: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # from the prefix cache (or a fork's shared prompt)
    cache_hit_kind: str | None = None  # miss | extension | supersequence | divergence | tier (restored); None: no prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    finish_reason: str | None = None  # stop | length | abort | error, once finished
    client_disconnected: bool = False  # aborted because its consumer (the HTTP client) went away

    @property
    def queue_time(self) -> float | None:
        return _gap(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _gap(self.arrival_time, self.first_token_time)

    @property
    def prefill_time(self) -> float | None:
        return _gap(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _gap(self.first_token_time, self.last_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return _gap(self.arrival_time, self.finished_time)

    @property
    def time_per_output_token(self) -> float | None:
        d = self.decode_time
        return d / (self.generated_tokens - 1) if d is not None and self.generated_tokens > 1 else None

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens

    @property
    def prefill_tokens_per_s(self) -> float | None:
        t = self.prefill_time
        return self.computed_prompt_tokens / t if t else None

    @property
    def cached_fraction(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        """The record as plain JSON-able data, derived figures included."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("queue_time", "time_to_first_token", "prefill_time", "decode_time", "e2e_latency", "time_per_output_token",
                  "computed_prompt_tokens", "prefill_tokens_per_s", "cached_fraction"):
            d[k] = getattr(self, k)
        d["inter_token_latencies"] = list(self.inter_token_latencies)
        return d


def _gap(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


# ---------------------------------------------------------------- step plan


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute `token_ids` at `start_pos`..

    The sequence's KV for positions [0, start_pos) is already in the blocks of
    `block_table`; this step writes positions [start_pos, start_pos + len(token_ids)).
    `sample` is True when the last of these tokens is the sequence's newest
    known token, so its logits give the next token.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    # The first KV group's block table (KVGroup), the full-attention one where the model has it, from entry
    # `table_from` on: the runner keeps each sequence's tables from step to step and puts these in place of its
    # entries from there (runner/kept.py). 0: the whole table (always, for a seq_id below 0, which nothing keeps).
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    table_from: int = 0
    # The token history the sampler needs for penalties and bans (prompt, then output), from token `history_from`
    # on: the runner keeps the rest, as it keeps the tables.
    prompt_len: int = 0
    history: tuple[int, ...] = ()
    history_from: int = 0
    # Per-sequence generator seed and how many tokens this sequence has sampled,
    # so seeded sampling is the same alone or in a batch.
    seed: int | None = None
    num_sampled: int = 0
    # Prompt logprobs: the logits of positions prompt_logprobs_from .. + len(prompt_targets)
    # give the logprobs of `prompt_targets` (the prompt tokens that follow them) and the top
    # `prompt_logprobs` alternatives. Empty when the step has none to compute.
    prompt_logprobs: int = 0
    prompt_logprobs_from: int = 0
    prompt_targets: tuple[int, ...] = ()
    # Structured output: the tokens this row may sample (bit t of the little-endian
    # bytes: token t allowed), for a constrained sequence that samples; None: any.
    token_mask: bytes | None = None
    # Speculative decoding: the last len(draft) of token_ids are drafted tokens (engine/speculative.py), and
    # every one of the last len(draft) + 1 positions samples, as a decode there would; draft_masks[i] is the
    # grammar's mask of position i + 1 of those (empty: no grammar).
    draft: tuple[int, ...] = ()
    draft_masks: tuple[bytes | None, ...] = ()
    # The sequence's images (multimodal.ImageSpan), where it has any: the runner takes the embeddings of the
    # placeholders it computes from them, and a model with M-RoPE the positions of every token.
    images: tuple = ()
    # A pooling request's chunk (runner/pooling.py): "mean" on every chunk (each gives the sum of its rows), "last"
    # on the chunk that ends the prompt (its last row), "cls" on the one that starts it (its first row); "" for a
    # sequence that samples or pools nothing this step.
    pool: str = ""
    # The block tables of the model's other KV groups (KVGroup), in group order, each from its entry in
    # `group_from` on (as block_table); empty for a model with one group.
    group_tables: tuple[tuple[int, ...], ...] = ()
    group_from: tuple[int, ...] = ()
    # A decode run (engine/scheduler.py): this many one-token forwards back to back, each on the token the one before
    # it picked, at start_pos, start_pos + 1, ...; the blocks of every one of them are in the tables. The runner stops a
    # sequence's run early at a failed row or a token that ends it (an end-of-sequence id, params.stop_token_ids).
    steps: int = 1


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per sequence: those with the same sliding window (None: full attention),
    as vLLM's KV cache groups (FullAttentionSpec, SlidingWindowSpec). A windowed group keeps only the blocks a
    query can still see (engine/kv_manager.py), so its memory per sequence is bounded by its window."""

    window: int | None
    layers: tuple[int, ...]  # the model's layer indices, ascending


def kv_groups(windows) -> tuple[KVGroup, ...]:
    """Each layer's window (None: full) -> the KV groups: the full-attention group first, then the windows from
    the smallest. A model with one kind of layer has one group."""
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order)


@dataclass(frozen=True)
class StepPlan:
    """Everything the model runner needs for one forward pass. Plain data."""

    seqs: tuple[ScheduledSeq, ...]
    # (src, dst) copy-on-write before the forward, in the first KV group; (src, dst, group) in another one
    block_copies: tuple[tuple[int, ...], ...] = ()
    # Sequences that are gone (finished, aborted): the runners drop what they kept of them.
    finished: tuple[int, ...] = ()
    # The longest decode run of the plan's sequences (ScheduledSeq.steps).
    run_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SampledToken:
    """The runner's answer for one sequence with `sample=True` (one per verified position with a draft)."""

    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[Logprob, ...] = ()
    error: str | None = None  # no token: this sequence's sampling failed (a message safe to show)


class StepOutput(NamedTuple):
    """What one ModelRunner.execute returns."""

    sampled: list[SampledToken]
    # seq_id -> the prompt logprobs this step computed for it, in prompt order.
    prompt_logprobs: dict[int, list[TokenLogprobs]]
    # seq_id -> a pooling chunk's float32 part (ScheduledSeq.pool): its rows' sum ("mean") or its last row ("last").
    pooled: dict[int, list[float]] | None = None
