"""Tool calls: from a model's text to structured calls, and tools into the prompt.

Parsers are small streaming state machines with the shape of `ReasoningSplitter`:
`feed(delta) -> Parsed` and `finish() -> Parsed`, where `Parsed` holds answer text
and whole calls. Text that might be the start of a call marker is held back until it
is known not to be one, so a reply fed in any pieces gives the text and calls of the
reply fed whole. A call whose arguments are not valid JSON comes back as text, never
dropped, and never fails the request.

Families (`--tool-call-parser`, or picked from the chat template):
  - `hermes` (Hermes, Qwen 2.5/3, and shoal's own format for templates without tools):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around;
  - `llama3_json` (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}`,
    optionally after `<|python_tag|>`, several separated by `;`;
  - `mistral`: `[TOOL_CALLS]` then a JSON list of calls (or `name[ARGS]{...}`, v11+);
  - `pythonic` (Llama 3.2/4 style): the reply is `[f(a=1), g(b="x")]`, optionally in a
    fenced `tool_code`/`python` block;
  - `json` (forced calls: the grammar of structured output made the reply a JSON list
    of `{"name", "arguments"}`).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def input(self) -> dict:
        """The arguments as an object (Anthropic's `input`)."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class Parsed:
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.text += other.text
        self.calls.extend(other.calls)
        return self


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(name, arguments) -> ToolCall | None:
    """A call from a parsed name and arguments (an object, or JSON text of one)."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_call(obj) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return _call(obj.get("name"), args)


def _json_calls(text: str) -> list[ToolCall] | None:
    """A JSON object or list of objects, each a call; None unless all of it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_json_call(v) for v in items]
    return calls if calls and all(calls) else None


class ToolParser:
    """Base: pass text through. Subclasses find calls."""

    name = "none"

    def feed(self, delta: str) -> Parsed:
        return Parsed(text=delta)

    def finish(self) -> Parsed:
        return Parsed()

    def parse(self, text: str) -> Parsed:
        """A whole reply at once."""
        out = self.feed(text)
        out += self.finish()
        return out


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the reply."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._held = ""  # outside a call: a possible start tag, or whitespace that may precede a call
        self._body: str | None = None  # inside a call: its text so far
        self._any_call = False
        self._text_since_call = False

    def feed(self, delta: str) -> Parsed:
        out = Parsed()
        text = self._held + delta
        self._held = ""
        while text:
            if self._body is not None:
                start = max(0, len(self._body) - len(self.END) + 1)  # the end tag may straddle two deltas
                body = self._body + text
                i = body.find(self.END, start)
                if i < 0:
                    self._body = body
                    return out
                self._close(body[:i], out)
                text = body[i + len(self.END) :]
                continue
            i = text.find(self.START)
            if i >= 0:
                before = text[:i].rstrip()  # the whitespace before a call goes with it
                if before:
                    out.text += self._after_call(before)
                self._body = ""
                text = text[i + len(self.START) :]
                continue
            keep = _partial_suffix(text, self.START)
            body, tail = text[: len(text) - keep], text[len(text) - keep :]
            stripped = body.rstrip()  # trailing whitespace waits: a call may follow it
            if stripped:
                out.text += self._after_call(stripped)
            self._held = body[len(stripped) :] + tail
            break
        return out

    def _after_call(self, text: str) -> str:
        # the first text after a call loses the whitespace that separated it from the call
        if self._any_call and not self._text_since_call:
            text = text.lstrip()
        self._text_since_call = bool(text)
        return text

    def _close(self, body: str, out: Parsed) -> None:
        self._body = None
        calls = _json_calls(body.strip())
        if calls:
            out.calls.extend(calls)
            self._any_call = True
            self._text_since_call = False
        else:  # not a call after all: the text as the model wrote it
            out.text += self.START + body + self.END

    def finish(self) -> Parsed:
        out = Parsed()
        if self._body is not None:  # the reply ended inside a call (a stop string took the end tag)
            body, self._body = self._body, None
            calls = _json_calls(body.strip())
            if calls:
                out.calls.extend(calls)
            else:
                out.text += self.START + body
        elif self._held.strip():
            out.text += self._after_call(self._held)
        elif not self._any_call:
            out.text += self._held
        self._held = ""
        return out


