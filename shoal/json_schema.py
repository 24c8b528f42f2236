"""A JSON schema as the grammar should see it: replies that can finish, and that mean what the user asked.

llguidance compiles a schema as JSON Schema defines it, and JSON Schema bounds nothing it is
not told to: an integer may have any number of digits, a number any number of decimals, an
object any extra property, and a value of `{}` anything at all. A small model then writes
`"population": 1111111111…` until `max_tokens`. This module rewrites a copy of the schema,
the one the grammar is compiled from, so that every reply the grammar allows is also valid
for the user's schema, and none can run on inside a number or a layout:

- **Integers** fit an int64 (`INT_BOUND`, within llguidance's double-precision bounds), or
  the schema's own `minimum`/`maximum` clamped into it.
- **Numbers** lie within ±10^15 (`NUMBER_BOUND`: 15 digits before the point, or 1 and 15 zeros)
  and have at most `NUMBER_DECIMALS` after it, with no exponent, unless the schema gives its own bounds or `multipleOf`.
- **Objects** take no property the schema does not name unless it says so
  (`additionalProperties`), as llama.cpp, xgrammar and Outlines do; `extra_properties=True`
  gives JSON Schema's default instead. `strict=True` is OpenAI's strict mode: no extra
  property even where the schema allows them, and every property required.
- **Any value** (`{}`, `true`, a missing `items`) is any JSON value under the same bounds.

`json_options` gives llguidance's layout: `compact` (`{"a": 1, "b": [2, 3]}`, one line) or
`flexible` (the model's own whitespace, at most one newline and INDENT_LIMIT spaces or tabs
at each place, so it cannot loop in whitespace), or a user's own whitespace regex.

Plain Python, no torch, below the engine and the server: the engine's structured-output module
compiles from it, and the server builds a forced tool call's schema with `forced_tool_call_schema`.
A constraint that cannot be used is a `GrammarError`, whichever side finds it.
"""

from __future__ import annotations

import copy
import math

# 2**63 - 1024: the largest double below 2**63. llguidance reads bounds as doubles, and
# 2**63 - 1 rounds up to 2**63, past an int64.
INT_BOUND = 2**63 - 1024
NUMBER_BOUND = 1e15  # 15 digits before the point (llama.cpp's grammar allows 16)
NUMBER_DECIMALS = 10  # llguidance takes multipleOf down to 1e-10 exactly
INDENT_LIMIT = 24

LAYOUTS = ("compact", "flexible")
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_WHITESPACE = rf"(\r?\n)?[ \t]{{0,{INDENT_LIMIT}}}"

ANY_KEY = "shoal_any_json_value"  # the bounded any-value schema, in the root's $defs
_ANY_REF = {"$ref": f"#/$defs/{ANY_KEY}"}

# Keywords whose value is a subschema (or a list or map of them) that a value must match: a `{}` or
# `true` there allows any value, so it becomes the bounded any-value. The logical keywords that only
# test a value (`not`, `if`/`then`/`else`, `propertyNames`, `dependentSchemas`) are walked as they are.
_VALUE_ONE = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_VALUE_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_VALUE_MAP = ("properties", "patternProperties", "$defs", "definitions")
_TEST_ONE = ("not", "if", "then", "else", "propertyNames", "contains")
_TEST_MAP = ("dependentSchemas",)
# Keywords that say nothing about a value's shape: a schema of only these allows any value.
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$id", "$schema", "$anchor"}


def json_options(layout: str, whitespace_pattern: str | None = None) -> dict:
    """llguidance's layout options for a JSON constraint."""
    if whitespace_pattern is not None:
        return {"whitespace_pattern": whitespace_pattern, "item_separator": ",", "key_separator": ":"}
    if layout == "compact":
        return dict(COMPACT)
    if layout == "flexible":
        return {"whitespace_pattern": FLEXIBLE_WHITESPACE, "item_separator": ",", "key_separator": ":"}
    raise ValueError(f"unknown JSON layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def any_value_schema() -> dict:
    """Any JSON value, with the numbers bounded: what `{}` and `json_object` mean to the grammar."""
    return {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, {"type": "string"},
        _number({"type": "number"}),
        {"type": "array", "items": dict(_ANY_REF)},
        {"type": "object", "additionalProperties": dict(_ANY_REF)},
    ]}


def json_object_schema() -> dict:
    """`json_object` mode: any JSON object, under the same bounds as a schema's."""
    return {"type": "object", "additionalProperties": dict(_ANY_REF), "$defs": {ANY_KEY: any_value_schema()}}


