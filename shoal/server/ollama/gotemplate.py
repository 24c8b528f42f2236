"""The part of Go's text/template that a generate request's `template` uses: Ollama renders its prompts with Go
templates, and a client may send one (`POST /api/generate` with `template`). Plain Python, no dependency.

Run: text; `{{ .Name }}` (a field: `.System`, `.Prompt`, `.Response`, `.Suffix`; a missing one is empty);
`{{ if .Name }}`...`{{ else if .Name }}`...`{{ else }}`...`{{ end }}` (true when the field is not empty);
comments `{{/* ... */}}`; and Go's whitespace trimming, `{{- ` and ` -}}`, which drop the white space before or
after an action. Anything else (`range`, `with`, variables, functions, pipelines: what chat templates over
`.Messages` use) is a ValueError naming it, so a template is either rendered as Go would or refused in words.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_FIELD = re.compile(r"\.([A-Za-z_]\w*)")


def render(template: str, fields: dict[str, str]) -> str:
    """`template` with `fields` (Go's dot: {"System": ..., "Prompt": ...}); ValueError for what it does not run."""
    nodes = _parse(_tokens(template))
    out: list[str] = []
    _run(nodes, fields, out)
    return "".join(out)


def _tokens(template: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)], with Go's trim markers applied to the neighbouring text."""
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        if text:
            out.append(("text", text))
        out.append(("action", m.group(2).strip()))
        pos, trim_next = m.end(), bool(m.group(3))
    text = template[pos:]
    if trim_next:
        text = text.lstrip()
    if text:
        out.append(("text", text))
    return out


def _field(expr: str) -> str:
    m = _FIELD.fullmatch(expr.strip())
    if m is None:
        raise ValueError(f"template: {{{{ {expr.strip()} }}}} is not a field like .Prompt; shoal runs fields, if/else "
                         "and comments of Go's templates, not functions, variables or range")
    return m.group(1)


def _parse(tokens: list[tuple[str, str]]):
    """Nodes: ("text", s), ("field", name), ("if", [(field, nodes), ...], else_nodes)."""
    stack: list[list] = [[]]  # the node lists being filled
    branches: list[list] = []  # per open `if`: [(field, nodes), ...] and, last, the else nodes or None
    for kind, body in tokens:
        if kind == "text":
            stack[-1].append(("text", body))
            continue
        if body.startswith("/*") and body.endswith("*/"):
            continue
        word = body.split(None, 1)[0] if body else ""
        if word == "if":
            branch: list = []
            branches.append([[(_field(body[2:]), branch)], None])
            stack.append(branch)
        elif word == "else":
            if not branches:
                raise ValueError("template: {{ else }} outside an {{ if }}")
            stack.pop()
            rest = body[4:].strip()
            branch = []
            if rest.startswith("if "):
                branches[-1][0].append((_field(rest[3:]), branch))
            elif not rest:
                branches[-1][1] = branch
            else:
                raise ValueError(f"template: {{{{ {body} }}}} is not an else shoal runs")
            stack.append(branch)
        elif word == "end":
            if not branches:
                raise ValueError("template: {{ end }} without an {{ if }}")
            stack.pop()
            arms, otherwise = branches.pop()
            stack[-1].append(("if", arms, otherwise or []))
        elif word in ("range", "with", "define", "template", "block", "break", "continue"):
            raise ValueError(f"template: {{{{ {word} }}}} is not run here: shoal runs fields, if/else and comments of Go's "
                             "templates (send the whole prompt with \"raw\": true instead)")
        else:
            stack[-1].append(("field", _field(body)))
    if branches:
        raise ValueError("template: an {{ if }} has no {{ end }}")
    return stack[0]


def _run(nodes, fields: dict[str, str], out: list[str]) -> None:
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            out.append(str(fields.get(node[1]) or ""))
        else:
            _, arms, otherwise = node
            chosen = next((body for name, body in arms if fields.get(name)), otherwise)
            _run(chosen, fields, out)
