"""JSON mode (localpd.json_mode): the prefix recogniser against Python's json, and the token constraint."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpd.json_mode import JsonPrefix, compile_schema

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=4), max_leaves=12)
layouts = st.sampled_from([dict(), dict(indent=2), dict(indent=4), dict(separators=(",", ":")), dict(ensure_ascii=False),
                           dict(indent="\t", ensure_ascii=False)])


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), values, max_size=5), layouts)
def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_is_done(obj, layout):
    text = json.dumps(obj, **layout)
    state = JsonPrefix()
    for i, c in enumerate(text):
        assert not state.done, text[:i]
        assert state.feed(c), (text, i)
    assert state.done


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.text(max_size=4), values, max_size=3), st.data())
def test_what_it_finishes_python_parses(obj, data):
    """Mutated JSON: whenever the recogniser accepts a text as a whole object, json.loads agrees."""
    text = list(json.dumps(obj))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        c = data.draw(st.sampled_from(list('{}[]:,"\\ -+.0123456789eEtrufalsn\x01\nxé')))
        if op == "insert":
            text.insert(i, c)
        elif i < len(text):
            text[i:i + 1] = [] if op == "delete" else [c]
    text = "".join(text)
    state = JsonPrefix()
    if state.feed(text) and state.done:
        assert isinstance(strict_loads(text), dict)


@pytest.mark.parametrize("text", [
    '[1, 2]',  # the reply is an object
    '{"a" 1}', '{"a": tru', '{"a": 01', '{"a": 1,}', '{"a": -}', '{"a": 1.}', '{"a": 1e}', '{"a": .5}',
    '{"a": "\x01"}', '{"a": "\\x"}', '{"a": "\\u12g4"}', '{a: 1}', "{'a': 1}", '{"a": 1]', '{"a": [1}',
    '{} x', '{}{}', '{"a": NaN}',
])
def test_texts_that_cannot_start_a_json_object_are_refused(text):
    state = JsonPrefix()
    assert not (state.feed(text) and state.done)
    with pytest.raises(ValueError):
        if not isinstance(strict_loads(text), dict):
            raise ValueError("not an object")


def test_runaway_blanks_are_refused_where_json_would_take_them():
    """A model stuck on newlines or spaces outside strings is made to go on (JSON itself allows any amount)."""
    assert not JsonPrefix().feed("{" + " " * 11) and not JsonPrefix().feed('{"a":\n\n\n1}')
    assert JsonPrefix().feed('{"a": [\n' + " " * 12 + '1]}')  # two levels deep, indented by 4 a level (and 4 more)
    assert not JsonPrefix().feed('{"a": [\n' + " " * 14)
    assert JsonPrefix().feed("{\n" + " " * 9 + '"a": "' + " " * 100 + '"')  # inside strings: any


def test_a_last_member_closes_its_object():
    state = JsonPrefix()
    assert state.feed('{"name": "f", "arguments": ')
    state.last_depth = 1  # as JsonConstraint sets it for a lead that stops at a member's value
    assert state.feed('{"a": [1, {"b": 2}], "c": 3}')
    assert not state.copy().feed(",") and state.feed(" }") and state.done


def test_copies_are_independent():
    state = JsonPrefix()
    assert state.feed('{"a": [1, {"b": ')
    probe = state.copy()
    assert probe.feed('"x"}]}') and probe.done
    assert not state.done and state.feed("2}]}") and state.done


PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "kind": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
POINTS = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
          "type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                                      "minItems": 1}}, "required": ["points"]}


def whole(text: str, schema=None) -> bool:
    state = JsonPrefix(compile_schema(schema) if schema is not None else None)
    return state.feed(text) and state.done


@pytest.mark.parametrize("schema, text, valid", [
    (PERSON, '{"name": "Ann", "age": 30}', True),
    (PERSON, '{"age": -3, "name": "Ann", "kind": null, "tags": ["b", "a"]}', True),  # any key order
    (PERSON, '{"name": "Ann"}', False),  # a required key missing
    (PERSON, '{"name": "Ann", "age": 30.5}', False),  # not an integer
    (PERSON, '{"name": "Ann", "age": 30, "email": "x"}', False),  # no other keys (additionalProperties unset)
    (PERSON, '{"name": "Ann", "name": "Bo", "age": 3}', False),  # a key twice
    (PERSON, '{"name": "Ann", "age": 3, "tags": ["c"]}', False),  # not in the enum
    (PERSON, '{"name": "Ann", "age": 3, "tags": ["a", "b", "a"]}', False),  # maxItems
    (PERSON, '{"name": 7, "age": 3}', False),
    (POINTS, '{"points": [{"x": 1.5}, {"x": -2e3}]}', True),  # a $ref into $defs
    (POINTS, '{"points": []}', False),  # minItems
    (POINTS, '{"points": [{"y": 1}]}', False),
    ({"enum": [1, 12, "x"]}, "12", True), ({"enum": [1, 12, "x"]}, "1", True), ({"enum": [1, 12]}, "13", False),
    ({"type": "object"}, '{"any": {"thing": [1, true]}}', True),  # no properties: any object
    ({"type": ["integer", "null"]}, "null", True), ({"const": {"a": 1}}, '{"a":1}', True),
])
def test_a_schema_holds_each_value(schema, text, valid):
    assert whole(text, schema) == valid
    if valid:
        json.loads(text)
        assert JsonPrefix(compile_schema(schema)).feed(text[:-1])


people = st.fixed_dictionaries({"name": st.text(max_size=6), "age": st.integers(-10**6, 10**6)},
                               optional={"tags": st.lists(st.sampled_from(["a", "b"]), max_size=2),
                                         "kind": st.none() | st.text(max_size=4)})


@settings(max_examples=200, deadline=None)
@given(people, layouts)
def test_every_instance_of_a_schema_is_accepted_whole(person, layout):
    text = json.dumps(person, **layout)
    state = JsonPrefix(compile_schema(PERSON))
    for i, c in enumerate(text):
        assert not state.done and state.feed(c), (text, i)
    assert state.done


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "not in its $defs"),
    ({"type": "tuple"}, "unknown JSON schema type"), ({"enum": []}, "non-empty list"), ("object", "must be an object"),
])
def test_bad_schemas_are_one_line_errors(schema, fragment):
    from localpd.json_mode import SchemaError

    with pytest.raises(SchemaError, match=fragment.replace("$", r"\$")):
        JsonPrefix(compile_schema(schema)).feed('{"a": 1}')
