"""The docs' generated parts, and the MkDocs hook that puts them in the site.

The reference pages hold markers such as `<!-- reference: cli -->`; at build time each
is replaced by a page generated from the code itself, so the reference cannot drift:

- `cli`: every subcommand, flag, default and choice, from shoal's argparse parser;
- `http`: every route, its request body, statuses and schemas, from the app's OpenAPI document;
- `metrics`: every metric family `/metrics` serves, with its type, labels and meaning,
  from the catalog the metrics module builds its registry with.

The benchmark results (`benchmarks/results/*.md`) and the full notes
(`benchmarks/NOTES.md`) are written by the benchmarks where they run; the hook brings
them into the site under `benchmarks/`, so the pages link them and a strict build checks
those links too.

`mkdocs.yml` names this file under `hooks:`; the tests import it to compare the
generated pages with the code in both directions.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*reference:\s*(\w+)\s*-->")


# ---------------------------------------------------------------- the command line


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.dest.upper()}`"  # a positional: its name
    value = ""
    if action.choices:
        value = " \\| ".join(f"`{c}`" for c in action.choices)
    elif action.nargs == 0:
        value = "(switch)"
    elif action.metavar:
        metavar = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
        value = f"`{metavar}`" + (" …" if action.nargs in ("+", "*") else "")
    elif action.option_strings:
        value = f"`{action.dest.upper()}`"
    if isinstance(action, argparse._AppendAction):
        value += " (repeatable)"
    return f"| {names} | {value} | {_cell(action.help or '')} |"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """shoal's subcommands by name, in the parser's order."""
    if parser is None:
        from shoal.cli import build_parser

        parser = build_parser()
    return dict(_subparsers(parser).choices.items())


def cli_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string a (sub)parser takes, `-h`/`--help` aside."""
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def cli_reference() -> str:
    from shoal.cli import build_parser

    parser = build_parser()
    subs = subcommands(parser)
    helps = {a.dest: a.help for a in _subparsers(parser)._choices_actions}
    out = ["Generated from `shoal`'s argument parser when the docs are built. `shoal COMMAND --help` prints the same.", ""]
    out += ["| command | what it does |", "|---|---|"]
    out += [f"| [`shoal {name}`](#shoal-{name}) | {_cell(helps.get(name, ''))} |" for name in subs]
    out += ["", "`shoal --log-level debug|info|warning|error COMMAND` sets the logging detail for any command.", ""]
    for name, p in subs.items():
        out += [f"## shoal {name} {{#shoal-{name}}}", "", f"```\n{p.format_usage().strip()}\n```", ""]
        if p.description or helps.get(name):
            out += [p.description or helps[name], ""]
        for group in p._action_groups:
            actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            title = group.title if group.title not in ("options", "optional arguments") else "options"
            out += [f"**{title}**", "", "| flag | value | meaning |", "|---|---|---|"]
            out += [_flag_row(a) for a in actions]
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- the HTTP API


def app():
    """An app that has not loaded (nor will load) a model: its routes are all there."""
    from shoal.config import EngineConfig
    from shoal.server.app import create_app

    return create_app(EngineConfig())


def openapi() -> dict:
    """The app's OpenAPI document."""
    return app().openapi()


# FastAPI's own pages, outside the OpenAPI document.
FASTAPI_ROUTES = {
    "/openapi.json": "This API's OpenAPI document.",
    "/docs": "The interactive API page (Swagger UI) over the OpenAPI document.",
    "/docs/oauth2-redirect": "Swagger UI's OAuth2 redirect page.",
}


def app_routes(application=None) -> dict[tuple[str, str], str]:
    """Every (method, path) the app answers, from its route table, with what the route says of
    itself. HEAD is left out: it answers wherever GET does."""

    def walk(routes):
        for r in routes:
            if hasattr(r, "path"):
                yield r
            else:  # an included router
                yield from walk(getattr(r, "original_router", r).routes)

    found = {}
    for r in walk((application or app()).routes):
        for m in getattr(r, "methods", None) or ():
            if m != "HEAD":
                path = re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path)  # {name:path} reads as OpenAPI writes it: {name}
                found[(m, path)] = (getattr(r, "description", "") or getattr(r, "summary", "") or FASTAPI_ROUTES.get(r.path, "")).strip()
    return found


METHODS = ("get", "post", "put", "patch", "delete")


def routes(doc: dict | None = None) -> list[tuple[str, str]]:
    doc = doc or openapi()
    return [(m.upper(), path) for path, ops in doc["paths"].items() for m in METHODS if m in ops]


