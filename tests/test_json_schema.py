"""The schema the grammar is compiled from (json_schema.py), exactly: plain data in, plain data out."""

from __future__ import annotations

import copy
import json

import pytest

from shoal.json_schema import ANY_KEY, INT_BOUND, NUMBER_BOUND, any_value_schema, json_object_schema, json_options, prepare

ANY = {"$ref": f"#/$defs/{ANY_KEY}"}
NUMBER = {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": 1e-10}


def test_integers_fit_an_int64_and_keep_their_own_bounds():
    assert prepare({"type": "integer"}) == {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert prepare({"type": "integer", "minimum": 0}) == {"type": "integer", "minimum": 0, "maximum": INT_BOUND}
    assert prepare({"type": "integer", "exclusiveMaximum": 10}) == {"type": "integer", "exclusiveMaximum": 10, "minimum": -INT_BOUND}
    # The int64 edges themselves are clamped to what llguidance's double-precision bounds can build.
    assert prepare({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}) == {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert INT_BOUND < 2**63 and float(INT_BOUND) == INT_BOUND  # exact as a double, inside an int64
    # Past 2**53 a bound is moved inward to the nearest double, so the grammar never leaves the schema's range.
    near = prepare({"type": "integer", "minimum": 2**62 + 1, "maximum": 2**62 + 3000})
    assert (near["minimum"], near["maximum"]) == (2**62 + 1024, 2**62 + 2048)
    assert prepare({"type": "integer", "exclusiveMaximum": 2**60 + 1}) == {"type": "integer", "maximum": 2**60, "minimum": -INT_BOUND}
    assert prepare({"type": "integer", "minimum": 5, "maximum": 1e30}) == {"type": "integer", "minimum": 5, "maximum": INT_BOUND}
    assert prepare({"type": ["integer", "null"]}) == {"type": ["integer", "null"], "minimum": -INT_BOUND, "maximum": INT_BOUND}


def test_numbers_are_bounded_in_digits_unless_the_schema_bounds_them():
    assert prepare({"type": "number"}) == NUMBER
    assert prepare({"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}) == {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}
    assert prepare({"type": ["number", "integer"]}) == {**NUMBER, "type": ["number", "integer"]}


def test_objects_take_no_unnamed_property_unless_they_say_so():
    props = {"a": {"type": "string"}}
    assert prepare({"type": "object", "properties": props}) == {"type": "object", "properties": props, "additionalProperties": False}
    assert prepare({"properties": props}) == {"properties": props, "additionalProperties": False}  # no type: still an object's keywords
    extra = {"type": "object", "properties": props, "additionalProperties": {"type": "integer"}}
    assert prepare(extra) == {**extra, "additionalProperties": {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}}
    # JSON Schema's own default on request (vLLM's disable_additional_properties: false): any value, bounded.
    out = prepare({"type": "object", "properties": props}, extra_properties=True)
    assert out["additionalProperties"] == ANY and out["$defs"] == {ANY_KEY: any_value_schema()}
    # patternProperties say which extra keys are allowed: left as they are.
    pattern = {"type": "object", "patternProperties": {"^x-": {"type": "string"}}}
    assert prepare(pattern) == pattern


def test_strict_is_openais_every_property_required_and_no_other():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "object", "properties": {"c": {"type": "boolean"}}}},
              "required": ["a"], "additionalProperties": True}
    out = prepare(schema, strict=True)
    assert out["required"] == ["a", "b"] and out["additionalProperties"] is False
    assert out["properties"]["b"]["required"] == ["c"] and out["properties"]["b"]["additionalProperties"] is False


def test_any_value_is_bounded_too():
    out = prepare({"type": "object", "properties": {"meta": {}, "list": {"type": "array"}, "free": True, "doc": {"description": "anything"}}})
    assert out["properties"] == {"meta": ANY, "list": {"type": "array", "items": ANY}, "free": ANY, "doc": ANY}
    assert out["$defs"][ANY_KEY] == any_value_schema()
    assert {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": 1e-10} in any_value_schema()["anyOf"]
    # A root that is itself any value, or only a $ref, keeps its meaning beside the added $defs.
    assert prepare({}) == {"allOf": [ANY], "$defs": {ANY_KEY: any_value_schema()}}
    assert prepare(True) == {"allOf": [ANY], "$defs": {ANY_KEY: any_value_schema()}}
    assert json_object_schema() == {"type": "object", "additionalProperties": ANY, "$defs": {ANY_KEY: any_value_schema()}}


def test_every_place_a_subschema_can_be_is_walked():
    schema = {
        "$defs": {"n": {"type": "integer"}},
        "definitions": {"m": {"type": "number"}},
        "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}],
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "prefixItems": [{"type": "number"}]}},
    }
    out = prepare(schema)
    bounded = {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert out["$defs"]["n"] == bounded and out["definitions"]["m"] == NUMBER and out["anyOf"][0] == bounded
    assert out["properties"]["xs"]["items"] == bounded and out["properties"]["xs"]["prefixItems"] == [NUMBER]


def test_the_users_schema_is_not_changed():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}}
    before = copy.deepcopy(schema)
    prepare(schema, strict=True)
    assert schema == before


def test_not_a_schema_is_left_for_llguidance_to_refuse():
    assert prepare(False) is False
    assert prepare([1, 2]) == [1, 2]


def test_layouts():
    assert json_options("compact") == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    flexible = json_options("flexible")
    assert flexible["item_separator"] == "," and flexible["key_separator"] == ":"
    assert json_options("compact", whitespace_pattern="[ ]?") == {"whitespace_pattern": "[ ]?", "item_separator": ",", "key_separator": ":"}
    with pytest.raises(ValueError, match="unknown JSON layout 'pretty'"):
        json_options("pretty")
    json.dumps(flexible)  # plain data, as llguidance takes it
