"""The `shoal` command line.

    shoal serve [--model smollm2|PATH] [--host 127.0.0.1] [--port 8000] [--config shoal.yaml] ...
    shoal chat                      # multi-turn chat with a running server (/reset, /system TEXT, /quit)
    shoal complete "Once upon a time" --max-tokens 64
    shoal models
    shoal bench --base-url http://127.0.0.1:8000/v1 --workload random --concurrency 1 8 32 --out results.json
    shoal generate "The capital of France is" --max-tokens 32    # in-process, no server
    shoal repl                      # in-process chat, no server

`shoal serve --config FILE` reads YAML whose keys are the flags' names
(`max-model-len` or `max_model_len`); flags given on the command line win over
the file, the file over the built-in defaults.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

from shoal.config import (
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    STRICT_MKL,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    auto_bytes,
    auto_int,
    parse_bytes,
)
from shoal.types import GenerationRequest, SamplingParams

LOG_LEVELS = ["debug", "info", "warning", "error"]


# ---------------------------------------------------------------- options as data


@dataclass(frozen=True)
class Opt:
    """One option: its flag, and what it is in a YAML config (the flag without dashes)."""

    flag: str
    default: Any = None
    type: Any = None
    help: str = ""
    kind: str = "value"  # value | bool (BooleanOptionalAction) | flag (store_true) | list (repeatable)
    choices: tuple | None = None
    nargs: Any = None  # for kind value: argparse's nargs ("+", 2, ...)
    metavar: Any = None

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


ENGINE_OPTS = [
    Opt("--model", "smollm2", str, "'smollm2' (default), a .gguf file, or a Hugging Face model folder"),
    Opt("--mmproj", None, str, "a GGUF model's vision tower, as llama.cpp ships it (an mmproj .gguf; Qwen2-VL and "
        "Qwen2.5-VL). With several models it goes with the first; a `models:` entry may set its own"),
    Opt("--dtype", "auto", str, "weights and KV cache dtype (auto: bfloat16 where the device has native bf16 math, else float32)",
        choices=("auto", "float32", "bfloat16", "float16")),
    Opt("--quantization", "auto", str, "the weights' format: auto (default) serves each tensor of a GGUF in its file's "
        "own type (Q4_K, Q6_K, Q8_0...) on shoal's kernels, none dequantizes them; int8/int4 round any weights",
        choices=("auto", "none", "int8", "int4")),
    Opt("--device", "auto", str, "cpu, cuda or auto (default)"),
    Opt("--max-model-len", None, auto_int, "context length (default auto: the model's trained length, capped to what "
        "the KV pool holds for one sequence)"),
    Opt("--kv-cache-memory", "auto", str, "KV cache budget, e.g. 2GiB or 512MiB (default auto: what the machine has "
        "available after the weights, less a margin, and no more than --max-num-seqs sequences of the context use; "
        "on CUDA a fraction of the free memory)"),
    Opt("--kv-cache-dtype", "auto", str, "what the KV cache holds: auto (the activations' dtype), float32, bfloat16, "
        "float16, int8 (a scale per token and head: about half of bfloat16's bytes) or fp8 (CUDA)", choices=KV_CACHE_DTYPES),
    Opt("--encoder-cache-memory", "256MiB", str, "a vision model's image embeddings kept by content, so an image "
        "sent again (this conversation's next turn, or anyone's) is not encoded again"),
    Opt("--block-size", 16, int, "tokens per KV block"),
    Opt("--max-num-seqs", 64, int, "most sequences in one step"),
    Opt("--max-num-batched-tokens", 512, int, "most tokens in one step (prefill chunk size)"),
    Opt("--max-prefill-beside-decodes", None, int, "in a step that also decodes, prefill chunks together cost at most "
        "what this many tokens at the start of a prompt cost (late chunks are shorter; default: "
        "--max-num-batched-tokens); lower keeps streams smoother while a long prompt prefills, and makes that "
        "prompt's first token later"),
    Opt("--decode-run-ms", 25.0, float, "a step in which every sequence decodes and none waits runs each one's next "
        "tokens back to back, as many forwards as fit in about this long (at most 8; the same tokens), so the engine's "
        "own work runs once for them (an arrival or an abort ends a run after its current forward); 0: a token a step"),
    Opt("--follow-up-window-ms", 20.0, float, "after a step that finished several requests and left the engine idle, "
        "hold the next arrival up to this long for as many (clients in lockstep share one prefill step); 0: off"),
    Opt("--threads", None, int, "torch threads (default: torch's choice)"),
    Opt("--prefix-cache", True, None, "reuse the KV of earlier prompts (default: on)", kind="bool"),
    Opt("--prefix-cache-ttl", None, float, "drop cached prefixes idle this many seconds (default: only when space is needed)"),
    Opt("--prefix-cache-dir", None, str, "keep the prefixes the KV pool evicts in this directory, and restore them "
        "instead of recomputing; it survives restarts (one server per directory; docs/guides/kv-cache.md)"),
    Opt("--prefix-cache-disk-bytes", "8GiB", str, "most bytes --prefix-cache-dir holds, e.g. 20GiB"),
    Opt("--prefix-cache-host-bytes", "0", str, "keep evicted prefixes in host RAM instead, up to this many bytes "
        "(for a KV cache on a GPU; 0: off)"),
    Opt("--prefix-cache-restore", "auto", str, "restore blocks from the tier when the read and prefill rates measured on "
        "this host say it is cheaper than computing them (auto), always, or never (the tier only keeps them)",
        choices=("auto", "always", "never")),
    Opt("--deterministic", False, None, "batch-invariant decoding with any weights: a greedy or seeded answer does not "
        "change with the load, chunking or prefix-cache hits (the default already is, with a GGUF's 4-bit weights; "
        "with float weights it costs 8-20%% of the speed; docs/guides/determinism.md)", kind="flag"),
    Opt("--attention", "auto", str, "attention backend: auto (batch-invariant with int8/int4 weights, sdpa with float "
        "ones), invariant, or sdpa (fastest; answers may change with the load)", choices=("auto", "invariant", "sdpa")),
    Opt("--embeddings", False, None, "serve /v1/embeddings from a generation model too: last-token pooling, "
        "L2-normalized (an embedding model's own pooling files need no flag; docs/guides/embeddings.md)", kind="flag"),
    Opt("--speculative", "auto", str, "speculative decoding: drafts verified by exact match, so no answer changes "
        "(docs/guides/speculative-decoding.md). auto: on with the batch-invariant attention (a draft model if "
        "--speculative-model is given, else n-gram prompt lookup); ngram; draft; off", choices=SPECULATIVE_METHODS),
    Opt("--speculative-model", None, str, "the draft model: a .gguf or a model folder with the target's tokenizer"),
    Opt("--speculative-tokens", 8, int, "the longest draft a sequence verifies in one step (the length adapts up to it)"),
    Opt("--speculative-max-batch", 8, int, "no drafts in a step with more decoding sequences than this (there the step "
        "is compute-bound and drafts cost what they save)"),
    Opt("--speculative-ngram-min", 2, int, "n-gram prompt lookup: the shortest n-gram matched"),
    Opt("--speculative-ngram-max", 4, int, "n-gram prompt lookup: the longest n-gram matched (tried first)"),
]

# The speculative options' keys and the SpeculativeConfig fields they set (their defaults are the config's).
SPECULATIVE_FIELDS = {"speculative": "method", "speculative_model": "model", "speculative_tokens": "num_tokens",
                      "speculative_max_batch": "max_batch", "speculative_ngram_min": "ngram_min",
                      "speculative_ngram_max": "ngram_max"}

# Scale-out (docs/guides/scale-out.md): the model over several processes. `shoal worker` takes these too.
PARALLEL_OPTS = [
    Opt("--tensor-parallel-size", 1, int, "split every layer's heads and MLP columns over this many processes "
        "(on one machine shoal starts them itself; with --nnodes they are spread over machines)"),
    Opt("--pipeline-parallel-size", 1, int, "split the model's layers into this many contiguous stages, one process "
        "each (or --tensor-parallel-size processes each)"),
    Opt("--pp-layers", None, str, "layers per pipeline stage, e.g. 10,10,10 (default: as even as possible)"),
    Opt("--pp-wire-dtype", "float32", str, "hidden states between pipeline stages: float32, bfloat16, float16 or int8 "
        "(a scale per token); the last stage's output to the logits is never compressed",
        choices=("float32", "bfloat16", "float16", "int8")),
    Opt("--nnodes", 1, int, "machines taking part; the others run `shoal worker`"),
    Opt("--node-rank", 0, int, "this machine's place among them (serve: 0)"),
    Opt("--master-addr", "127.0.0.1", str, "where rank 0 (the serving machine) is reached by the others"),
    Opt("--master-port", 0, int, "rank 0's rendezvous port (default: a free one; needed with --nnodes > 1)"),
    Opt("--restart-workers", False, None, "when a rank is lost, start the ranks again (and on other machines, "
        "`shoal worker --restart-workers` rejoins) and resume serving, instead of answering 503 until a restart", kind="flag"),
    Opt("--heartbeat-timeout", 5.0, float, "seconds without a heartbeat from a rank before rank 0 takes it for hung "
        "(stopped, stuck or cut off) and ends the steps waiting on it"),
]

SERVER_OPTS = [
    Opt("--host", "127.0.0.1", str, "address to bind (default 127.0.0.1: this machine only)"),
    Opt("--port", 8000, int, "port to listen on"),
    Opt("--ollama-port", None, int, "also listen on this port (Ollama's is 11434), for apps that assume Ollama's address: "
        "the same routes and checks as --port (docs/guides/ollama.md)"),
    Opt("--api-key", None, str, "require this key (Authorization: Bearer KEY or x-api-key); default $SHOAL_API_KEY"),
    Opt("--allowed-origins", [], str, "browser origin allowed to call the server, with CORS (repeatable, or "
        "comma-separated; '*' allows all). Requests from other origins are refused (403); bound to loopback, "
        "http(s)://localhost|127.0.0.1|[::1] with any port are allowed too", kind="list"),
    Opt("--max-request-bytes", "auto", str, "refuse request bodies over this size (413); auto (default): "
        "16 bytes per token of the model's context + 64KiB, at least 1MiB"),
    Opt("--max-waiting", None, int, "refuse new requests (503) while this many are waiting"),
    Opt("--max-sequences-per-request", 128, int, "most sequences one request may ask for: prompts x n "
        "(400 beyond)"),
    Opt("--responses-store-max", 1024, int, "Responses API: most stored responses; the least recently used go first "
        "(docs/guides/responses.md)"),
    Opt("--responses-store-bytes", "64MiB", str, "Responses API: most bytes of stored responses, counted as their JSON"),
    Opt("--served-model-name", None, str, "the model's name in the API (default: the --model value)"),
    Opt("--chat-template", None, str, "a Jinja chat template file that replaces the model's"),
    Opt("--reasoning-parser", None, str, "split <think>...</think> into reasoning_content", choices=("deepseek_r1", "qwen3")),
    Opt("--tool-call-parser", None, str, "how the model writes tool calls (default: picked from the chat template)",
        choices=("hermes", "qwen", "llama3_json", "mistral", "pythonic")),
    Opt("--metrics-public", False, None, "serve /metrics without the API key (for a scraper)", kind="flag"),
    Opt("--log-format", "text", str, "log lines as text or as one JSON object each (for log shippers)", choices=("text", "json")),
    Opt("--keep-billing-header", False, None, "Anthropic API: keep x-anthropic-billing-header system blocks "
        "(dropped by default: they change every request and defeat the prefix cache)", kind="flag"),
    Opt("--ignore-eos", False, None, "server default: keep generating past EOS", kind="flag"),
    Opt("--log-requests", True, None, "one log line per request (default: on)", kind="bool"),
    # Images for vision models (docs/guides/vision.md): data: URIs always; URLs and files only where allowed.
    Opt("--allowed-media-domains", [], str, "fetch image URLs (http, https) from these host names (repeatable, or "
        "comma-separated; *.example.com takes subdomains). Default: none, so image URLs are refused", kind="list"),
    Opt("--allow-private-media-addresses", False, None, "let image URLs reach loopback, private and link-local "
        "addresses (refused by default, whatever the domain list says)", kind="flag"),
    Opt("--allowed-local-media-path", None, str, "read file: image URLs under this folder (default: none)"),
    Opt("--max-image-bytes", "10MiB", str, "largest image file, fetched or sent"),
    Opt("--max-image-pixels", 8192 * 8192, int, "most pixels of one image, read from its header before decoding"),
    Opt("--max-images-per-request", 8, int, "most images in one request"),
    Opt("--media-fetch-timeout", 10.0, float, "seconds one image URL may take, redirects and body included"),
]

# Several models in one server (docs/guides/several-models.md). The YAML config may also list `models:`.
MODELS_OPTS = [
    Opt("--models-dir", None, str, "offer every .gguf file and Hugging Face model folder in this directory too, "
        "named by file stem or folder name"),
    Opt("--models-autoload", True, None, "load a model on its first request (default: on; off: only POST /v1/models "
        "loads)", kind="bool"),
    Opt("--preload", "default", str, "models loaded at start: the default (first) one, all, or none",
        choices=("default", "all", "none")),
    Opt("--models-memory", "auto", str, "memory all loaded models may take (weights, KV pool, workspace), e.g. "
        "12GiB; the least recently used idle ones unload to make room. auto: 80%% of this machine's RAM; none: no budget"),
    Opt("--models-max", None, int, "most models loaded at once (the least recently used idle one unloads)"),
    Opt("--keep-alive", "5m", str, "unload a model idle this long: seconds or a duration (30s, 10m, 1h); 0: as soon as "
        "it is idle; -1: never. A request's keep_alive wins for its model"),
    Opt("--default-model-fallback", False, None, "a request naming a model this server does not offer goes to the "
        "default model instead of a 404", kind="flag"),
    Opt("--model-load-timeout", 120.0, float, "longest a request waits for its model to load before a 503 with Retry-After"),
    Opt("--model-drain-timeout", 30.0, float, "longest an unload waits for the model's requests in flight before it "
        "ends them with a 503"),
    Opt("--models-step-turns", False, None, "loaded models take turns at stepping, one step at a time (default: they "
        "step at the same time, which gave more tokens on the CPUs measured; turns suit models whose steps already "
        "keep every core busy)", kind="flag"),
]
# Per model in the YAML config's `models:` list, besides the engine options: what replaces the server's.
MODEL_ENTRY_KEYS = ("alias", "keep_alive", "chat_template", "reasoning_parser", "tool_call_parser")

@dataclass(frozen=True)
class SamplingFlag:
    """A sampling option, declared once for every command that takes it (sampling_opts)."""

    flag: str
    type: Any
    help: str
    local: Any  # the in-process commands' default
    server: bool = True  # also a server-wide default (`serve`)
    kind: str = "value"


SAMPLING_FLAGS = [
    SamplingFlag("--max-tokens", int, "most tokens per answer", 256),
    SamplingFlag("--temperature", float, "temperature", 0.7),
    SamplingFlag("--top-p", float, "top_p", 1.0),
    SamplingFlag("--top-k", int, "top_k", 0),
    SamplingFlag("--min-p", float, "min_p", 0.0),
    SamplingFlag("--repetition-penalty", float, "repetition_penalty", 1.0),
    SamplingFlag("--presence-penalty", float, "presence_penalty", 0.0),
    SamplingFlag("--frequency-penalty", float, "frequency_penalty", 0.0),
    SamplingFlag("--seed", int, "seed", None, server=False),
    SamplingFlag("--stop", str, "stop string (repeatable)", [], kind="list"),
]


def sampling_opts(role: str) -> list[Opt]:
    """The sampling flags as one command takes them. server (`serve`): server-wide defaults, unset unless given, so
    that the model's own apply; client (`chat`, `complete`): sent only when given, so the server's apply; local
    (`generate`, `repl`, in-process): with their own defaults."""
    if role == "server":
        return [Opt(f.flag, [] if f.kind == "list" else None, f.type, f"server default {f.help}", kind=f.kind) for f in SAMPLING_FLAGS if f.server]
    if role == "client":
        return [Opt(f.flag, None, f.type, f"{f.help} (default: the server's)", kind=f.kind) for f in SAMPLING_FLAGS]
    return [Opt(f.flag, f.local, f.type, f.help, kind=f.kind) for f in SAMPLING_FLAGS]


SERVER_SAMPLING_OPTS = sampling_opts("server")
LOCAL_SAMPLING_OPTS = sampling_opts("local")
CLIENT_SAMPLING_OPTS = sampling_opts("client")


# For `shoal bench` (a load generator for any OpenAI-compatible server).
BENCH_OPTS = [
    Opt("--base-url", os.environ.get("SHOAL_URL", "http://127.0.0.1:8000").rstrip("/").removesuffix("/v1") + "/v1", str,
        "the server's OpenAI API root (default $SHOAL_URL/v1 or http://127.0.0.1:8000/v1)"),
    Opt("--api-key", None, str, "API key (default $SHOAL_API_KEY or $OPENAI_API_KEY)"),
    Opt("--model", None, str, "model name (default: the server's first)"),
    Opt("--workload", "random", str, "what to send", choices=("random", "chat", "agentic", "file")),
    Opt("--file", None, str, "JSONL for --workload file: one {\"prompt\": ...} or {\"messages\": [...]} per line"),
    Opt("--concurrency", [1], int, "requests in flight; several levels make several runs", nargs="+", metavar="N"),
    Opt("--request-rate", None, float, "Poisson arrivals at this many requests/s instead of --concurrency"),
    Opt("--num-requests", 32, int, "requests per run"),
    Opt("--seed", 0, int, "seed of the prompts, lengths and arrivals"),
    Opt("--max-tokens", 128, int, "max_tokens of the chat, agentic and file workloads"),
    Opt("--input-len", [128, 128], int, "random workload: prompt length range in tokens (about one word each)", nargs=2, metavar=("MIN", "MAX")),
    Opt("--output-len", [128, 128], int, "random workload: output length range (exact: ignore_eos)", nargs=2, metavar=("MIN", "MAX")),
    Opt("--turns", 4, int, "agentic workload: turns per conversation"),
    Opt("--endpoint", "chat", str, "chat (/chat/completions) or completions (/completions, prompts only)", choices=("chat", "completions")),
    Opt("--temperature", None, float, "sent when given"),
    Opt("--extra-body", None, str, "JSON object merged into every request body (a null value removes that field)"),
    Opt("--timeout", 600.0, float, "seconds before a request counts as failed"),
    Opt("--progress", True, None, "progress bar on stderr (default: on)", kind="bool"),
    Opt("--out", None, str, "write the results (runs, per-request records, machine, args) as JSON here"),
]


def _add_opts(group, opts: list[Opt], suppress: bool) -> None:
    for o in opts:
        default = argparse.SUPPRESS if suppress else o.default
        help = o.help
        if o.default not in (None, [], False) and "default" not in help:
            help = f"{help} (default {o.default})".lstrip()
        if o.kind == "bool":
            group.add_argument(o.flag, dest=o.key, action=argparse.BooleanOptionalAction, default=default, help=help)
        elif o.kind == "flag":
            group.add_argument(o.flag, dest=o.key, action="store_true", default=default, help=help)
        elif o.kind == "list":
            group.add_argument(o.flag, dest=o.key, action="append", type=o.type, default=default, help=help, metavar=o.key.upper())
        else:
            extra = {k: getattr(o, k) for k in ("nargs", "metavar") if getattr(o, k) is not None}
            group.add_argument(o.flag, dest=o.key, type=o.type, default=default, choices=o.choices, help=help, **extra)


def _defaults(opts: list[Opt]) -> dict:
    return {o.key: (list(o.default) if isinstance(o.default, list) else o.default) for o in opts}


# ---------------------------------------------------------------- building configs


def engine_config(a: argparse.Namespace | dict) -> EngineConfig:
    v = vars(a) if isinstance(a, argparse.Namespace) else a
    cache = dict(
        block_size=v["block_size"],
        kv_cache_memory=auto_bytes(v["kv_cache_memory"]),
        kv_cache_dtype=v.get("kv_cache_dtype", "auto"),
        enable_prefix_cache=bool(v.get("prefix_cache", True)),
        prefix_cache_ttl=v.get("prefix_cache_ttl"),
        prefix_cache_dir=v.get("prefix_cache_dir"),
        prefix_cache_disk_bytes=parse_bytes(v.get("prefix_cache_disk_bytes", "8GiB")),
        prefix_cache_host_bytes=parse_bytes(v.get("prefix_cache_host_bytes", 0)),
        prefix_cache_restore=v.get("prefix_cache_restore", "auto"),
        encoder_cache_memory=parse_bytes(v.get("encoder_cache_memory", "256MiB")),
    )
    return EngineConfig(
        model=str(v["model"]),
        mmproj=v.get("mmproj"),
        dtype=v["dtype"],
        device=v["device"],
        max_model_len=None if v["max_model_len"] is None else auto_int(v["max_model_len"]),
        num_threads=v["threads"],
        quantization=v.get("quantization"),
        attention="invariant" if v.get("deterministic") else v.get("attention", "auto"),
        embeddings=bool(v.get("embeddings", False)),
        scheduler=SchedulerConfig(max_num_seqs=v["max_num_seqs"], max_num_batched_tokens=v["max_num_batched_tokens"],
                                  max_prefill_beside_decodes=v["max_prefill_beside_decodes"],
                                  follow_up_window=v["follow_up_window_ms"] / 1000, decode_run_ms=v["decode_run_ms"]),
        cache=CacheConfig(**cache),
        parallel=ParallelConfig(**{o.key: v.get(o.key, o.default) for o in PARALLEL_OPTS}),
        speculative=SpeculativeConfig(**{field: v[key] for key, field in SPECULATIVE_FIELDS.items() if key in v}),
    )


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """The in-process commands' sampling (LOCAL_SAMPLING_OPTS)."""
    v = {o.key: getattr(a, o.key) for o in LOCAL_SAMPLING_OPTS}
    return SamplingParams(**{**v, "stop": tuple(v["stop"])})