def _label(name: str) -> str:
    """A schema's name as a reader sees it: `ErrorResponse (anthropic)` for the protocols' same-named models."""
    parts = name.split("__")
    return f"{parts[-1]} ({parts[-3]})" if len(parts) >= 3 else name


def _type(schema: dict) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{_label(name)}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_type(s) for s in schema[key]))
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _type(schema["allOf"][0])
    t = schema.get("type")
    if t == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    return t or "any"


def _first_sentence(text: str) -> str:
    return text.strip().split(": ")[0].split("\n")[0]


def _anchor(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def http_reference() -> str:
    application = app()
    doc = application.openapi()
    out = [f"Generated from the app's OpenAPI document (`GET /openapi.json`, version {doc['info']['version']}) when the "
           "docs are built. The server also serves it live, with an interactive page at `/docs`.", ""]
    out += ["| method | path | what it does |", "|---|---|---|"]
    for method, path in routes(doc):
        op = doc["paths"][path][method.lower()]
        out.append(f"| {method} | [`{path}`](#{_anchor(method, path)}) | {_cell(_first_sentence(op.get('description') or op.get('summary', '')))} |")
    out.append("")
    for method, path in routes(doc):
        op = doc["paths"][path][method.lower()]
        out += [f"## {method} {path} {{#{_anchor(method, path)}}}", ""]
        if op.get("description"):
            out += [op["description"].strip(), ""]
        for param in op.get("parameters", []):
            out.append(f"- {param['in']} parameter `{param['name']}`{' (required)' if param.get('required') else ''}: "
                       f"{_type(param.get('schema', {}))}")
        body = op.get("requestBody", {}).get("content", {})
        for media, content in body.items():
            out.append(f"- request body ({media}): {_type(content.get('schema', {}))}")
        out += ["", "| status | meaning | body |", "|---|---|---|"]
        for status, resp in op.get("responses", {}).items():
            schemas = [_type(c["schema"]) for c in resp.get("content", {}).values() if c.get("schema")]
            out.append(f"| {status} | {_cell(resp.get('description', ''))} | {' or '.join(dict.fromkeys(schemas))} |")
        out.append("")
    documented = set(routes(doc))
    others = {k: v for k, v in app_routes(application).items() if k not in documented}
    out += ["## Routes outside the OpenAPI document", "", "| method | path | what it does |", "|---|---|---|"]
    out += [f"| {m} | `{p}` | {_cell(what)} |" for (m, p), what in sorted(others.items(), key=lambda kv: kv[0][1])]
    out += ["", "## Schemas", ""]
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += [f"### {_label(name)} {{#{name.lower()}}}", ""]
        if schema.get("description"):
            out += [schema["description"].strip(), ""]
        props = schema.get("properties", {})
        if props:
            required = set(schema.get("required", ()))
            out += ["| field | type | required | meaning |", "|---|---|---|---|"]
            for field, fs in props.items():
                out.append(f"| `{field}` | {_type(fs)} | {'yes' if field in required else ''} | {_cell(fs.get('description', ''))} |")
        else:
            out.append(f"Type: {_type(schema)}")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- metrics


def metrics_reference() -> str:
    from shoal.server.metrics import catalog

    families = catalog()
    out = ["Generated from the catalog `shoal/server/metrics.py` builds `/metrics` from, when the docs are built. "
           "Counters are shown with the `_total` suffix they carry on the wire; a histogram has `_bucket`, `_sum` "
           "and `_count` series.", ""]
    for title, own in (("shoal's metrics", True), ("Process and runtime (prometheus_client's collectors)", False)):
        out += [f"## {title}", "", "| name | type | labels | meaning |", "|---|---|---|---|"]
        for f in families:
            if f.name.startswith("shoal:") == own:
                shown = f"`{f.name}_total`" if f.type == "counter" else f"`{f.name}`"
                labels = ", ".join(f"`{label}`" for label in f.labels)
                out.append(f"| {shown} | {f.type} | {labels} | {_cell(f.help)} |")
        out.append("")
    return "\n".join(out)


GENERATORS = {"cli": cli_reference, "http": http_reference, "metrics": metrics_reference}


# ---------------------------------------------------------------- the MkDocs hook


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


def on_files(files, config):
    """The benchmarks' own pages into the site, where the docs link them."""
    from mkdocs.structure.files import File

    bench = ROOT / "benchmarks"
    pages = [(p, f"benchmarks/results/{p.name}") for p in sorted((bench / "results").glob("*.md"))]
    pages.append((bench / "NOTES.md", "benchmarks/NOTES.md"))
    for src, dest in pages:
        files.append(File.generated(config, dest, abs_src_path=str(src)))
    return files
