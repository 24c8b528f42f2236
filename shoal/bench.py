"""`shoal bench`: a load generator for any OpenAI-compatible server.

    shoal bench --base-url http://127.0.0.1:8000/v1 --workload random \\
        --input-len 128 256 --output-len 128 128 --concurrency 1 8 32 --num-requests 64 --out results.json

Every request streams (`stream_options.include_usage`) and records the time to
the first content token (TTFT), the gaps between content chunks (ITL), the
end-to-end latency and the output tokens the server reported in its usage
chunk (not a count of chunks). One run per `--concurrency` level, or one run
with Poisson arrivals at `--request-rate` requests/s (seeded).

Workloads:
- random: prompts of random words (about one token each) with lengths drawn from
  `--input-len MIN MAX`; `max_tokens` drawn from `--output-len MIN MAX` with
  `ignore_eos: true`, so the output lengths are exact on servers that honour it;
- chat: a built-in set of varied chat prompts (`CHAT_PROMPTS`);
- agentic: interleaved multi-turn conversations sharing one long system prompt
  with tool definitions; each turn appends the previous reply and a new user
  message, and is sent only after that reply arrived (the prefix-cache workload);
- file: a JSONL file, one `{"prompt": ...}` or `{"messages": [...]}` per line
  (optionally `max_tokens`).

The statistics (`percentile`, `tpot`, `summarize`) are plain functions of the
per-request records, with no I/O.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("random", "chat", "agentic", "file")
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100), interpolated linearly between closest ranks (numpy's default); None if empty."""
    return float(np.percentile(values, p)) if len(values) else None


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); None with fewer than 2 tokens."""
    if output_tokens is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def distribution(values: list[float], scale: float = 1000.0) -> dict:
    """mean and p50/p90/p99 of `values` (seconds), times `scale` (ms by default); Nones when empty."""
    out: dict[str, float | None] = {"mean": (sum(values) / len(values) * scale) if values else None}
    for p in PERCENTILES:
        v = percentile(values, p)
        out[f"p{p}"] = None if v is None else v * scale
    return out


@dataclass
class RequestResult:
    """What one request did. Times in seconds (perf_counter), relative to the request's start."""

    ok: bool
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None
    conversation: int | None = None
    turn: int | None = None


