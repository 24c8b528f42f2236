"""Structured output that finishes: how many replies end as valid JSON for their schema, against llama-server.

26 schemas (nested objects, arrays of enums and of objects, numbers and integers, optional
fields, `format`s, `pattern`s, `anyOf`, `$ref`, two extractions), 5 seeds each, at temperatures 0, 0.7 and
1.0, `max_tokens` 256, through `response_format: {"type": "json_schema", "strict": true}` as
a user sends it. A reply counts when it finished by itself (`finish_reason: stop`) and
validates against its schema (`jsonschema`, formats checked). Each server serves the default
GGUF; the servers take turns. Besides the default configuration (the compact layout, and
`frequency_penalty` 0.5 for JSON replies), shoal is also run with the flexible layout (vLLM's
`disable_any_whitespace: false`), without the penalty, with a repetition penalty instead, and
with the schemas' arrays bounded (`maxItems`), to measure what each changes.

    .venv/bin/python benchmarks/structured_finish.py            # needs .peers/llama-server (make peers)
    .venv/bin/python benchmarks/structured_finish.py --quick    # 2 seeds
Writes benchmarks/results/structured_finish.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
from tqdm import tqdm

from compare_peers import LlamaServer, Server, Shoal
from publish import machine, machine_line, publish, table
from shoal.model.loader import resolve_model_path

TEMPERATURES = (0.0, 0.7, 1.0)
MAX_TOKENS = 256
IN_FLIGHT = 16

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def enum_array(*values: str) -> dict:
    return {"type": "array", "items": {"enum": list(values)}}


PERSON = obj({"name": S, "age": I})
CASES = [
    ("person", "Invent a person.", obj({"name": S, "age": I, "pets": enum_array("cat", "dog", "fish", "bird")})),
    ("city", "Describe Paris.", obj({"name": S, "country": S, "population": I})),
    ("book", "Recommend a classic novel.", obj({"title": S, "author": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                                "genres": enum_array("fiction", "mystery", "romance", "science fiction", "history")})),
    ("movie", "Describe a movie you like.", obj({"title": S, "year": I, "rating": {"type": "number", "minimum": 0, "maximum": 10},
                                                 "tags": enum_array("comedy", "drama", "action", "horror", "romance")})),
    ("product", "Describe a product for an online shop.", obj({"name": S, "price": N, "in_stock": B, "tags": {"type": "array", "items": S}})),
    ("address", "Write a postal address in the United States.", obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": S})),
    ("event", "Plan a birthday party.", obj({"name": S, "date": {"type": "string", "format": "date"}, "guests": I})),
    ("contact", "Give the contact details of a fictional dentist.", obj({"name": S, "email": {"type": "string", "format": "email"},
                                                                         "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{7,20}$"}})),
    ("recipe", "Give a simple pancake recipe.", obj({"name": S, "servings": I, "ingredients": {"type": "array", "items": obj({"item": S, "quantity": S})},
                                                    "steps": {"type": "array", "items": S}})),
    ("order", "Create an example order from an online store.", obj({"id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                                                                    "items": {"type": "array", "items": obj({"sku": S, "quantity": {"type": "integer", "minimum": 1}}), "minItems": 1},
                                                                    "total": N})),
    ("weather", "Report the weather in London today.", obj({"city": S, "temperature_c": N, "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                                            "humidity": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("profile", "Create a user profile for a forum.", obj({"username": S, "bio": S, "age": I, "website": {"type": "string", "format": "uri"}}, ["username"])),
    ("employee", "Describe an employee of a software company.", obj({"name": S, "department": obj({"name": S, "floor": I}),
                                                                     "skills": enum_array("python", "java", "sql", "design", "management")})),
    ("planet", "Describe the planet Saturn.", obj({"name": S, "moons": I, "has_rings": B, "diameter_km": N})),
    ("colors", "Name three colors.", {"type": "array", "items": S, "minItems": 3, "maxItems": 3}),
    ("shape", "Describe a geometric shape.", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": N}), obj({"kind": {"const": "square"}, "side": N})]}),
    ("family", "Describe a small family.", {"$defs": {"person": PERSON}, **obj({"surname": S, "parents": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                                                                               "children": {"type": "array", "items": {"$ref": "#/$defs/person"}}})}),
    ("status", "Report the status of a web service.", obj({"status": {"enum": ["ok", "degraded", "down"]}, "code": I, "version": {"const": "1.0"}})),
    ("account", "Suggest a username and a slogan for a new account.", obj({"username": {"type": "string", "minLength": 3, "maxLength": 12},
                                                                           "slogan": {"type": "string", "maxLength": 40}})),
    ("appointment", "Book a doctor's appointment.", obj({"title": S, "start": {"type": "string", "format": "date-time"}, "duration_minutes": I})),
    ("company", "Describe a technology company.", obj({"name": S, "founded": I, "ceo": PERSON,
                                                       "offices": {"type": "array", "items": obj({"city": S, "employees": I})}})),
    ("nickname", "Introduce a cat.", obj({"name": S, "nickname": {"type": ["string", "null"]}, "vaccinated": B})),
    ("coordinates", "Give the coordinates of Rome.", obj({"place": S, "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                          "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("lottery", "Pick lottery numbers.", obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 49}, "minItems": 6, "maxItems": 6}})),
    # Extraction: the answer is copied from the prompt, which a penalty over the prompt's tokens would discourage.
    ("extract-move", "Maria Gonzalez moved from Seville to Lyon in 2019. Extract the facts.",
     obj({"name": S, "from_city": S, "to_city": S, "year": I})),
    ("extract-invoice", "Invoice INV-2041 from Acme Tools: 3 hammers at 12.5 each, due 2025-03-01. Extract the invoice.",
     obj({"invoice": S, "vendor": S, "quantity": I, "unit_price": N, "due": {"type": "string", "format": "date"}})),
]
# What an extraction must copy from its prompt.
EXPECTED = {"extract-move": {"name": "Maria Gonzalez", "from_city": "Seville", "to_city": "Lyon", "year": 2019},
            "extract-invoice": {"invoice": "INV-2041", "vendor": "Acme Tools", "quantity": 3, "unit_price": 12.5, "due": "2025-03-01"}}


def bounded_arrays(schema: dict) -> dict:
    """The same schema with every array bounded: an enum's size, or 8 items."""
    out = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "array" and "maxItems" not in node:
                items = node.get("items", {})
                node["maxItems"] = len(items["enum"]) if isinstance(items, dict) and "enum" in items else 8
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(out)
    return out