# serve takes --model several times (every one is offered; the first is the default).
SERVE_ENGINE_OPTS = [Opt("--model", None, str, "'smollm2' (the default), a .gguf file, or a Hugging Face model folder; "
                         "give it several times to offer several models (the first is the default)", kind="list"),
                     *ENGINE_OPTS[1:]]
SERVE_OPTS = SERVE_ENGINE_OPTS + PARALLEL_OPTS + SERVER_OPTS + MODELS_OPTS + SERVER_SAMPLING_OPTS
CONFIG_ONLY_KEYS = ("log_level", "models")


def load_config_file(path: str | Path) -> dict:
    """A YAML config as {option key: value}; keys are the flags' names, with - or _.

    config_file_models checks the values; the first error becomes one line naming the key, as the file writes it, and
    the file.
    """
    import yaml
    from pydantic import ValidationError

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must be a mapping of option: value")
    written: dict[tuple, Any] = {}
    try:
        return config_file_models()[0].model_validate(_keyed(data, written)).model_dump(exclude_unset=True)
    except ValidationError as e:
        raise ValueError(_config_error(e, written, path)) from None


def _keyed(mapping: dict, written: dict, at: tuple = ()) -> dict:
    """`mapping` (the file's, or a `models:` entry's) with the options' keys: dashes become underscores.
    written[at + (key,)] keeps each key as the file wrote it, in the file's order, for the error messages."""
    out = {}
    for raw_key, value in mapping.items():
        key = str(raw_key).replace("-", "_")
        written[(*at, key)] = raw_key
        if not at and key == "models" and isinstance(value, list):
            value = [_keyed(e, written, ("models", i)) if isinstance(e, dict) else e for i, e in enumerate(value)]
        out[key] = value
    return out