def prepare(schema, *, strict: bool = False, extra_properties: bool = False):
    """A copy of `schema` for the grammar (see the module's docstring). The input is not changed."""
    if not isinstance(schema, (dict, bool)) or schema is False:
        return schema  # not a schema, or one nothing matches: llguidance says what is wrong
    walk = _Walk(strict, extra_properties)
    root = walk.value(copy.deepcopy(schema))
    if walk.used_any:
        root = root if "$ref" not in root or len(root) > 1 else {"allOf": [root]}
        defs = root.setdefault("$defs", {})
        if isinstance(defs, dict):
            defs[ANY_KEY] = any_value_schema()
    return root


class _Walk:
    def __init__(self, strict: bool, extra_properties: bool) -> None:
        self.strict = strict
        self.extra_properties = extra_properties
        self.used_any = False

    def any(self) -> dict:
        self.used_any = True
        return dict(_ANY_REF)

    def value(self, node):
        """A subschema a value must match: `true` and `{}` (annotations aside) become the bounded any-value."""
        if node is True or (isinstance(node, dict) and not set(node) - _ANNOTATIONS):
            return self.any()
        if isinstance(node, dict):
            self.walk(node)
        return node

    def test(self, node):
        if isinstance(node, dict):
            self.walk(node)
        return node

    def walk(self, node: dict) -> None:
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if "integer" in types and "number" not in types:
            _integer(node)
        elif "number" in types:
            _number(node)
        if "object" in types or "properties" in node:
            self._object(node)
        if "array" in types and "items" not in node and "prefixItems" not in node:
            node["items"] = self.any()
        for keys, visit in ((_VALUE_ONE, self.value), (_TEST_ONE, self.test)):
            for key in keys:
                if key in node and node[key] is not False:
                    node[key] = visit(node[key])
        for key in _VALUE_LIST:
            if isinstance(node.get(key), list):
                node[key] = [self.value(s) for s in node[key]]
        for keys, visit in ((_VALUE_MAP, self.value), (_TEST_MAP, self.test)):
            for key in keys:
                if isinstance(node.get(key), dict):
                    node[key] = {name: visit(s) for name, s in node[key].items()}

    def _object(self, node: dict) -> None:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if self.strict:
            node["additionalProperties"] = False
            node["required"] = list(props)
        elif "additionalProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = True if self.extra_properties else False


def _integer(node: dict) -> dict:
    # llguidance reads bounds as doubles, which skip integers past 2**53: a bound there is moved inward to
    # the nearest double, so the grammar's range stays inside the schema's, and into the int64 range.
    for key, upper, step in (("exclusiveMinimum", False, 1), ("exclusiveMaximum", True, -1)):
        value = node.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
            del node[key]
            inclusive = "maximum" if upper else "minimum"
            node[inclusive] = value + step if inclusive not in node else (min if upper else max)(node[inclusive], value + step)
    for key, upper in (("minimum", False), ("maximum", True)):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > 2**53:
            node[key] = _inward(max(-INT_BOUND, min(INT_BOUND, value)), upper)
    if not _has(node, "minimum", "exclusiveMinimum"):
        node["minimum"] = -INT_BOUND
    if not _has(node, "maximum", "exclusiveMaximum"):
        node["maximum"] = INT_BOUND
    return node


def _inward(value: int | float, upper: bool) -> int:
    """The double nearest `value` on the inside of the bound (below a maximum, above a minimum), as an int."""
    value = math.floor(value) if upper else math.ceil(value)
    f = float(value)
    if upper and f > value:
        f = math.nextafter(f, -math.inf)
    elif not upper and f < value:
        f = math.nextafter(f, math.inf)
    return int(f)


def _number(node: dict) -> dict:
    if not _has(node, "minimum", "exclusiveMinimum"):
        node["minimum"] = -NUMBER_BOUND
    if not _has(node, "maximum", "exclusiveMaximum"):
        node["maximum"] = NUMBER_BOUND
    if "multipleOf" not in node:
        node["multipleOf"] = float(f"1e-{NUMBER_DECIMALS}")
    return node


def _has(node: dict, *keys: str) -> bool:
    return any(isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool) for k in keys)


class GrammarError(ValueError):
    """A constraint that cannot be compiled or followed; the message is safe to show."""


def forced_tool_call_schema(tools: list[dict]) -> dict:
    """A JSON schema whose documents are exactly the calls of one of `tools`:
    `{"name": <one of the names>, "arguments": <that tool's parameters>}`.

    tools: [{"name": str, "parameters": JSON schema (default: any object)}]. This is what
    a forced tool choice (OpenAI's `required` or a named function, Anthropic's `any` or
    `tool`) constrains the output to.
    """
    if not tools:
        raise GrammarError("a forced tool call needs at least one tool")
    options = []
    for t in tools:
        params = t.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}