# name -> (server, how the request carries the schema, what else it sends). shoal's default is the compact
# layout with frequency_penalty 0.5 for JSON replies; the others take one of those away, or add something.
VARIANTS = {
    "shoal": ("shoal", "response_format", {}),
    "shoal flexible": ("shoal", "structured_outputs", {"disable_any_whitespace": False}),
    "shoal, no frequency penalty (the old default)": ("shoal", "response_format", {"frequency_penalty": 0.0}),
    "shoal flexible, no frequency penalty": ("shoal", "structured_outputs", {"disable_any_whitespace": False, "frequency_penalty": 0.0}),
    "shoal, repetition_penalty 1.1 instead": ("shoal", "response_format", {"frequency_penalty": 0.0, "repetition_penalty": 1.1}),
    "shoal, arrays bounded": ("shoal", "bounded", {}),
    "llama-server": ("llama-server", "response_format", {}),
}


def body(case: tuple, how: str, extra: dict, temperature: float, seed: int) -> dict:
    name, prompt, schema = case
    out = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed}
    if how == "structured_outputs":
        layout = {k: v for k, v in extra.items() if k == "disable_any_whitespace"}
        out["structured_outputs"] = {"json": schema, **layout}
        out.update({k: v for k, v in extra.items() if k not in layout})
    else:
        sent = bounded_arrays(schema) if how == "bounded" else schema
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": sent, "strict": True}}
        out.update(extra)
    return out


def judge(schema: dict, reply: dict) -> tuple[str, str]:
    """(outcome, detail): ok, length (ran out of tokens), invalid JSON, or not valid for the schema."""
    choice = reply["choices"][0]
    text = choice["message"].get("content") or ""
    if choice.get("finish_reason") != "stop":
        return "length", text[-80:]
    try:
        doc = json.loads(text)
    except ValueError:
        return "not json", text[-80:]
    try:
        jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as e:
        return "invalid", e.message[:120]
    return "ok", ""


def run_variant(server: Server, variant: str, seeds: int, progress: bool) -> list[dict]:
    import httpx

    _, how, extra = VARIANTS[variant]
    jobs = [(case, t, s) for t in TEMPERATURES for case in CASES for s in range(seeds)]
    client = httpx.Client(base_url=server.base_url, timeout=600.0, trust_env=False)

    def one(job):
        case, t, s = job
        t0 = time.perf_counter()
        r = client.post("/chat/completions", json=body(case, how, extra, t, s))
        if r.status_code != 200:
            return {"schema": case[0], "temperature": t, "seed": s, "outcome": f"http {r.status_code}", "detail": r.text[:200], "tokens": 0}
        reply = r.json()
        outcome, detail = judge(case[2], reply)
        row = {"schema": case[0], "temperature": t, "seed": s, "outcome": outcome, "detail": detail,
               "tokens": reply["usage"]["completion_tokens"], "seconds": time.perf_counter() - t0,
               "text": reply["choices"][0]["message"].get("content")}
        if case[0] in EXPECTED:
            row["copied"] = outcome == "ok" and json.loads(row["text"]) == EXPECTED[case[0]]
        return row

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(tqdm(pool.map(one, jobs), total=len(jobs), desc=variant, disable=not progress, file=sys.stderr))
    client.close()
    return results