# The file's log-level; build_parser declares the flag per command, each with its own help.
LOG_LEVEL_OPT = Opt("--log-level", "info", str, choices=tuple(LOG_LEVELS))
# The engine options and MODEL_ENTRY_KEYS: what a `models:` entry may set.
MODEL_ENTRY_OPTS = ENGINE_OPTS + PARALLEL_OPTS + [o for o in SERVER_OPTS if o.key in MODEL_ENTRY_KEYS]


@functools.cache
def config_file_models() -> tuple[type, type]:
    """The pydantic models of a `serve --config` file and of its `models:` entries, built from the options above: a
    field per option, so each key's type, choices and default are declared once, for the flag and the file. Unknown
    keys are refused."""
    from pydantic import ConfigDict, Field, create_model

    # A number given to a string option (`prefix-cache-host-bytes: 0`) is its text, as on the command line; options
    # named model_* do not clash with pydantic's own methods.
    config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, protected_namespaces=())
    entry = create_model("ModelEntry", __config__=config,
                         **{o.key: (_config_type(o), ... if o.key == "model" else None) for o in MODEL_ENTRY_OPTS},
                         alias=(Any, None), keep_alive=(Any, None))  # read by spec_for and parse_keep_alive
    file = create_model("ConfigFile", __config__=config,
                        **{o.key: (_config_type(o), None) for o in [*SERVE_OPTS, LOG_LEVEL_OPT]},
                        models=(Annotated[list[entry], Field(min_length=1)], None))
    return file, entry


