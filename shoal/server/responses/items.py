"""A Responses request's items and options -> what the shared chat pipeline (server/chat/) takes.

- `normalize_input`: `input` as a string or items, each item checked and given its id (as stored and as
  `GET /v1/responses/{id}/input_items` lists them): messages with their content as parts, function_call,
  function_call_output and reasoning items.
- `conversation`: items -> the template's message dicts and the images in them. A run of reasoning,
  assistant message and function_call items is one assistant turn (reasoning_content, content, tool_calls),
  which is what the model generated: a continued turn's prompt extends the previous one, token for token, so
  the prefix cache holds its KV. A function_call_output is a `tool` turn answering an earlier call's id.
- `tool_use`: flat function tools (`{"type": "function", "name", "parameters"}`) -> chat's ToolUse; OpenAI's
  built-in tools are refused by name.
- `output_format`: `text.format` -> a structured-output constraint; `reasoning_options`: `reasoning.effort`
  -> the template's thinking switch and the thinking budget.
"""

from __future__ import annotations

import dataclasses
import uuid

from shoal.server.chat.images import IMAGE_PART, ImageRef, template_content
from shoal.server.chat.params import constraint
from shoal.server.chat.reasoning import thinking_budget
from shoal.server.chat.render import ToolUse
from shoal.server.errors import bad_request
from shoal.types import StructuredOutput, ThinkingBudget

_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
_ROLES = {"user", "system", "developer", "assistant"}
# OpenAI's hosted tools: they run on OpenAI's side, and a local server has none of them.
BUILTIN_TOOLS = {
    "web_search": "web search", "web_search_preview": "web search", "web_search_2025_08_26": "web search",
    "web_search_preview_2025_03_11": "web search", "file_search": "file search", "computer_use_preview": "computer use",
    "computer": "computer use", "computer_use": "computer use", "code_interpreter": "code interpreter",
    "image_generation": "image generation", "mcp": "remote MCP", "local_shell": "local shell", "shell": "shell",
    "apply_patch": "apply patch", "custom": "custom (free-form) tools",
}


def new_item_id(kind: str) -> str:
    return f"{_ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex[:24]}"


def _name(value) -> str | None:
    """A field that names a kind (a type, a role): the string, or None for anything else (never looked up as a key)."""
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- input items


def normalize_input(value) -> list[dict]:
    """The request's input as items, each checked and with an id (the client's, or a new one)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(role: str, content: list[dict], item_id: str | None = None) -> dict:
    return {"id": item_id or new_item_id("message"), "type": "message", "role": role, "content": content, "status": "completed"}


def _string(item: dict, key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise bad_request(f"{where}.{key} must be a {'' if empty else 'non-empty '}string", f"{where}.{key}")
    return value


def _item(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object (an input item)", where)
    kind = _name(item.get("type", "message"))  # an "easy" message has a role and content, and no type
    item_id = item.get("id")
    if item_id is not None and not isinstance(item_id, str):
        raise bad_request(f"{where}.id must be a string", f"{where}.id")
    if kind == "message":
        role = _name(item.get("role"))
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(sorted(_ROLES))}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, str):
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": content}]
        elif not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content parts", f"{where}.content")
        return _message(role, [_part(p, role, f"{where}.content[{j}]") for j, p in enumerate(content)], item_id)
    if kind == "function_call":
        out = {"id": item_id or new_item_id(kind), "type": kind, "call_id": _string(item, "call_id", where),
               "name": _string(item, "name", where), "arguments": _string(item, "arguments", where, empty=True), "status": "completed"}
        return out
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = [_part(p, "tool", f"{where}.output[{j}]") for j, p in enumerate(output)]
        elif not isinstance(output, str):
            raise bad_request(f"{where}.output must be a string or a list of content parts", f"{where}.output")
        return {"id": item_id or new_item_id(kind), "type": kind, "call_id": _string(item, "call_id", where), "output": output,
                "status": "completed"}
    if kind == "reasoning":
        texts = []
        for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key) or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
                raise bad_request(f"{where}.{key} must be a list of {{\"type\": \"{part_kind}\", \"text\": ...}} parts", f"{where}.{key}")
            texts.append([{"type": part_kind, "text": p["text"]} for p in parts])
        return {"id": item_id or new_item_id(kind), "type": kind, "content": texts[0], "summary": texts[1]}
    if kind == "item_reference":
        raise bad_request(f"{where} is an item_reference, which this server does not resolve: send the item itself, "
                          "or continue with previous_response_id", f"{where}.type")
    raise bad_request(f"{where}.type {kind!r} is not supported: expected message, function_call, function_call_output "
                      "or reasoning", f"{where}.type")


def _part(part, role: str, where: str) -> dict:
    kind = _name(part.get("type")) if isinstance(part, dict) else None
    if kind in _TEXT_PARTS or (role == "assistant" and kind == "refusal"):
        key = "refusal" if kind == "refusal" else "text"
        return {"type": kind, key: _string(part, key, where, empty=True)}
    if kind == "input_image":
        if role == "assistant":
            raise bad_request(f"{where} is an input_image in an assistant message", f"{where}.type")
        if part.get("file_id") is not None:
            raise bad_request(f"{where}.file_id: this server has no Files API; send the image as image_url "
                              "(a data: URI, or an http(s) or file: URL the server allows)", f"{where}.file_id")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url must be a URL string (data:, http(s) or file:)", f"{where}.image_url")
        detail = part.get("detail")
        return {"type": kind, "image_url": url, **({"detail": detail} if detail is not None else {})}
    if kind in ("input_file", "input_audio"):
        raise bad_request(f"{where} is an {kind} part, which this server does not take", f"{where}.type")
    raise bad_request(f"{where}.type {kind!r} is not supported (use input_text or input_image)", f"{where}.type")


# ---------------------------------------------------------------- items -> the template's messages


def conversation(items: list[dict], instructions: str | None, images: list[ImageRef], first_input: int = 0) -> list[dict]:
    """Items (normalized: a stored conversation's, then from `first_input` on this request's input) -> the
    template's message dicts; each image part is listed in `images`, in order. A call's output must answer a
    function_call that came before it."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None  # the assistant turn being gathered
    calls: set[str] = set()
    for i, item in enumerate(items):
        at = f"input[{i - first_input}]" if i >= first_input else f"previous_response_id's item {i}"
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            turn = None
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _content(item["content"], at + ".content", images)})
            continue
        if kind == "function_call_output":
            turn = None
            if item["call_id"] not in calls:
                raise bad_request(f"{at}.call_id {item['call_id']!r} answers no function_call before it", f"{at}.call_id")
            output = item["output"]
            content = output if isinstance(output, str) else _content(output, at + ".output", images)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
            continue
        # reasoning, an assistant message and function calls: one assistant turn until something else comes
        if turn is None or (kind == "reasoning" and (turn["content"] or turn.get("tool_calls"))):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        if kind == "reasoning":
            text = "\n".join(p["text"] for p in item["content"] or item["summary"])
            turn["reasoning_content"] = (turn.get("reasoning_content", "") + "\n" + text).lstrip("\n")
        elif kind == "message":
            texts = [p.get("text") or p.get("refusal") or "" for p in item["content"]]
            turn["content"] += "".join(texts)
        else:  # function_call
            calls.add(item["call_id"])
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}})
    return out


