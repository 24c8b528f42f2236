"""An agent loop with tools over both protocols, against the same loop without tools, same run.

    .venv/bin/python benchmarks/agent_tools.py [--turns 5] [--rounds 3]

`shoal serve` in its default configuration (default model, prefix cache on) runs as a
subprocess. A loop is a system prompt with 6 tools and TURNS turns of call -> result ->
call: each turn the model is made to call a tool (`tool_choice` required / `any`, so
the call is well formed), the call and a canned result are appended, and the next turn
asks again. The loop without tools has the same shape in plain text: the same tool
listing pasted into the system prompt, each call written as assistant text and each
result as a user message.

The figure is time to first token from turn 2 on: before each turn's real request,
the same request with max_tokens=1 is timed (a forced call streams only when complete,
so the first streamed byte would time the whole call). The question is whether the
rendered tool turns keep hitting the prefix cache: then both loops prefill only the
newest turn, and their TTFTs are within a few percent.

Writes benchmarks/results/agent_tools.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anthropic
import httpx
import openai
from tqdm import tqdm

from publish import machine, machine_line, publish, table

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful coding agent working in a repository. Use the tools to inspect and change files; explain briefly."


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required, "additionalProperties": False}}


S = {"type": "string", "maxLength": 40}
TOOLS = [
    _tool("read_file", "Read a file from the workspace and return its text.", {"path": S}, ["path"]),
    _tool("write_file", "Write text to a file in the workspace, replacing it.", {"path": S, "content": S}, ["path", "content"]),
    _tool("run_command", "Run a shell command in the workspace and return its output.", {"command": S, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}}, ["command"]),
    _tool("search_code", "Search the workspace for a regular expression.", {"pattern": S, "glob": S}, ["pattern"]),
    _tool("list_directory", "List the entries of a directory.", {"path": S, "recursive": {"type": "boolean"}}, ["path"]),
    _tool("fetch_issue", "Fetch an issue from the tracker by number.", {"number": {"type": "integer", "minimum": 1, "maximum": 9999}}, ["number"]),
]
ASKS = ["Find where the scheduler preempts sequences.", "Open that file.", "Run the scheduler tests.", "Fix the failing test.", "List what changed."]
RESULT = {"ok": True, "output": "scheduler.py:142: def _preempt(self, seq): ... 3 tests passed, 1 failed: test_priority"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w", prefix="shoal-agent-tools-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--port", str(self.port)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).json().get("status") == "ok":
                    self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited; see {self.log.name}")
            time.sleep(0.5)
        raise RuntimeError("shoal serve did not get ready in 10 minutes")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def listing() -> str:
    return "Tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)


def openai_loop(client: openai.OpenAI, model: str, tools: bool, turns: int, tag: str) -> list[tuple[float, int]]:
    """(TTFT in seconds, prompt tokens not from the cache) per turn of one loop over the OpenAI API."""
    system = f"{SYSTEM} (session {tag})" + ("" if tools else "\n\n" + listing())
    msgs: list[dict] = [{"role": "system", "content": system}]
    extra = dict(tools=[{"type": "function", "function": t} for t in TOOLS], tool_choice="required") if tools else {}
    ttfts = []
    for turn in range(turns):
        msgs.append({"role": "user", "content": ASKS[turn % len(ASKS)]})
        t = time.perf_counter()
        probe = client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0, **extra)
        ttfts.append((time.perf_counter() - t, probe.usage.prompt_tokens - probe.usage.prompt_tokens_details.cached_tokens))
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0, **extra)
        m = r.choices[0].message
        if tools and m.tool_calls:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in m.tool_calls]})
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps(RESULT)} for c in m.tool_calls]
        else:
            msgs.append({"role": "assistant", "content": m.content or ""})
            msgs.append({"role": "user", "content": "Result: " + json.dumps(RESULT)})
    return ttfts


def anthropic_loop(client: anthropic.Anthropic, model: str, tools: bool, turns: int, tag: str) -> list[tuple[float, int]]:
    system = f"{SYSTEM} (session {tag})" + ("" if tools else "\n\n" + listing())
    msgs: list[dict] = []
    extra = dict(tools=[{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS],
                 tool_choice={"type": "any"}) if tools else {}
    ttfts = []
    for turn in range(turns):
        user: list = [{"type": "text", "text": ASKS[turn % len(ASKS)]}]
        if msgs and msgs[-1]["role"] == "user":
            msgs[-1]["content"] += user  # tool results and the next ask in one user turn
        else:
            msgs.append({"role": "user", "content": user})
        kw = dict(model=model, system=system, messages=msgs, extra_body={"temperature": 0}, **extra)
        t = time.perf_counter()
        probe = client.messages.create(max_tokens=1, **kw)
        ttfts.append((time.perf_counter() - t, probe.usage.input_tokens - probe.usage.cache_read_input_tokens))
        r = client.messages.create(max_tokens=120, **kw)
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        calls = [b for b in r.content if b.type == "tool_use"]
        if calls:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": json.dumps(RESULT)} for c in calls]})
        else:
            msgs.append({"role": "user", "content": [{"type": "text", "text": "Result: " + json.dumps(RESULT)}]})
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    server = Server()
    try:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        loops = {("openai", True): openai_loop, ("openai", False): openai_loop, ("anthropic", True): anthropic_loop, ("anthropic", False): anthropic_loop}
        clients = {"openai": oa, "anthropic": an}
        openai_loop(oa, server.model, True, 2, "warm-up")
        samples: dict[tuple[str, bool], list[tuple[float, int]]] = {k: [] for k in loops}
        with tqdm(total=args.rounds * len(loops), desc="agent-loop benchmark", file=sys.stderr) as bar:
            for r in range(args.rounds):
                for (proto, tools), fn in loops.items():  # taking turns: a slow spell hits them all
                    ttfts = fn(clients[proto], server.model, tools, args.turns, f"{r}-{proto}-{tools}")
                    samples[(proto, tools)] += ttfts[1:]  # from turn 2 on
                    bar.update()
    finally:
        server.stop()
    rows = []
    for proto in ("openai", "anthropic"):
        with_tools = statistics.median(t for t, _ in samples[(proto, True)]) * 1e3
        plain = statistics.median(t for t, _ in samples[(proto, False)]) * 1e3
        rows.append({"protocol": proto, "ttft_tools_ms": with_tools, "ttft_plain_ms": plain, "ratio": with_tools / plain,
                     "uncached_tools": statistics.median(n for _, n in samples[(proto, True)]),
                     "uncached_plain": statistics.median(n for _, n in samples[(proto, False)])})
    doc = {"turns": args.turns, "rounds": args.rounds, "machine": machine(), "rows": rows,
           "samples": {f"{p}-{'tools' if t else 'plain'}": v for (p, t), v in samples.items()}}
    lines = [f"# Agent loop with 6 tools, {args.turns} turns of call -> result, {args.rounds} rounds (`shoal serve`, default configuration)", "",
             f"On {machine_line(doc['machine'])}.", ""]
    lines += table(["protocol", "median TTFT from turn 2, with tools", "same loop without tools", "ratio",
                    "prompt tokens computed per turn (median): tools / without"],
                   [[r["protocol"], f"{r['ttft_tools_ms']:.0f} ms", f"{r['ttft_plain_ms']:.0f} ms", f"{r['ratio']:.2f}",
                     f"{r['uncached_tools']:.0f} / {r['uncached_plain']:.0f}"] for r in rows])
    publish("agent_tools", doc, lines)


if __name__ == "__main__":
    main()