def _config_type(opt: Opt):
    """What `opt` takes in the file: what its flag's type and choices take, as a list where the flag repeats
    (one value is a list of one), and null only where the default is None."""
    from typing import Literal

    from pydantic import BeforeValidator, PlainValidator, StrictBool

    if opt.kind in ("bool", "flag"):
        t = StrictBool  # YAML's true and false, not "yes" or 1
    else:
        if opt.choices is not None:
            t = Literal[opt.choices]
        elif opt.type in (int, float):
            t = Annotated[opt.type, BeforeValidator(_not_bool)]
        elif opt.type is str:
            t = str
        else:  # a parsing function (auto_int): called on the text, as argparse calls it
            t = Annotated[Any, PlainValidator(lambda v, parse=opt.type: parse(str(_not_bool(v))))]
        if opt.kind == "list" or opt.nargs is not None:
            t = Annotated[list[t], BeforeValidator(lambda v: [] if v is None else v if isinstance(v, list) else [v])]
    return Optional[t] if opt.default is None else t


def _not_bool(value):
    """pydantic's lax int and float take true as 1; the flag takes no true."""
    if isinstance(value, bool):
        raise ValueError("a boolean")
    return value


def _config_error(e, written: dict, path: Path) -> str:
    """The config file's first error (pydantic's, in the file's order) as one line naming the key and the file."""
    order = {loc: i for i, loc in enumerate(written)}

    def key_of(loc: tuple) -> tuple:  # (key,) or ("models", i, key); item indices of list options dropped
        return loc[:3] if loc[0] == "models" and len(loc) > 1 else loc[:1]

    err = min(e.errors(), key=lambda x: order.get(key_of(x["loc"]), order.get(x["loc"][:1], len(order))))
    loc, value, kind = err["loc"], err.get("input"), err["type"]
    key = key_of(loc)
    entry = len(key) > 1  # in a `models:` entry
    where = f"models[{loc[1]}] in {path}" if entry else str(path)
    if loc == ("models",):
        return f"'models' in {path} must be a list of mappings, each with at least `model`"
    if entry and (len(loc) == 2 or kind == "missing"):
        return f"{where} must be a mapping with at least `model`"
    name = written.get(key, key[-1])
    if kind == "extra_forbidden":
        fields = config_file_models()[entry].model_fields
        return f"unknown key {name!r} in {where} (known: {', '.join(sorted(k.replace('_', '-') for k in fields))})"
    opt = {o.key: o for o in (MODEL_ENTRY_OPTS if entry else [*SERVE_OPTS, LOG_LEVEL_OPT])}[key[-1]]
    what = f"{name!r} {'of' if entry else 'in'} {where}"
    if opt.kind in ("bool", "flag"):
        return f"{what} must be true or false, not {value!r}"
    if loc == key and isinstance(value, list) and opt.kind != "list" and opt.nargs is None:
        return f"{what} takes one value, not a list"
    if kind == "literal_error":
        return f"{what} must be one of {', '.join(map(str, opt.choices))}, not {value!r}"
    return f"{what}: {value!r} is not a valid {getattr(opt.type, '__name__', 'value')}"


