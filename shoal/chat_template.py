"""Render a conversation into the prompt text, and that into token ids.

The template is, in order of preference: `--chat-template FILE`, the model's
own (GGUF metadata or tokenizer config, which the loader puts on the
tokenizer), or a plain fallback for models that have none. transformers'
tokenizer machinery renders it (its sandboxed Jinja environment, with
`raise_exception`, `strftime_now` and the tokenizer's special tokens), so
system messages go wherever the model's template puts them.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

# For models without a template: role-labelled turns, then "Assistant:". The
# stop string keeps a base model from writing the user's next turn.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + '\n' }}"
    "{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
FALLBACK_STOP = ("\nUser:",)


def _reserved_names(tokenizer) -> frozenset[str]:
    """apply_chat_template's own parameters (tokenize, chat_template, ...) and the variables it sets, but
    add_generation_prompt, a template variable clients set."""
    names = _RESERVED.get(type(tokenizer))
    if names is None:
        params = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters)
        names = (params | {"messages"}) - {"add_generation_prompt", "kwargs"}
        _RESERVED[type(tokenizer)] = names
    return names


_RESERVED: dict[type, frozenset[str]] = {}
_SENTINEL = "shoalProbe7Q"


def _parts(content) -> list[dict]:
    """A string content as template parts (None: none)."""
    return [{"type": "text", "text": content}] if content else []


class ChatRenderer:
    def __init__(self, tokenizer, template_file: Path | None = None) -> None:
        self.tokenizer = tokenizer
        if template_file is not None:
            self.template = Path(template_file).read_text()
            self.source = f"file {template_file}"
        elif getattr(tokenizer, "chat_template", None):
            self.template = None  # the tokenizer's own
            self.source = "the model's"
        else:
            self.template = FALLBACK_TEMPLATE
            self.source = "the plain fallback"
        self.is_fallback = self.template is FALLBACK_TEMPLATE
        self.template_source = self.template if self.template is not None else tokenizer.chat_template
        if isinstance(self.template_source, dict):  # several named templates: the default one
            self.template_source = self.template_source.get("default") or next(iter(self.template_source.values()), "")
        # The template renders tool definitions itself ("template native"); otherwise they go
        # into the system prompt in shoal's own format (chat/tools.py, "manual").
        self.supports_tools = "tools" in (self.template_source or "")

    @property
    def default_stop(self) -> tuple[str, ...]:
        return FALLBACK_STOP if self.is_fallback else ()

    def render(self, messages: Sequence[dict[str, Any]], tools: list | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text, ready for the assistant's turn.

        `template_kwargs` are extra template variables (chat_template_kwargs);
        add_generation_prompt among them is honoured. Raises ValueError if one
        of them is a name the renderer passes itself (messages, tools, tokenize,
        ...), or if the template refuses.
        """
        import jinja2

        kwargs = dict(template_kwargs or {})
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        # Template variables only: nothing that would replace the messages or tools, or change how apply_chat_template works.
        taken = sorted(k for k in kwargs if k in _reserved_names(self.tokenizer))
        if taken:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server passes "
                f"{'it' if len(taken) == 1 else 'them'} to the template itself (messages and tools come from the request's own fields)"
            )
        if self.wants_parts:
            messages = [m if isinstance(m.get("content"), list) else {**m, "content": _parts(m.get("content"))} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template ({self.source}) refused the messages: {e}") from e
        return text

    @cached_property
    def wants_parts(self) -> bool:
        """Whether the template reads a message's content as a list of parts only (SmolVLM's: a string's text
        would be dropped without an error). Then every string content goes to it as one text part."""
        import jinja2

        probe = [{"role": "user", "content": _SENTINEL}]
        try:
            as_string = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, chat_template=self.template)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError):
            as_string = ""
        if _SENTINEL in as_string:
            return False
        try:
            as_parts = self.tokenizer.apply_chat_template([{"role": "user", "content": _parts(_SENTINEL)}], tokenize=False,
                                                          add_generation_prompt=True, chat_template=self.template)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError):
            return False
        return _SENTINEL in as_parts

    @cached_property
    def tool_call_layout(self) -> tuple[str, str, str] | None:
        """How this template writes `<tool_call>` blocks: (the text before a call's JSON, after
        it, between two blocks), found by rendering two probe calls; None when it writes them
        otherwise than `{"name": ..., "arguments": ...}` with JSON's usual separators.
        Forced tool calls are generated in exactly this layout (chat/render.py, ToolUse)."""
        if not self.supports_tools:
            return ("<tool_call>", "</tool_call>", "")  # shoal's own format (tools.manual_tool_messages)
        calls = [{"id": f"probe{i}", "type": "function", "function": {"name": f"shoal_probe_{i}", "arguments": {"x": i}}} for i in (1, 2)]
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        tools = [{"type": "function", "function": {"name": f"shoal_probe_{i}", "parameters": {"type": "object"}}} for i in (1, 2)]
        try:
            text = self.render(probe, tools=tools, template_kwargs={"add_generation_prompt": False})
        except ValueError:
            return None
        one, two = (json.dumps({"name": f"shoal_probe_{i}", "arguments": {"x": i}}) for i in (1, 2))
        i, j = text.find(one), text.find(two)
        open_, close = "<tool_call>", "</tool_call>"
        if not 0 <= i < j:
            return None
        start, end, start2 = text.rfind(open_, 0, i), text.find(close, i), text.rfind(open_, 0, j)
        if not 0 <= start < end < start2:
            return None
        return text[start:i], text[i + len(one) : end + len(close)], text[end + len(close) : start2]

    def encode(self, text: str) -> list[int]:
        # The rendered text already holds every special token the template wants (BOS included).
        return list(self.tokenizer.encode(text, add_special_tokens=False))