def summarize(results: list[RequestResult], duration: float) -> dict:
    """One run's report: counts, throughputs over `duration` seconds, and TTFT/TPOT/ITL/E2E distributions in ms."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    per = duration if duration > 0 else float("nan")
    tpots = [t for r in ok if (t := tpot(r.e2e, r.ttft, r.output_tokens)) is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    report = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error or "unknown error" for r in failed)),
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_without_usage": sum(1 for r in ok if not r.usage_reported),
        "request_throughput": len(ok) / per,
        "output_throughput": out_tokens / per,
        "total_token_throughput": (in_tokens + out_tokens) / per,
        "ttft_ms": distribution(ttfts),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([x for r in ok for x in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None]),
    }
    if any(r.turn for r in ok):  # agentic: the turns after the first are where a prefix cache shows
        report["ttft_ms_turn2_on"] = distribution([r.ttft for r in ok if r.turn and r.turn >= 2 and r.ttft is not None])
    return report


# ---------------------------------------------------------------- workloads

WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot word but what some we can "
    "out other were all there when up use your how said an each she which do their time if will way about many then them "
    "write would like so these her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very through just form great "
    "think say help low line differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big high such follow act why ask"
).split()

CHAT_PROMPTS = [
    "Explain in two short paragraphs why the sky is blue.",
    "Write a haiku about a lighthouse in winter.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "Summarize the plot of a heist movie you invent, in five sentences.",
    "How do I make a simple tomato sauce from scratch?",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "What are the pros and cons of working from home?",
    "Write a limerick about a cat who learns to code.",
    "Explain recursion to a ten-year-old.",
    "List five tips for writing clear emails.",
    "What causes the seasons on Earth?",
    "Describe a sunrise over the desert using vivid imagery.",
    "How does a hash table work? Keep it brief.",
    "Suggest a name for a bakery that only sells bread made with sourdough.",
    "What should I pack for a three-day hiking trip?",
    "Write a short dialogue between a robot and a gardener.",
    "Why do leaves change color in autumn?",
    "Give me a 20-minute bodyweight workout.",
    "Explain the difference between weather and climate.",
    "Write the opening line of a mystery novel set on a ship.",
    "What is a prime number? Give the first ten.",
    "How can I improve my sleep schedule?",
    "Compare trains and planes for a 500 km trip.",
    "Write a polite message declining a meeting invitation.",
    "What is photosynthesis, in simple terms?",
    "Invent a board game and describe its rules in a few sentences.",
    "How do vaccines train the immune system?",
    "Tell me a fun fact about octopuses and explain it.",
    "Write a four-line poem about the first day of school.",
    "What are good habits for learning a new language?",
    "Explain what an API is using a restaurant analogy.",
]

AGENTIC_TOOLS = [
    {"name": "search_files", "description": "Search the repository for a regular expression.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}}, "required": ["pattern"]}},
    {"name": "read_file", "description": "Read a file's lines.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "edit_file", "description": "Replace an exact string in a file with another.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}, "required": ["path", "old", "new"]}},
    {"name": "run_tests", "description": "Run the test suite, or the tests matching a keyword.",
     "parameters": {"type": "object", "properties": {"keyword": {"type": "string"}}}},
    {"name": "run_shell", "description": "Run a shell command in the repository and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}, "required": ["command"]}},
    {"name": "web_search", "description": "Search the web and return the top results' titles and snippets.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "num_results": {"type": "integer"}}, "required": ["query"]}},
]

AGENTIC_SYSTEM = (
    "You are a careful software engineering assistant working inside a code repository. "
    "You can call tools to look at and change the code. To call a tool, answer with one JSON object "
    '{"tool": NAME, "arguments": {...}} and nothing else; the result comes back in the next user message. '
    "Read before you edit, keep changes small, run the tests after each change, and explain what you did in "
    "plain words when the task is finished. Never invent file contents: read them. If a command fails, read its "
    "error and fix the cause instead of retrying blindly.\n\nAvailable tools:\n"
    + "\n".join(json.dumps(t) for t in AGENTIC_TOOLS)
)

AGENTIC_TASKS = [
    "The test test_parse_dates fails on leap years. Find the cause and fix it.",
    "Add a --verbose flag to the command line that prints each step.",
    "The HTTP client retries forever on a 404. Make it give up after three tries.",
    "Rename the function calc_total to compute_total everywhere.",
    "Find where the config file is read and make unknown keys an error.",
    "The logs print passwords in clear text. Find and mask them.",
    "Write a unit test for the function that splits CSV lines with quotes.",
    "Speed up the slow loop in report.py that builds a string with +=.",
]

AGENTIC_FOLLOWUPS = [
    'Tool result: {"matches": ["src/app/util.py:42", "src/app/cli.py:118"]}. Continue.',
    'Tool result: {"lines": ["def handler(args):", "    value = args.get(\\"x\\")", "    return value * 2"]}. Continue.',
    'Tool result: {"ok": true, "diff": "+    if value is None: return 0"}. Continue.',
    'Tool result: {"passed": 41, "failed": 1, "first_failure": "AssertionError: expected 3, got 2"}. Continue.',
    'Tool result: {"stdout": "build finished in 2.1s", "exit_code": 0}. Continue.',
    "Good. Now explain briefly what you changed and why.",
]


@dataclass
class Item:
    """One request to send: a prompt (completions) or messages (chat)."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    conversation: int | None = None
    turn: int | None = None


SKIP = object()  # a turn that will never be sent (its conversation broke off)


def random_prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


class Workload:
    """Items ready to send: `initial()` first, then `on_done(item, result)` for whatever a reply unlocks."""

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.total = len(items)

    def initial(self) -> list:
        return list(self.items)

    def on_done(self, item: Item, result: RequestResult, reply: str) -> list:
        return []