def model_specs(v: dict) -> list:
    """Every model `serve` offers: `models:` entries, then --model values, then --models-dir's; the first is the
    default. The served name of the first is --served-model-name when given."""
    from shoal.server.models import MODEL_SERVER_FIELDS, parse_keep_alive, spec_for, specs_in_dir

    models = v.get("model") or []
    models = [models] if isinstance(models, str) else list(models)
    entries = list(v.get("models") or []) + [{"model": m} for m in models]
    if not entries and not v.get("models_dir"):
        entries = [{"model": "smollm2"}]
    specs = []
    for i, entry in enumerate(entries):
        own = {k: x for k, x in entry.items() if k not in MODEL_ENTRY_KEYS}
        config = engine_config({**v, **({} if i == 0 else {"mmproj": None}), **own})  # --mmproj: the first model's
        overrides = {k: entry[k] for k in MODEL_SERVER_FIELDS if k in entry}
        keep = entry.get("keep_alive")
        name = entry.get("alias") or (v.get("served_model_name") if i == 0 else None)
        specs.append(spec_for(config, name, overrides=overrides,
                              keep_alive=None if keep is None else parse_keep_alive(keep, f"keep_alive of model {config.model}")))
    if v.get("models_dir"):
        taken = {n for s in specs for n in (s.name, *s.aliases)}
        specs += [s for s in specs_in_dir(v["models_dir"], engine_config({**v, "model": "smollm2"})) if s.name not in taken]
    return specs


def lifecycle(v: dict):
    """The Lifecycle of the serve options (MODELS_OPTS)."""
    from shoal.server.models import Lifecycle, parse_keep_alive

    memory = v.get("models_memory", "auto")
    if memory in (None, "none"):
        budget = None
    elif memory == "auto":
        budget = int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        budget = parse_bytes(memory)
    return Lifecycle(
        autoload=bool(v.get("models_autoload", True)), preload=v.get("preload", "default"), memory=budget,
        max_loaded=v.get("models_max"), keep_alive=parse_keep_alive(v.get("keep_alive", "5m"), "--keep-alive"),
        default_fallback=bool(v.get("default_model_fallback")), load_timeout=float(v.get("model_load_timeout", 120.0)),
        drain_timeout=float(v.get("model_drain_timeout", 30.0)), step_turns=bool(v.get("models_step_turns")),
    )


def serve_values(a: argparse.Namespace) -> dict:
    """Defaults < $SHOAL_API_KEY < the --config file < flags given on the command line."""
    values = _defaults(SERVE_OPTS)
    values["log_level"] = "info"
    if os.environ.get("SHOAL_API_KEY"):
        values["api_key"] = os.environ["SHOAL_API_KEY"]
    given = {k: v for k, v in vars(a).items() if k not in ("func", "command", "config")}
    if getattr(a, "config", None):
        values.update(load_config_file(a.config))
    values.update(given)
    return values


def exposure_warning(settings) -> str | None:
    """What to say when the server listens beyond this machine with no key."""
    from shoal.server.middleware import is_loopback_host

    if settings.api_key or is_loopback_host(settings.host):
        return None
    return (f"listening on {settings.host} without --api-key: anyone who can reach this address can use the server "
            "(docs/guides/security.md)")