def _content(parts: list[dict], where: str, images: list[ImageRef]) -> str | list[dict]:
    shown: list[dict] = []
    for j, p in enumerate(parts):
        if p["type"] == "input_image":
            images.append(ImageRef(f"{where}[{j}]", "input_image part", url=p["image_url"], detail=p.get("detail")))
            shown.append(IMAGE_PART)
        else:
            shown.append({"type": "text", "text": p.get("text", "")})
    return template_content(shown)


# ---------------------------------------------------------------- tools


def tool_use(tools: list[dict] | None, choice, parallel: bool | None) -> ToolUse | None:
    """The request's function tools and tool_choice, checked; None when the model sees no tools."""
    defs = []
    for i, t in enumerate(tools or []):
        kind = _name(t.get("type"))
        if kind in BUILTIN_TOOLS:
            raise bad_request(f"tools[{i}] is OpenAI's built-in {kind!r} tool ({BUILTIN_TOOLS[kind]}), which this server does not "
                              "run: give function tools, and run the tool in your own code", f"tools[{i}].type")
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: only function tools", f"tools[{i}].type")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema (an object)", f"tools[{i}].parameters")
        description = t.get("description")
        fn = {"name": name, **({"description": description} if isinstance(description, str) else {}),
              "parameters": params if params is not None else {"type": "object", "properties": {}}}
        defs.append({"type": "function", "function": fn})
    named = None
    if isinstance(choice, dict):
        kind = _name(choice.get("type"))
        if kind in BUILTIN_TOOLS:
            raise bad_request(f"tool_choice names OpenAI's built-in {kind!r} tool, which this server does not run", "tool_choice.type")
        named = choice.get("name")
        if kind != "function" or not isinstance(named, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")
    if not defs:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice forces a tool call, but the request has no tools", "tool_choice")
        return None
    if choice == "none":
        return None  # the tools are hidden from the model
    if named is not None:
        if named not in {d["function"]["name"] for d in defs}:
            raise bad_request(f"tool_choice names the function {named!r}, which is not among the tools", "tool_choice.name")
        return ToolUse(tuple(defs), "named", named, parallel=False)
    return ToolUse(tuple(defs), "required" if choice == "required" else "auto", parallel=parallel is not False)


# ---------------------------------------------------------------- text.format and reasoning.effort


def output_format(text: dict | None) -> tuple[StructuredOutput | None, str | None]:
    """`text.format` -> the constraint and the field that gave it (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, None
    if kind == "json_object":
        return StructuredOutput(json_object=True), "text.format"
    if kind != "json_schema":
        raise bad_request("text.format must be an object with type 'text', 'json_object' or 'json_schema'", "text.format")
    name = fmt.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("text.format.name must be a string", "text.format.name")
    if "schema" not in fmt:
        raise bad_request("text.format.schema is required with type 'json_schema'", "text.format.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("text.format.strict must be true or false", "text.format.strict")
    return dataclasses.replace(constraint("json", fmt["schema"], "text.format.schema"), strict=bool(strict)), "text.format.schema"


# reasoning.effort -> the most tokens the reasoning may take (None: no cap, the reply's max_output_tokens alone).
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None}


def reasoning_options(served, reasoning: dict | None) -> tuple[dict, ThinkingBudget | None]:
    """`reasoning.effort` -> the template's kwargs (`enable_thinking`, and `reasoning_effort` for templates that
    read it) and a thinking budget, for a model whose reasoning the server knows how to find (--reasoning-parser).
    "none" turns thinking off; no effort leaves the template's default."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning.effort must be a string", "reasoning.effort")
    if effort is None:
        return {}, None
    if effort != "none" and effort not in EFFORT_BUDGETS:
        raise bad_request(f"reasoning.effort must be one of none, {', '.join(EFFORT_BUDGETS)}", "reasoning.effort")
    if effort == "none":
        return {"enable_thinking": False}, None
    kwargs = {"enable_thinking": True, "reasoning_effort": effort}
    cap = EFFORT_BUDGETS[effort]
    return kwargs, (thinking_budget(served, cap) if cap is not None else None)