class AgenticWorkload(Workload):
    """`conversations` conversations of up to `turns` turns, `total` turns in all; turn k+1 waits for turn k's reply."""

    def __init__(self, total: int, turns: int, max_tokens: int | None, rng: random.Random) -> None:
        self.total = total
        self.turns = max(1, turns)
        self.max_tokens = max_tokens
        n_conv = max(1, math.ceil(total / self.turns))
        self.lengths = [self.turns] * n_conv
        self.lengths[-1] = total - self.turns * (n_conv - 1)
        self.rng = rng
        self.tasks = [AGENTIC_TASKS[(i + rng.randrange(len(AGENTIC_TASKS))) % len(AGENTIC_TASKS)] for i in range(n_conv)]

    def initial(self) -> list:
        return [
            Item(messages=[{"role": "system", "content": AGENTIC_SYSTEM}, {"role": "user", "content": f"Task {c}: {task}"}],
                 max_tokens=self.max_tokens, conversation=c, turn=1)
            for c, task in enumerate(self.tasks)
        ]

    def on_done(self, item: Item, result: RequestResult, reply: str) -> list:
        left = self.lengths[item.conversation] - item.turn
        if left <= 0:
            return []
        if not result.ok:
            return [SKIP] * left
        followup = AGENTIC_FOLLOWUPS[(item.turn - 1 + item.conversation) % len(AGENTIC_FOLLOWUPS)]
        messages = item.messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": followup}]
        return [Item(messages=messages, max_tokens=self.max_tokens, conversation=item.conversation, turn=item.turn + 1)]


def build_workload(cfg: BenchConfig) -> Workload:
    rng = random.Random(cfg.seed)
    n = cfg.num_requests
    if cfg.workload == "random":
        (imin, imax), (omin, omax) = cfg.input_len, cfg.output_len
        if not (0 < imin <= imax and 0 < omin <= omax):
            raise ValueError("--input-len and --output-len take MIN MAX with 0 < MIN <= MAX")
        items = [Item(prompt=random_prompt(rng, rng.randint(imin, imax)), max_tokens=rng.randint(omin, omax), ignore_eos=True)
                 for _ in range(n)]
    elif cfg.workload == "chat":
        order = list(range(len(CHAT_PROMPTS)))
        rng.shuffle(order)
        items = [Item(messages=[{"role": "user", "content": CHAT_PROMPTS[order[i % len(order)]]}], max_tokens=cfg.max_tokens)
                 for i in range(n)]
    elif cfg.workload == "agentic":
        return AgenticWorkload(n, cfg.turns, cfg.max_tokens, rng)
    elif cfg.workload == "file":
        if not cfg.file:
            raise ValueError("--workload file needs --file FILE.jsonl")
        rows = []
        for i, line in enumerate(Path(cfg.file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
                raise ValueError(f"{cfg.file}:{i}: each line needs 'prompt' or 'messages'")
            rows.append(Item(prompt=row.get("prompt"), messages=row.get("messages"), max_tokens=row.get("max_tokens", cfg.max_tokens)))
        if not rows:
            raise ValueError(f"{cfg.file} has no requests")
        items = [rows[i % len(rows)] for i in range(n)]
    else:
        raise ValueError(f"unknown workload {cfg.workload!r} (choose from {', '.join(WORKLOADS)})")
    return Workload(items)


# ---------------------------------------------------------------- sending


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # default: the server's first model
    workload: str = "random"
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rate: float | None = None  # Poisson arrivals; replaces --concurrency
    num_requests: int = 32
    seed: int = 0
    max_tokens: int | None = 128  # chat, agentic, file
    input_len: tuple[int, int] = (128, 128)  # random
    output_len: tuple[int, int] = (128, 128)  # random
    file: str | None = None
    turns: int = 4  # agentic: turns per conversation
    endpoint: str = "chat"  # chat (/chat/completions) or completions (/completions; prompts only)
    temperature: float | None = None
    # merged into every request body last, for a server's own fields; a key set to None removes that field
    # (e.g. {"ignore_eos": None, "logit_bias": {"2": -100}} for a server that has no ignore_eos)
    extra_body: dict | None = None
    api_key: str | None = None
    timeout: float = 600.0
    progress: bool = True
    out: str | None = None


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except Exception:
        message = body.decode(errors="replace").strip()[:200] or "no details"
    return f"HTTP {status}: {message}"


async def send(http, cfg: BenchConfig, model: str, item: Item) -> tuple[RequestResult, str]:
    """Stream one request; return its record and the reply's text."""
    chat = cfg.endpoint == "chat"
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt}]
        path = "/chat/completions"
    else:
        if item.prompt is None:
            raise ValueError("--endpoint completions needs prompts (the random workload or a file of prompts)")
        body["prompt"] = item.prompt
        path = "/completions"
    if item.max_tokens is not None:
        body["max_tokens"] = item.max_tokens
    if item.ignore_eos:
        body["ignore_eos"] = True
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    for key, value in (cfg.extra_body or {}).items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    res = RequestResult(ok=False, conversation=item.conversation, turn=item.turn)
    text: list[str] = []
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                res.error = _error_text(r.status_code, await r.aread())
                return res, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res, ""
                now = time.perf_counter()
                piece = ""
                for choice in event.get("choices") or []:
                    piece += ((choice.get("delta") or {}).get("content") or "") if chat else (choice.get("text") or "")
                if piece:
                    chunks += 1
                    text.append(piece)
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    res.usage_reported = True
                    res.prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
                    res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}".rstrip(": ")
        return res, ""
    res.e2e = time.perf_counter() - t0
    if not res.usage_reported:
        res.output_tokens = chunks  # a server without usage: the chunk count is the best there is (flagged in the report)
    if res.ttft is None:
        res.ttft = res.e2e  # no content at all
    res.ok = True
    return res, "".join(text)


