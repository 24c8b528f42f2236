"""Agentic traffic with and without the prefix cache, same run.

    .venv/bin/python benchmarks/agentic_prefix.py [--conversations 4] [--turns 10]

Four interleaved conversations share one long system prompt with tool
definitions (~1,500 tokens); each turn appends the previous reply and a new
user message (every third one a tool result), as an agent loop does. The
requests run one at a time so time to first token is clean. Reported per
turn: median TTFT with the cache on and off, and prefill tokens computed.

Writes benchmarks/results/agentic_prefix.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from publish import machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.runner.model_runner import resolve_dtype  # noqa: E402
from shoal.types import GenerationRequest  # noqa: E402

DTYPE = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # what LLM() below runs in

TOOLS = [
    ("read_file", "Read a file from the workspace and return its text.", "path: string, the file's path relative to the workspace root"),
    ("write_file", "Write text to a file in the workspace, replacing it.", "path: string; content: string, the new file content"),
    ("run_command", "Run a shell command in the workspace and return its output.", "command: string; timeout_s: integer, at most 600"),
    ("search_code", "Search the workspace for a regular expression.", "pattern: string; glob: string, optional file filter"),
    ("list_directory", "List the entries of a directory.", "path: string; recursive: boolean"),
    ("fetch_issue", "Fetch an issue from the tracker by number.", "number: integer"),
    ("post_comment", "Post a comment on an issue.", "number: integer; body: string, markdown"),
    ("run_tests", "Run the project's tests and report failures.", "selector: string, optional pytest -k expression"),
]

def system_prompt() -> str:
    rules = " ".join(
        f"Rule {i}: keep changes small, explain the reason for each edit, never delete user data, "
        f"and prefer the project's existing helpers over new code." for i in range(1, 33)
    )
    tools = "\n".join(
        f'{{"type": "function", "function": {{"name": "{n}", "description": "{d}", "parameters": "{p}"}}}}' for n, d, p in TOOLS
    )
    return (
        "You are a careful coding agent working in a software repository. "
        f"{rules}\n\nYou can call these tools by answering with a JSON object naming the tool and its arguments:\n{tools}\n"
        "When a tool result arrives, read it, then decide the next step."
    )


USER_TURNS = [
    "The tests in tests/test_engine.py fail. Find out why.",
    "Tool result: 3 failed, 40 passed. test_abort fails with 'blocks leaked: 4'.",
    "Look at how abort releases blocks in the scheduler.",
    "Tool result: def finish(self, seq): ... self.pool.free(seq.block_table)",
    "What would you change?",
    "Tool result: the patch applied cleanly.",
    "Run the tests again.",
    "Tool result: 43 passed.",
    "Write a one-line summary for the commit message.",
    "Thanks. Anything else to check?",
]


def time_to_first_token(engine, request: GenerationRequest):
    """Run one request alone on an idle engine: (seconds to its first token, its final output)."""
    t0 = time.perf_counter()
    engine.add_request(request)
    first = final = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if out.finished:
                final = out
    return first, final


def run_mode(enable_cache: bool, n_conv: int, n_turns: int, max_tokens: int) -> dict:
    llm = LLM("smollm2", max_model_len=8192, enable_prefix_cache=enable_cache)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    convs = [[{"role": "system", "content": system_prompt()}] for _ in range(n_conv)]
    ttft = [[None] * n_conv for _ in range(n_turns)]
    prompt_tokens = cached_tokens = 0
    rid = 0
    for turn in range(n_turns):
        for c in range(n_conv):
            convs[c].append({"role": "user", "content": f"[conversation {c}] {USER_TURNS[turn % len(USER_TURNS)]}"})
            ids = llm.apply_chat_template(convs[c])
            first, final = time_to_first_token(engine, GenerationRequest(f"r{rid}", tuple(ids), params))
            rid += 1
            ttft[turn][c] = first
            prompt_tokens += len(ids)
            cached_tokens += final.num_cached_tokens
            convs[c].append({"role": "assistant", "content": final.outputs[0].text})
            print(
                f"{'cache on ' if enable_cache else 'cache off'} turn {turn + 1:2d} conv {c}: prompt {len(ids):5d} tok, "
                f"cached {final.num_cached_tokens:5d}, TTFT {first * 1000:7.1f} ms",
                flush=True,
            )
    return {
        "system_tokens": len(llm.apply_chat_template(convs[0][:1])),
        "ttft_by_turn": ttft,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "computed_prompt_tokens": prompt_tokens - cached_tokens,
        "stats": vars(engine.prefix_cache.stats) if engine.prefix_cache else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    on = run_mode(True, args.conversations, args.turns, args.max_tokens)
    off = run_mode(False, args.conversations, args.turns, args.max_tokens)
    rows = []
    for t in range(args.turns):
        m_on, m_off = statistics.median(on["ttft_by_turn"][t]), statistics.median(off["ttft_by_turn"][t])
        rows.append((t + 1, m_off, m_on, m_off / m_on))
    later_on = statistics.median(x for t in range(1, args.turns) for x in on["ttft_by_turn"][t])
    later_off = statistics.median(x for t in range(1, args.turns) for x in off["ttft_by_turn"][t])
    share = on["cached_tokens"] / on["prompt_tokens"]
    doc = {"machine": machine(), "cache_on": on, "cache_off": off}
    md = [
        f"# Agentic prefix-cache benchmark ({time.strftime('%Y-%m-%d')})",
        "",
        f"SmolLM2-135M-Instruct (GGUF Q4_1 → {DTYPE}, shoal's `auto` on this machine), {args.conversations} interleaved conversations x {args.turns} turns, "
        f"a shared {on['system_tokens']}-token system prompt with tool definitions, {args.max_tokens} output tokens per turn, "
        f"requests one at a time, cache on and off in the same run, on {machine_line(doc['machine'])}.",
        "",
        *table(["turn", "median TTFT, cache off (ms)", "median TTFT, cache on (ms)", "speed-up"],
               [[t, f"{a * 1000:.0f}", f"{b * 1000:.0f}", f"{r:.1f}x"] for t, a, b, r in rows], align="rrrr"),
        "",
        f"- Turns 2+: median TTFT {later_off * 1000:.0f} ms off vs {later_on * 1000:.0f} ms on: **{later_off / later_on:.1f}x** lower with the cache.",
        f"- Prompt tokens served from the cache: **{share:.1%}** ({on['cached_tokens']} of {on['prompt_tokens']}); "
        f"prefill tokens computed: {on['computed_prompt_tokens']} with the cache, {off['computed_prompt_tokens']} without.",
    ]
    publish("agentic_prefix", doc, md)


if __name__ == "__main__":
    main()