def server_settings(v: dict):
    from shoal.server.settings import ServerSettings

    origins = [o.strip() for item in (v["allowed_origins"] or []) for o in str(item).split(",") if o.strip()]
    return ServerSettings(
        host=v["host"],
        port=int(v["port"]),
        ollama_port=int(v["ollama_port"]) if v.get("ollama_port") is not None else None,
        api_key=v["api_key"] or None,
        allowed_origins=tuple(origins),
        max_request_bytes=None if v["max_request_bytes"] in (None, "auto") else parse_bytes(v["max_request_bytes"]),
        max_waiting=v["max_waiting"],
        max_sequences_per_request=int(v["max_sequences_per_request"]),
        responses_store_max=int(v["responses_store_max"]),
        responses_store_bytes=parse_bytes(v["responses_store_bytes"]),
        served_model_name=v["served_model_name"],
        chat_template=v["chat_template"],
        reasoning_parser=v["reasoning_parser"],
        tool_call_parser=v["tool_call_parser"],
        keep_billing_header=bool(v["keep_billing_header"]),
        metrics_public=bool(v["metrics_public"]),
        log_format=v["log_format"],
        log_requests=bool(v["log_requests"]),
        ignore_eos=bool(v["ignore_eos"]) if v["ignore_eos"] else None,
        allowed_media_domains=tuple(d.strip() for item in (v["allowed_media_domains"] or []) for d in str(item).split(",") if d.strip()),
        allow_private_media_addresses=bool(v["allow_private_media_addresses"]),
        allowed_local_media_path=v["allowed_local_media_path"],
        max_image_bytes=parse_bytes(v["max_image_bytes"]),
        max_image_pixels=int(v["max_image_pixels"]),
        max_images_per_request=int(v["max_images_per_request"]),
        media_fetch_timeout=float(v["media_fetch_timeout"]),
        **{o.key: v[o.key] for o in SERVER_SAMPLING_OPTS if o.key != "stop"},
        stop=tuple(v["stop"]) if v["stop"] else None,
    )


# ---------------------------------------------------------------- serve


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from shoal.model.loader import resolve_model_path
    from shoal.server import create_app
    from shoal.server.listen import listening_socket

    v = serve_values(a)
    strict_mkl_if(bool(v.get("deterministic")))  # given in the YAML config too; nothing has computed yet
    _setup_logging(v["log_level"], v["log_format"])
    if _torchrun_rank() is not None:
        v.update(_torchrun_parallel())
        if _torchrun_rank() != 0:  # every torchrun process runs `shoal serve`: the others compute only
            return _run_worker_rank(None, {**v, "model": model_specs(v)[0].config.model})
    specs = model_specs(v)
    settings = server_settings(v)
    for spec in specs:  # a wrong name or path fails now, in one line, not after start-up
        resolve_model_path(spec.config.model)
    life = lifecycle(v)
    from shoal import kernels

    if kernels.requested_isa():  # so does a code path this CPU lacks
        kernels.available()
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as e:
        print(f"shoal: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    sockets = [sock]
    if settings.ollama_port is not None:  # Ollama's address too: the same app, so the same routes and checks
        try:
            sockets.append(listening_socket(settings.host, settings.ollama_port))
        except OSError as e:
            sock.close()
            print(f"shoal: cannot listen on {settings.host}:{settings.ollama_port} (--ollama-port): {e.strerror or e}",
                  file=sys.stderr)
            return 1
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    app = create_app(specs, settings, lifecycle=life, on_load_error=on_load_error)
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=v["log_level"] == "debug", timeout_graceful_shutdown=5)
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logging.getLogger("shoal").info(
        "serving %s on http://%s:%d (OpenAI API under /v1, Anthropic's at /v1/messages, Prometheus at /metrics; "
        "/health answers 503 until the model is loaded)",
        ", ".join(s.name for s in specs), shown, port,
    )
    if len(sockets) > 1:
        logging.getLogger("shoal").info("also serving on http://%s:%d (Ollama's API under /api)", shown, sockets[1].getsockname()[1])
    if len(specs) > 1:
        budget = f"{life.memory / 2**30:.1f} GiB" if life.memory is not None else "no budget"
        logging.getLogger("shoal").info(
            "offering %d models (default %s; %s at start, the others on first use%s); memory %s, idle ones unload after %s",
            len(specs), specs[0].name, life.preload, "" if life.autoload else " through POST /v1/models only", budget,
            "never" if life.keep_alive == float("inf") else f"{life.keep_alive:g} s")
    if (warning := exposure_warning(settings)) is not None:
        logging.getLogger("shoal").warning(warning)
    server.run(sockets=sockets)
    if failed:
        print(f"shoal: the model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def _torchrun_rank() -> int | None:
    """This process's RANK where torchrun (or a launcher like it) started several."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None


def _torchrun_parallel() -> dict:
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {"tensor_parallel_size": world, "nnodes": max(1, world // local), "node_rank": int(os.environ.get("GROUP_RANK", 0)),
            "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "master_port": int(os.environ.get("MASTER_PORT", 0))}


def _run_worker_rank(rank: int | None, v: dict) -> int:
    """Run one tensor-parallel rank other than 0 in this process until rank 0 stops it (rank None: torchrun's)."""
    from shoal.executor.group import RankGroup
    from shoal.executor.worker import run_rank

    par = engine_config(v).parallel
    if rank is None:
        group = RankGroup.from_environment(par.timeout)
    else:
        group = RankGroup.join(rank, par.world_size, par.master_addr, par.master_port, par.timeout)
    run_rank(group, par.restart_workers)
    return 0


def cmd_worker(a: argparse.Namespace) -> int:
    """`shoal worker`: this machine's tensor-parallel ranks, for a `shoal serve --nnodes N` elsewhere."""
    from shoal.executor.launch import spawn_worker

    v = {**_defaults(ENGINE_OPTS), **vars(a)}
    _setup_logging(v.get("log_level", "info"), v["log_format"])
    par = engine_config(v).parallel
    if par.node_rank == 0:
        raise ValueError("--node-rank 0 is the machine that serves (shoal serve); workers are 1 and up")
    first = par.node_rank * par.ranks_per_node
    others = [spawn_worker(r, par.world_size, par.master_addr, par.master_port, par.timeout, rejoin=par.restart_workers)
              for r in range(first + 1, first + par.ranks_per_node)]
    logging.getLogger("shoal").info("worker node %d: ranks %d-%d of %d, meeting rank 0 at %s:%d", par.node_rank, first,
                                    first + par.ranks_per_node - 1, par.world_size, par.master_addr, par.master_port)
    try:
        return _run_worker_rank(first, v)
    finally:
        for p in others:
            p.wait()


# ---------------------------------------------------------------- clients


def _client(a: argparse.Namespace):
    from shoal.client import ShoalClient

    return ShoalClient(a.url, a.api_key)


def _request_params(a: argparse.Namespace) -> dict:
    keys = [o.key for o in CLIENT_SAMPLING_OPTS]
    return {k: getattr(a, k) for k in keys if getattr(a, k, None) is not None}


def converse(reply, system: str | None, *, interactive: bool = True) -> int:
    """The terminal chat loop of `chat` (over HTTP) and `repl` (in-process).

    /reset clears the conversation, /system TEXT sets the system prompt, /quit
    leaves. `reply(conversation)` prints and returns the assistant's text, or
    None when the turn failed: the user's message is then dropped.
    """
    messages: list[dict] = []
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            messages = []
            print("(conversation cleared)")
            continue
        if line.startswith("/system"):
            system = line[len("/system") :].strip() or None
            messages = []
            print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)")
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("model> ")
        sys.stdout.flush()
        text = reply(([{"role": "system", "content": system}] if system else []) + messages)
        if text is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": text})


def cmd_chat(a: argparse.Namespace) -> int:
    from shoal.client import ClientError

    client = _client(a)
    model = a.model or client.default_model()
    params = _request_params(a)
    out = sys.stdout
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"shoal chat with {model} at {client.url}: /reset clears the conversation, /system TEXT sets the system prompt, /quit leaves.")

    def reply(convo: list[dict]) -> str | None:
        try:
            text, usage = _print_stream(client.chat(convo, model=model, **params), out)
        except ClientError as e:
            if "not reachable" in str(e):
                raise
            out.write("\n")
            print(f"shoal: {e}", file=sys.stderr)  # the conversation goes on without this turn
            return None
        if a.show_usage and usage:
            _print_usage(usage, out)
        return text

    return converse(reply, a.system, interactive=interactive)