async def _default_model(http) -> str:
    r = await http.get("/models")
    if r.status_code >= 400:
        raise ValueError(f"cannot list the server's models: {_error_text(r.status_code, r.content)}")
    data = r.json().get("data") or []
    if not data:
        raise ValueError("the server serves no model; pass --model")
    return data[0]["id"]


async def run_once(http, cfg: BenchConfig, model: str, concurrency: int | None, rate: float | None) -> dict:
    """One run: every request of the workload, at `concurrency` in flight or Poisson arrivals at `rate`/s."""
    workload = build_workload(cfg)
    queue: asyncio.Queue = asyncio.Queue()
    for it in workload.initial():
        queue.put_nowait(it)
    total = workload.total
    results: list[RequestResult] = []
    bar = _progress(total, cfg.progress, f"c={concurrency}" if rate is None else f"rate={rate}/s")
    done = 0
    finished = asyncio.Event()
    t_start = time.perf_counter()

    def account(n: int = 1) -> None:
        nonlocal done
        done += n
        if done >= total:
            finished.set()

    async def one(item: Item) -> None:
        start = time.perf_counter() - t_start
        res, reply = await send(http, cfg, model, item)
        res.start = start
        results.append(res)
        if bar is not None:
            bar.update(1)
        for new in workload.on_done(item, res, reply):
            queue.put_nowait(new)
        account()

    if total == 0:
        finished.set()
    if rate is None:
        async def worker() -> None:
            while not finished.is_set():
                getter = asyncio.ensure_future(queue.get())
                waiter = asyncio.ensure_future(finished.wait())
                await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    waiter.cancel()
                    return
                waiter.cancel()
                item = getter.result()
                if item is SKIP:
                    account()
                    continue
                await one(item)

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    else:
        rng = random.Random(cfg.seed + 1)
        tasks = []
        next_t = time.perf_counter()
        taken = 0
        while taken < total:
            item = await queue.get()
            taken += 1
            if item is SKIP:
                account()
                continue
            next_t += rng.expovariate(rate)
            delay = next_t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    report = {"concurrency": concurrency, "request_rate": rate, **summarize(results, duration)}
    report["requests"] = [
        {k: v for k, v in asdict(r).items()} for r in sorted(results, key=lambda r: r.start)
    ]
    return report


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