class _WholeReplyParser(ToolParser):
    """Calls that make up the rest of the reply from a marker (or from its start): held
    until the reply ends, then parsed; text if they do not parse."""

    markers: tuple[str, ...] = ()
    at_start_only = True

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"  # -> "text" | "calls"
        self._cut = 0  # where the calls begin in _buf

    def feed(self, delta: str) -> Parsed:
        if self._mode == "text":
            return Parsed(text=delta)
        self._buf += delta
        if self._mode == "calls":
            return Parsed()
        return self._decide(final=False)

    def _decide(self, final: bool) -> Parsed:
        buf = self._buf
        if self.at_start_only:
            lead = buf.lstrip()
            if not lead and not final:
                return Parsed()
            if any(lead.startswith(m) for m in self.markers):
                self._mode, self._cut = "calls", len(buf) - len(lead)
                return Parsed()
            if not final and any(m.startswith(lead) for m in self.markers):
                return Parsed()  # could still become a marker
            self._mode, self._buf = "text", ""
            return Parsed(text=buf)
        i = min((j for j in (buf.find(m) for m in self.markers) if j >= 0), default=-1)
        if i >= 0:
            self._mode, self._cut = "calls", i
            return Parsed(text=buf[:i])
        keep = 0 if final else max(_partial_suffix(buf, m) for m in self.markers)
        self._buf = buf[len(buf) - keep :]
        return Parsed(text=buf[: len(buf) - keep])

    def finish(self) -> Parsed:
        if self._mode == "undecided":
            out = self._decide(final=True)
            if self._mode != "calls":
                self._buf = ""
                return out
        if self._mode != "calls":
            return Parsed()
        text = self._buf[self._cut :]
        prefix = self._buf[: self._cut] if self.at_start_only else ""
        self._buf = ""
        calls = self.parse_calls(text.strip())
        return Parsed(calls=calls) if calls else Parsed(text=prefix + text)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError


class JsonCallsParser(_WholeReplyParser):
    """The reply is a JSON list of `{"name", "arguments"}` (forced calls under a grammar)."""

    name = "json"
    markers = ("[", "{")

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        return _json_calls(text)


class Llama3JsonParser(_WholeReplyParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        text = text.removeprefix("<|python_tag|>").strip()
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(text):
            try:
                obj, end = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _json_call(obj)
            if call is None:
                return None
            calls.append(call)
            i = end
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
        return calls or None


class MistralParser(_WholeReplyParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    at_start_only = False
    _ARGS = re.compile(r"\[TOOL_CALLS\]\s*([^\[\]{}\s]+)\s*\[ARGS\]")

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        if "[ARGS]" in text:  # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated
            calls = []
            parts = self._ARGS.split(text)
            if parts[0].strip():
                return None
            for name, args in zip(parts[1::2], parts[2::2]):
                call = _call(name, args.strip())
                if call is None:
                    return None
                calls.append(call)
            return calls or None
        return _json_calls(text.removeprefix("[TOOL_CALLS]").strip())


class PythonicParser(_WholeReplyParser):
    name = "pythonic"
    markers = ("[", "```")
    _FENCE = re.compile(r"^```(?:tool_code|python)?\s*\n?(.*?)\n?```$", re.S)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        m = self._FENCE.match(text)
        if m:
            text = m.group(1).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, SyntaxError):
                return None
            calls.append(ToolCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
        return calls or None


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "json": JsonCallsParser,
}


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(sorted(PARSERS))})") from None


def parser_for_template(template: str | None) -> str:
    """The family a chat template's own tool format belongs to; hermes (shoal's format) otherwise."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "respond with a JSON for a function call" in t:
        return "llama3_json"
    if "[func_name1(" in t or "tool_code" in t:
        return "pythonic"
    return "hermes"


# ---------------------------------------------------------------- tools into the prompt

MANUAL_TOOLS_PROMPT = (
    "You can call these tools. To call one, write\n"
    '<tool_call>{{"name": "<the tool\'s name>", "arguments": {{<its arguments>}}}}</tool_call>\n'
    "once per call, and nothing after your calls. The tools, as JSON:\n{tools}"
)


def manual_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template without tool support: the tools in the system prompt (shoal's format,
    parsed by `hermes`), assistant calls and tool results written into the text."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    prompt = MANUAL_TOOLS_PROMPT.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = "".join(
                "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False) + "</tool_call>"
                for c in calls
            )
            m["content"] = (m.get("content") or "") + blocks
        if m["role"] == "tool" and isinstance(m["content"], list):  # text and image parts (a vision model's)
            m["content"] = [{"type": "text", "text": "<tool_response>\n"}, *m["content"], {"type": "text", "text": "\n</tool_response>"}]
        elif m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI-style calls for a chat template: arguments as an object where they are one
    (templates write `arguments | tojson`), the text otherwise."""
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        out.append({**c, "type": "function", "function": fn})
    return out


def check_function_tools(tools: list, type_required: bool = True) -> None:
    """OpenAI's function tools, `[{"type": "function", "function": {"name": ..., "parameters": ...}}]`, as chat
    completions and Ollama take them: a 400 naming the first that is not one. type_required: False where the
    protocol lets "type" be left out (Ollama's)."""
    from shoal.server.errors import bad_request  # noqa: PLC0415 (the parsers above need no HTTP)

    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        kind = t.get("type", None if type_required else "function") if isinstance(t, dict) else None
        if kind != "function" or not isinstance(fn, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)", f"tools[{i}].function.parameters")


def forced_calls_schema(tools: list[dict], name: str | None = None, parallel: bool = True) -> dict:
    """The JSON schema of a forced reply: a list of calls to the tools (one named tool when
    `name` is given), each `{"name", "arguments"}` with the tool's parameters."""
    from shoal.json_schema import forced_tool_call_schema

    defs = [{"name": t["name"], "parameters": t.get("parameters")} for t in tools if name is None or t["name"] == name]
    return {"type": "array", "items": forced_tool_call_schema(defs), "minItems": 1, **({} if parallel and name is None else {"maxItems": 1})}
