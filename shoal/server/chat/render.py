"""A conversation (the template's message dicts) and its tools -> the prompt's text and token ids.

Protocol-neutral: the OpenAI and Anthropic adapters both translate into message dicts
(roles system/user/assistant/tool, string content, OpenAI-style `tool_calls` on
assistant turns) and OpenAI-style function definitions, then call `render_messages`.
Blocking work: call it in a worker thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from shoal import json_schema
from shoal.json_schema import forced_tool_call_schema
from shoal.server.chat.tools import forced_calls_schema, manual_tool_messages, parser_for_template, template_tool_calls
from shoal.server.errors import bad_request
from shoal.types import StructuredOutput


@dataclass(frozen=True)
class ToolUse:
    """What a request does with its tools.

    mode: "auto" (the model decides; its text is parsed for calls), "required" (at least
    one call), "named" (a call to `name`). The forced modes constrain the reply with a
    grammar (structured output), so it is always well formed: for a template that writes
    calls as `<tool_call>` blocks (and for shoal's own format), the blocks exactly as the
    template renders them, so the next turn's prompt starts with the very tokens the
    model generated and the prefix cache covers them; for other families, a JSON list of
    `{"name", "arguments"}`.
    """

    tools: tuple[dict, ...]  # OpenAI-style: {"type": "function", "function": {"name", "description", "parameters"}}
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "auto"

    def parser_name(self, served) -> str:
        family = served.settings.tool_call_parser or parser_for_template(served.renderer.template_source)
        if self.forced and (family not in ("hermes", "qwen") or served.renderer.tool_call_layout is None):
            return "json"
        return family

    def constraint(self, served) -> StructuredOutput | None:
        if not self.forced:
            return None
        defs = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")} for t in self.tools
                if self.name is None or t["function"]["name"] == self.name]
        parallel = self.parallel and self.name is None
        if self.parser_name(served) == "json":
            return StructuredOutput(json_schema=json.dumps(forced_calls_schema(defs, self.name, self.parallel)))
        before, after, between = served.renderer.tool_call_layout
        # compact, as the template's json.dumps writes a call: the next turn's prompt then repeats the generated tokens
        schema = {**json_schema.prepare(forced_tool_call_schema(defs)), "x-guidance": json_schema.COMPACT}
        more = f" ({json.dumps(between)} call)*" if parallel else ""
        lark = f"start: call{more}\ncall: {json.dumps(before)} body {json.dumps(after)}\nbody: %json {json.dumps(schema)}\n"
        return StructuredOutput(grammar=lark)


# A token spans at most as many characters as the longest vocabulary entry
# (byte-level BPE spells each byte as one character, so this over-counts);
# normalization can merge a few code points into one (NFC/NFKC composition),
# hence the slack.
NORMALIZATION_SLACK = 4


def content_chars(content) -> int:
    """Characters of a message's text, whether its content is a string or template parts (with images)."""
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return len(content or "")


@lru_cache(maxsize=8)
def _longest_token_chars(tokenizer) -> int:
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def max_prompt_chars(served) -> int:
    """More characters than this cannot fit the context, whatever they are (see NORMALIZATION_SLACK)."""
    return served.engine.max_model_len * _longest_token_chars(served.engine.tokenizer) * NORMALIZATION_SLACK


def check_prompt_chars(served, num_chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context before spending time tokenizing it."""
    limit = max_prompt_chars(served)
    if num_chars > limit:
        raise bad_request(
            f"the prompt has {num_chars} characters: more than {limit}, so it cannot fit "
            f"the context of {served.engine.max_model_len} tokens",
            param,
        )


def render_messages(served, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    add_generation_prompt: bool | None = None, param: str = "messages") -> tuple[str, list[int]]:
    """The prompt text and its token ids. `tools`: the definitions the model sees (None: none)."""
    # The rendered text holds every message's content: too much of it cannot fit.
    check_prompt_chars(served, sum(content_chars(m.get("content")) for m in messages), param)
    messages = [{**m, "tool_calls": template_tool_calls(m["tool_calls"])} if m.get("tool_calls") else m for m in messages]
    renderer = served.renderer
    if tools and not renderer.supports_tools:
        messages, tools = manual_tool_messages(messages, tools), None
    kwargs = dict(template_kwargs or {})
    if add_generation_prompt is not None:
        kwargs["add_generation_prompt"] = add_generation_prompt
    try:
        text = renderer.render(messages, tools=tools or None, template_kwargs=kwargs)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    check_prompt_chars(served, len(text), param)
    return text, renderer.encode(text)


class TokenStrings:
    """A token id's text as logprobs show it (the decoded piece, special tokens included)."""

    def __init__(self, tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