async def run_async(cfg: BenchConfig) -> dict:
    """All runs of `cfg`: {"machine", "args", "model", "runs": [one report per concurrency level or the rate]}."""
    import httpx

    if cfg.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.workload!r} (choose from {', '.join(WORKLOADS)})")
    if cfg.endpoint not in ("chat", "completions"):
        raise ValueError("--endpoint is chat or completions")
    if cfg.extra_body is not None and not isinstance(cfg.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if cfg.request_rate is not None and cfg.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if cfg.request_rate is None and (not cfg.concurrency or min(cfg.concurrency) < 1):
        raise ValueError("--concurrency levels must be >= 1")
    items = build_workload(cfg).initial()  # a bad workload fails before anything is sent
    if cfg.endpoint == "completions" and any(it.prompt is None for it in items if it is not SKIP):
        raise ValueError("--endpoint completions needs prompts (the random workload or a file of prompts)")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    top = None if cfg.request_rate is not None else max(cfg.concurrency)
    limits = httpx.Limits(max_connections=top, max_keepalive_connections=top)
    async with httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits, trust_env=False,
        timeout=httpx.Timeout(cfg.timeout, connect=10.0),
    ) as http:
        try:
            model = cfg.model or await _default_model(http)
        except httpx.TransportError as e:
            raise ValueError(f"server not reachable at {cfg.base_url}: {type(e).__name__}: {e}") from None
        runs = []
        if cfg.request_rate is not None:
            runs.append(await run_once(http, cfg, model, None, cfg.request_rate))
        else:
            for c in cfg.concurrency:
                runs.append(await run_once(http, cfg, model, c, None))
    args = asdict(cfg)
    if args["api_key"]:
        args["api_key"] = "(set)"  # never write the key into a results file
    return {"machine": machine_info(), "args": args, "model": model, "runs": runs}


def run(cfg: BenchConfig | None = None, **kw) -> dict:
    """Run the benchmark (blocking); write JSON to `cfg.out` when set. `run(base_url=..., workload=...)` works too."""
    cfg = cfg or BenchConfig(**kw)
    result = asyncio.run(run_async(cfg))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---------------------------------------------------------------- reporting


def machine_info() -> dict:
    import shoal

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu or platform.processor() or None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "shoal": shoal.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_table(result: dict) -> str:
    """The runs as a text table, one row per run."""

    def f(v, nd=1):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"

    cols = ["load", "ok", "fail", "req/s", "out tok/s", "tot tok/s",
            "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "ITL p50", "p90", "p99"]
    rows = []
    for r in result["runs"]:
        load = f"c={r['concurrency']}" if r["request_rate"] is None else f"{r['request_rate']:g}/s"
        row = [load, str(r["completed"]), str(r["failed"]), f(r["request_throughput"], 2), f(r["output_throughput"]),
               f(r["total_token_throughput"])]
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            row += [f(r[key][f"p{p}"]) for p in PERCENTILES]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [f"model {result['model']}, workload {result['args']['workload']}; times in ms",
             "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    for r in result["runs"]:
        for err, n in r["errors"].items():
            lines.append(f"  {n} failed: {err}")
        if r.get("requests_without_usage"):
            lines.append(f"  {r['requests_without_usage']} requests had no usage chunk: their output tokens are chunk counts")
        if r.get("ttft_ms_turn2_on") and r["ttft_ms_turn2_on"]["p50"] is not None:
            lines.append(f"  TTFT from turn 2 on: p50 {f(r['ttft_ms_turn2_on']['p50'])} ms, p90 {f(r['ttft_ms_turn2_on']['p90'])} ms")
    return "\n".join(lines)