def summary(results: list[dict]) -> dict:
    out = {}
    for t in TEMPERATURES:
        rows = [r for r in results if r["temperature"] == t]
        ok = [r for r in rows if r["outcome"] == "ok"]
        out[str(t)] = {"n": len(rows), "ok": len(ok), "share": len(ok) / len(rows),
                       "tokens_mean": statistics.fmean(r["tokens"] for r in rows),
                       "tokens_ok_mean": statistics.fmean(r["tokens"] for r in ok) if ok else None,
                       "outcomes": {k: sum(r["outcome"] == k for r in rows) for k in sorted({r["outcome"] for r in rows})},
                       "extractions_exact": sum(bool(r.get("copied")) for r in rows), "extractions": sum("copied" in r for r in rows)}
    return out


def markdown(doc: dict) -> list[str]:
    lines = ["# Structured output that finishes", "", machine_line(doc["machine"]), "",
             f"{len(CASES)} schemas × {doc['seeds']} seeds × temperatures {', '.join(map(str, TEMPERATURES))}, `max_tokens` {MAX_TOKENS}, "
             f"{IN_FLIGHT} requests in flight, the default GGUF. A reply counts when it finished by itself and validates against "
             "its schema (`jsonschema`, formats checked). `benchmarks/structured_finish.py`.", "",
             "Finished valid, of the replies (tokens per reply, mean):", ""]
    header = ["configuration"] + [f"temperature {t}" for t in TEMPERATURES]
    rows = []
    for name, r in doc["variants"].items():
        s = r["summary"]
        rows.append([name] + [f"{s[str(t)]['ok']}/{s[str(t)]['n']} ({100 * s[str(t)]['share']:.0f}%), {s[str(t)]['tokens_mean']:.0f} tok" for t in TEMPERATURES])
    lines += table(header, rows)
    lines += ["", "The two extraction schemas, whose answer is copied from the prompt: replies exactly right, of the replies.", ""]
    rows = [[name] + [f"{r['summary'][str(t)]['extractions_exact']}/{r['summary'][str(t)]['extractions']}" for t in TEMPERATURES]
            for name, r in doc["variants"].items()]
    lines += table(header, rows)
    lines += ["", "How the others failed, per configuration and temperature:", ""]
    rows = []
    for name, r in doc["variants"].items():
        for t in TEMPERATURES:
            bad = {k: v for k, v in r["summary"][str(t)]["outcomes"].items() if k != "ok"}
            if bad:
                rows.append([name, str(t), ", ".join(f"{k} {v}" for k, v in bad.items())])
    lines += table(["configuration", "temperature", "failures"], rows)
    default = doc["variants"].get("shoal")
    if default is not None:
        lines += ["", "Every failure of shoal's default configuration, at any temperature:", ""]
        rows = [[x["schema"], str(x["temperature"]), str(x["seed"]), x["outcome"],
                 "`" + (x["detail"] or "").replace("|", "\\|").replace("\n", "⏎")[-70:] + "`"]
                for x in default["results"] if x["outcome"] != "ok"]
        lines += table(["schema", "temperature", "seed", "outcome", "the reply's end, or the validation error"], rows) if rows else ["None."]
    lines += ["", "Every failure at temperature 0 (each seed gives the same greedy reply):", ""]
    rows = []
    for name, r in doc["variants"].items():
        seen = set()
        for x in r["results"]:
            if x["temperature"] == 0.0 and x["outcome"] != "ok" and x["schema"] not in seen:
                seen.add(x["schema"])
                rows.append([name, x["schema"], x["outcome"], "`" + (x["detail"] or "").replace("|", "\\|").replace("\n", "⏎")[-70:] + "`"])
    lines += table(["configuration", "schema", "outcome", "the reply's end, or the validation error"], rows)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-only", action="store_true", help="rewrite the .md page from the .json results, running nothing")
    ap.add_argument("--quick", action="store_true", help="2 seeds instead of 5")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default="structured_finish")
    a = ap.parse_args(argv)
    if a.page_only:
        from publish import load

        doc = load(a.out)
        publish(a.out, doc, markdown(doc))
        return 0
    seeds = 2 if a.quick else 5
    gguf = resolve_model_path()
    peers = {"shoal": Shoal("shoal"), "llama-server": LlamaServer()}
    doc = {"machine": machine(), "seeds": seeds, "max_tokens": MAX_TOKENS, "variants": {}}
    by_server: dict[str, list[str]] = {}
    for v in a.variants:
        by_server.setdefault(VARIANTS[v][0], []).append(v)
    with tempfile.TemporaryDirectory() as logs:
        for server_name, variants in by_server.items():
            peer = peers[server_name]
            if not peer.available:
                print(f"skipping {server_name}: {peer.missing}", file=sys.stderr)
                continue
            server = Server(peer, gguf, Path(logs))
            try:
                server.wait_ready()
                for v in variants:
                    t0 = time.perf_counter()
                    results = run_variant(server, v, seeds, not a.no_progress)
                    doc["variants"][v] = {"summary": summary(results), "results": results, "seconds": time.perf_counter() - t0}
                    print(v, json.dumps({t: f"{s['ok']}/{s['n']}" for t, s in doc["variants"][v]["summary"].items()}), file=sys.stderr)
            finally:
                server.stop()
    publish(a.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
