"""The `shoal` command line.

    shoal generate "The capital of France is" --max-tokens 32
    shoal repl                      # interactive multi-turn chat with the model, in-process

(`shoal serve`, the HTTP server, comes with the OpenAI-compatible API.)
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time

from shoal.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from shoal.types import GenerationRequest, SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="smollm2", help="'smollm2' (default), a .gguf file, or a Hugging Face model folder")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget on CPU, e.g. 2GiB or 512MiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device=a.device,
        max_model_len=a.max_model_len,
        num_threads=a.threads,
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory=parse_bytes(a.kv_cache_memory)),
    )


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        repetition_penalty=a.repetition_penalty,
        seed=a.seed,
        stop=tuple(a.stop),
    )


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
    from shoal.engine.engine import Engine

    engine = Engine.from_config(engine_config(a))
    ids = tuple(engine.tokenizer.encode(a.prompt))
    stream(engine, GenerationRequest("cli-0", ids, sampling_params(a), prompt=a.prompt))
    return 0


def cmd_repl(a: argparse.Namespace) -> int:
    from shoal.engine.engine import Engine
    from shoal.engine.llm import apply_chat_template

    engine = Engine.from_config(engine_config(a))
    params = sampling_params(a)
    system = a.system
    messages: list[dict] = []
    ids = itertools.count()
    print("shoal repl: type a message; /reset clears the conversation, /system TEXT sets the system prompt, /quit leaves.")
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
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
        convo = ([{"role": "system", "content": system}] if system else []) + messages
        prompt = apply_chat_template(engine.tokenizer, convo)
        sys.stdout.write("model> ")
        reply = stream(engine, GenerationRequest(f"repl-{next(ids)}", tuple(prompt), params))
        messages.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: a fast, correct, easy-to-run LLM inference server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt with the model, streamed to the terminal")
    g.add_argument("prompt")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("repl", help="chat with the model in this terminal (multi-turn, in-process)")
    r.add_argument("--system", default=None, help="system prompt")
    _engine_args(r)
    _sampling_args(r)
    r.set_defaults(func=cmd_repl)

    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"shoal: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