def cmd_complete(a: argparse.Namespace) -> int:
    client = _client(a)
    model = a.model or client.default_model()
    _, usage = _print_stream(client.complete(a.prompt, model=model, **_request_params(a)), sys.stdout)
    if a.show_usage and usage:
        _print_usage(usage, sys.stdout)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from shoal.bench import BenchConfig, format_table, run

    values = {o.key: getattr(a, o.key) for o in BENCH_OPTS}
    values["api_key"] = values["api_key"] or os.environ.get("SHOAL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    values["input_len"] = tuple(values["input_len"])
    values["output_len"] = tuple(values["output_len"])
    if values["extra_body"] is not None:
        try:
            values["extra_body"] = json.loads(values["extra_body"])
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e}") from None
    result = run(BenchConfig(**values))
    print(format_table(result))
    if a.out:
        print(f"results written to {a.out}")
    return 1 if result["runs"] and all(r["completed"] == 0 for r in result["runs"]) else 0


def cmd_models(a: argparse.Namespace) -> int:
    for m in _client(a).models():
        extra = f"  (max_model_len {m['max_model_len']})" if m.get("max_model_len") else ""
        print(f"{m['id']}{extra}")
    return 0


def cmd_ps(a: argparse.Namespace) -> int:
    rows = [("NAME", "STATUS", "MEMORY", "IN FLIGHT", "CONTEXT")]
    for m in _client(a).models():
        status = m.get("status", {})
        word = status.get("value", "loaded") if isinstance(status, dict) else str(status)
        if isinstance(status, dict) and status.get("reason"):
            word += f" ({status['reason']})"
        memory = m.get("memory_bytes")
        rows.append((m["id"], word, f"{memory / 2**20:.0f} MiB" + ("" if m.get("memory_measured") else " (est.)") if memory else "-",
                     str(m.get("in_flight", "-")), str(m.get("max_model_len") or "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def cmd_load(a: argparse.Namespace) -> int:
    card = _client(a).load(a.name)
    print(f"{card['id']} loaded ({card['memory_bytes'] / 2**20:.0f} MiB)")
    return 0


def cmd_unload(a: argparse.Namespace) -> int:
    if (a.name is None) == (not a.all):
        raise ValueError("give a model's name or --all")
    cards = _client(a).unload(None if a.all else a.name)
    for card in cards:
        print(f"{card['id']} unloaded")
    if a.all and not cards:
        print("no model was loaded")
    return 0


def _print_stream(deltas, out) -> tuple[str, dict | None]:
    text, usage, thinking = "", None, False
    for d in deltas:
        if d.usage:
            usage = d.usage
        if d.reasoning:
            if not thinking:
                out.write("[thinking] ")
                thinking = True
            out.write(d.reasoning)
        if d.content:
            if thinking:
                out.write("\n[answer] ")
                thinking = False
            out.write(d.content)
            text += d.content
        out.flush()
    out.write("\n")
    out.flush()
    return text, usage


def _print_usage(usage: dict, out) -> None:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out.write(f"[usage: prompt {usage['prompt_tokens']} (cached {cached}), completion {usage['completion_tokens']}]\n")
    out.flush()


# ---------------------------------------------------------------- in-process commands


def stream(engine, request: GenerationRequest, out=sys.stdout) -> str:
    """Run one request to the end, printing text as it comes; return the text."""
    engine.add_request(request)
    text = ""
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            if c.delta_text:
                first = first or time.perf_counter()
                out.write(c.delta_text)
                out.flush()
            text, n = c.text, len(c.token_ids)
    dt = time.perf_counter() - t0
    out.write("\n")
    if first:
        logging.getLogger("shoal").info(
            "%d tokens, first after %.2fs, %.1f tok/s", n, first - t0, n / dt if dt else 0.0
        )
    return text


def cmd_generate(a: argparse.Namespace) -> int:
    from shoal.engine.builder import build_engine

    engine = build_engine(engine_config(a))
    ids = tuple(engine.tokenizer.encode(a.prompt))
    stream(engine, GenerationRequest("cli-0", ids, sampling_params(a), prompt=a.prompt))
    return 0


def cmd_repl(a: argparse.Namespace) -> int:
    from shoal.engine.builder import build_engine
    from shoal.engine.llm import apply_chat_template

    engine = build_engine(engine_config(a))
    params = sampling_params(a)
    ids = itertools.count()
    print("shoal repl: type a message; /reset clears the conversation, /system TEXT sets the system prompt, /quit leaves.")

    def reply(convo: list[dict]) -> str:
        prompt = apply_chat_template(engine.tokenizer, convo)
        return stream(engine, GenerationRequest(f"repl-{next(ids)}", tuple(prompt), params))

    return converse(reply, a.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: a fast, correct, easy-to-run LLM inference server")
    parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="logging detail (default info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def log_level(p):
        p.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="logging detail (debug adds prompts and token ids)")

    s = sub.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible API)",
        description="Load a model and serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
        "plus /health, /stats, /tokenize and /detokenize. YAML config keys are the flags' names; flags win over the file.",
    )
    s.add_argument("--config", default=None, help="YAML file with the same keys as these flags")
    log_level(s)
    _add_opts(s.add_argument_group("model and engine"), SERVE_ENGINE_OPTS, suppress=True)
    _add_opts(s.add_argument_group("scale-out"), PARALLEL_OPTS, suppress=True)
    _add_opts(s.add_argument_group("server"), SERVER_OPTS, suppress=True)
    _add_opts(s.add_argument_group("several models (docs/guides/several-models.md)"), MODELS_OPTS, suppress=True)
    _add_opts(s.add_argument_group("default sampling (a request's own values win)"), SERVER_SAMPLING_OPTS, suppress=True)
    s.set_defaults(func=cmd_serve)

    def client_args(p):
        p.add_argument("--url", default=os.environ.get("SHOAL_URL", "http://127.0.0.1:8000"), help="the server (default $SHOAL_URL or http://127.0.0.1:8000)")
        p.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"), help="API key (default $SHOAL_API_KEY)")
        p.add_argument("--model", default=None, help="model name (default: the server's first)")
        log_level(p)

    w = sub.add_parser("worker", help="hold tensor-parallel ranks for a `shoal serve --nnodes N` on another machine",
                       description="Join a shoal server running on another machine: this machine's ranks load their shard "
                       "of the model, then run each step's forward as rank 0 sends it. The model, dtype and every other "
                       "engine setting come from rank 0; the model file must exist here too.")
    log_level(w)
    w.add_argument("--log-format", default="text", choices=("text", "json"), help="log lines as text or as one JSON object each")
    _add_opts(w, PARALLEL_OPTS, suppress=False)
    w.set_defaults(func=cmd_worker)

    c = sub.add_parser("chat", help="chat with a running server (streaming, multi-turn)", description="Interactive multi-turn chat with a running shoal (or any OpenAI-compatible) server. Commands: /reset, /system TEXT, /quit.")
    client_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--show-usage", action="store_true", help="print token counts after each answer")
    _add_opts(c.add_argument_group("sampling (default: the server's)"), CLIENT_SAMPLING_OPTS, suppress=False)
    c.set_defaults(func=cmd_chat)

    k = sub.add_parser("complete", help="complete one text with a running server, streamed", description="Send one completion request to a running server and stream the text.")
    k.add_argument("prompt")
    client_args(k)
    k.add_argument("--show-usage", action="store_true", help="print token counts at the end")
    _add_opts(k.add_argument_group("sampling (default: the server's)"), CLIENT_SAMPLING_OPTS, suppress=False)
    k.set_defaults(func=cmd_complete)

    m = sub.add_parser("models", help="list the models a running server serves")
    client_args(m)
    m.set_defaults(func=cmd_models)

    ps = sub.add_parser("ps", help="the models a running server offers: status, memory, requests in flight")
    client_args(ps)
    ps.set_defaults(func=cmd_ps)
    ld = sub.add_parser("load", help="load a model on a running server (and wait for it)")
    ld.add_argument("name", help="the model's name, as `shoal ps` lists it")
    client_args(ld)
    ld.set_defaults(func=cmd_load)
    ul = sub.add_parser("unload", help="unload a model (or every one with --all) on a running server")
    ul.add_argument("name", nargs="?", help="the model's name, as `shoal ps` lists it")
    ul.add_argument("--all", action="store_true", help="unload every loaded model")
    client_args(ul)
    ul.set_defaults(func=cmd_unload)

    b = sub.add_parser(
        "bench",
        help="load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Send a workload to any OpenAI-compatible server, streaming every request, and report request and token "
        "throughput and p50/p90/p99 of TTFT, TPOT and ITL (one run per --concurrency level, or Poisson arrivals at --request-rate).",
    )
    log_level(b)
    _add_opts(b, BENCH_OPTS, suppress=False)
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("generate", help="complete one prompt in-process (no server), streamed to the terminal")
    g.add_argument("prompt")
    log_level(g)
    _add_opts(g.add_argument_group("model and engine"), ENGINE_OPTS, suppress=False)
    _add_opts(g.add_argument_group("sampling"), LOCAL_SAMPLING_OPTS, suppress=False)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("repl", help="chat with the model in this terminal (multi-turn, in-process, no server)")
    r.add_argument("--system", default=None, help="system prompt")
    log_level(r)
    _add_opts(r.add_argument_group("model and engine"), ENGINE_OPTS, suppress=False)
    _add_opts(r.add_argument_group("sampling"), LOCAL_SAMPLING_OPTS, suppress=False)
    r.set_defaults(func=cmd_repl)
    return parser


def _setup_logging(level: str, fmt: str = "text") -> None:
    """Log lines at `level`, as text or JSON; worker processes this one starts read the same from the environment."""
    from shoal.logs import configure_logging

    os.environ["SHOAL_LOG_LEVEL"], os.environ["SHOAL_LOG_FORMAT"] = level, fmt
    configure_logging(level, fmt)
    # httpx logs every request at INFO: noise in the client commands' terminal.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def strict_mkl_if(deterministic: bool) -> None:
    """--deterministic with float32 weights needs MKL_CBWR set before torch's first matmul: MKL reads it once."""
    if deterministic:
        os.environ.setdefault("MKL_CBWR", STRICT_MKL)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    _setup_logging(getattr(a, "log_level", "info"))
    from shoal.client import ClientError

    try:
        strict_mkl_if(bool(getattr(a, "deterministic", None)))  # the flag; serve's YAML: cmd_serve, once it has read it
        return a.func(a)
    except (ValueError, FileNotFoundError, ClientError) as e:
        print(f"shoal: {e}", file=sys.stderr)
        return 2 if not isinstance(e, ClientError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
