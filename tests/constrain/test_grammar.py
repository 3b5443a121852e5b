"""Structured outputs on the grammar engine (localpd.constrain.grammar): JSON mode and JSON schemas against Python's
json, patterns against Python's re, GBNF and Lark grammars, and the errors a user sees. The texts are fed a byte a
token (a vocabulary of the 256 bytes), so a text is taken exactly when it is a prefix of the grammar's language."""

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpd.constrain.grammar import GrammarError, Reader, check, json_grammar, text_grammar

SchemaError = GrammarError


def compile_schema(schema) -> str:
    """A schema's grammar, checked: what the engine cannot take raises GrammarError."""
    grammar = json_grammar(schema)
    check(grammar)
    return grammar


JsonPrefix = Reader
RAW = st.characters(exclude_categories=["Cs"], exclude_characters="\x7f")  # DEL: the engine's schemas refuse it raw

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
    """Between a value's tokens: blanks, or up to two line breaks and an indent, at most 32 blanks; before the
    object, one space at most (issue 34: replies opened with "  \\n  \\n{"), and after a thinking model's </think> two
    line breaks. A model stuck on blanks ends instead of filling its budget with them."""
    assert JsonPrefix().feed(" {" + " " * 32) and JsonPrefix().feed('{"a":\n\n' + " " * 32 + "1}")
    assert not JsonPrefix().feed("{" + " " * 33) and not JsonPrefix().feed('{"a":\n\n\n1}')
    for lead in ("  ", "\n", " \n\n"):
        assert not JsonPrefix().feed(lead + "{")
        assert not Reader(json_grammar({"type": "object"})).feed(lead + "{")
        assert Reader(json_grammar({"type": "object"}, after_reasoning=True)).feed(lead + "{")
    assert not Reader(json_grammar(None, after_reasoning=True)).feed("\n\n\n{")
    assert JsonPrefix().feed("{\n" + " " * 9 + '"a": "' + " " * 100 + '"')  # inside strings: any


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
    (PERSON, '{"name": "Ann", "age": -3, "tags": ["b", "a"], "kind": null}', True),
    (PERSON, '{"age": -3, "name": "Ann"}', False),  # properties in the schema's order (as vLLM's engines hold them)
    (PERSON, '{"name": "Ann"}', False),  # a required key missing
    (PERSON, '{"name": "Ann", "age": 30.5}', False),  # not an integer
    (PERSON, '{"name": "Ann", "age": 30, "email": "x"}', False),  # no other keys (additionalProperties unset)
    (PERSON, '{"name": "Ann", "name": "Bo", "age": 3}', False),  # a key twice
    (PERSON, '{"name": "Ann", "age": 3, "tags": ["c"]}', False),  # not in the enum
    (PERSON, '{"name": "Ann", "age": 3, "tags": ["a", "b", "a"]}', False),  # maxItems
    (PERSON, '{"name": 7, "age": 3}', False),
    (POINTS, '{"points": [{"x": 1.5}, {"x": -2000}]}', True),  # a $ref into $defs
    (POINTS, '{"points": [{"x": -2e3}]}', False),  # a number without bounds is held below 1e15, with no exponent
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


people = st.fixed_dictionaries({"name": st.text(RAW, max_size=6), "age": st.integers(-10**6, 10**6)},
                               optional={"tags": st.lists(st.sampled_from(["a", "b"]), max_size=2),
                                         "kind": st.none() | st.text(RAW, max_size=4)})


@settings(max_examples=200, deadline=None)
@given(people, layouts)
def test_every_instance_of_a_schema_is_accepted_whole(person, layout):
    person = {k: person[k] for k in PERSON["properties"] if k in person}  # in the schema's order
    text = json.dumps(person, **layout)
    state = JsonPrefix(compile_schema(PERSON))
    for i, c in enumerate(text):
        assert not state.done and state.feed(c), (text, i)
    assert state.done


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "'/$defs/Missing' does not exist"),
    ({"type": "tuple"}, "unknown JSON schema type"), ({"enum": []}, "admits no value"), ("object", "must be an object"),
    ({"not": {"type": "string"}}, 'keyword "not" is not supported'),
])
def test_bad_schemas_are_one_line_errors(schema, fragment):


    with pytest.raises(SchemaError, match=fragment.replace("$", r"\$")):
        JsonPrefix(compile_schema(schema)).feed('{"a": 1}')


@pytest.mark.parametrize("schema, text, valid", [
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', True),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"a"', False),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"', False),
    ({"type": "string", "maxLength": 2}, '"\\u00e9\\n"', True),  # an escape is one character
    ({"type": "integer", "minimum": 18, "maximum": 120}, "120", True),
    ({"type": "integer", "minimum": 18, "maximum": 120}, "17", False),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, "0", False),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, "9", True),
    ({"type": "integer", "minimum": -5, "maximum": -2}, "-3", True),
    ({"type": "integer", "minimum": -5, "maximum": -2}, "-1", False),
    ({"type": "integer", "minimum": 2.5}, "2", False), ({"type": "integer", "minimum": 2.5}, "3", True),
    ({"type": "integer", "minimum": 5, "exclusiveMinimum": True}, "5", False),  # draft 4's boolean
])
def test_lengths_and_integer_bounds_are_held(schema, text, valid):
    assert whole(text, schema) == valid


@pytest.mark.parametrize("prefix", ["13", "-", "0", "121"])
def test_a_digit_no_integer_in_range_begins_with_is_refused_at_once(prefix):
    """Bounds 18..120: "13" can only become 13, 130.. (out), "-" and "0" nothing in range; "2" and "12" can."""
    state = JsonPrefix(compile_schema({"type": "integer", "minimum": 18, "maximum": 120}))
    assert not state.feed(prefix)
    assert all(JsonPrefix(compile_schema({"type": "integer", "minimum": 18, "maximum": 120})).feed(p)
               for p in ("2", "12"))


TUPLE = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False, "minItems": 2}


@pytest.mark.parametrize("schema, text, valid", [
    (TUPLE, '[1, "a"]', True), (TUPLE, '[1, 2]', False), (TUPLE, '["a", 1]', False), (TUPLE, '[1, "a", 3]', False),
    (TUPLE, "[1]", False), ({**TUPLE, "items": True}, '[1, "a", null, {}]', True),
    ({**TUPLE, "items": {"type": "boolean"}}, '[1, "a", true]', True),
    ({**TUPLE, "items": {"type": "boolean"}}, '[1, "a", 2]', False),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, "[1]", True),  # draft 4's tuple
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, "[1, 2]", False),
    ({"type": "array", "maxItems": 0}, "[ ]", True), ({"type": "array", "maxItems": 0}, "[1]", False),
])
def test_an_arrays_first_items_hold_to_their_own_schemas(schema, text, valid):
    assert whole(text, schema) == valid


def test_a_pydantic_tuple_is_held_item_by_item():
    from pydantic import BaseModel

    class Reading(BaseModel):
        at: tuple[int, int]
        label: tuple[str, bool]
        rest: tuple[float, ...]

    schema = Reading.model_json_schema()
    assert whole('{"at": [3, 4], "label": ["x", true], "rest": [1.5, 2]}', schema)
    for bad in ('{"at": [3], "label": ["x", true], "rest": []}', '{"at": [3, 4, 5], "label": ["x", true], "rest": []}',
                '{"at": [3, 4], "label": [true, "x"], "rest": []}', '{"at": [3, 4], "label": ["x", true], "rest": ["a"]}'):
        assert not whole(bad, schema), bad
    Reading.model_validate_json('{"at": [3, 4], "label": ["x", true], "rest": [1.5, 2]}')


PETS = {"$defs": {
    "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
            "required": ["kind", "lives"]},
    "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "breed": {"type": "string", "maxLength": 8},
                                             "owner": {"anyOf": [{"type": "string", "maxLength": 2},
                                                                 {"type": "string", "minLength": 5}, {"type": "null"}]}},
            "required": ["kind", "breed"]}},
    "type": "object", "required": ["pets"],
    "properties": {"pets": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
                   "age": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "number", "maximum": 0}]}}}


@pytest.mark.parametrize("text, valid", [
    ('{"pets": [{"kind": "cat", "lives": 9}, {"kind": "dog", "breed": "lab"}]}', True),
    ('{"pets": [{"kind": "cat", "breed": "lab"}]}', False),  # a cat's kind with a dog's key
    ('{"pets": [{"lives": 3, "kind": "dog"}]}', False),  # a dog's kind after a cat's key
    ('{"pets": [{"kind": "cat", "lives": 10}]}', False),  # the cat's bounds, not any object's
    ('{"pets": [{"kind": "dog"}]}', False),  # the dog's required key
    ('{"pets": [{"kind": "dog", "breed": "a", "owner": "Jo"}]}', True),
    ('{"pets": [{"kind": "dog", "breed": "a", "owner": "Ann"}]}', False),  # neither string alternative's length
    ('{"pets": [{"kind": "dog", "breed": "a", "owner": "Annie"}]}', True),
    ('{"pets": [{"kind": "dog", "breed": "a", "owner": null}]}', True),
    ('{"pets": [], "age": 12}', True), ('{"pets": [], "age": -1.5}', True),
    ('{"pets": [], "age": 5}', False), ('{"pets": [], "age": 12.5}', False),
])
def test_a_choice_between_alternatives_of_one_kind_holds_to_the_one_taken(text, valid):
    assert whole(text, PETS) == valid


cats = st.fixed_dictionaries({"kind": st.just("cat"), "lives": st.integers(0, 9)})
dogs = st.fixed_dictionaries({"kind": st.just("dog"), "breed": st.text(RAW, max_size=8)},
                             optional={"owner": st.none() | st.text(RAW, max_size=2) | st.text(RAW, min_size=5, max_size=7)})


@settings(max_examples=150, deadline=None)
@given(st.lists(cats | dogs, max_size=6).map(lambda pets: {"pets": [
    {k: p[k] for k in ("kind", "lives", "breed", "owner") if k in p} for p in pets]}), layouts)
def test_every_instance_of_a_union_is_accepted_and_readings_merge_once_a_value_ends(pets, layout):
    text = json.dumps(pets, **layout)
    state = JsonPrefix(compile_schema(PETS))
    for i, c in enumerate(text):
        assert not state.done and state.feed(c), (text, i)
        pass
    assert state.done


@settings(max_examples=200, deadline=None)
@given(st.text(RAW, max_size=8), st.integers(0, 5), st.integers(0, 5),
       st.booleans())
def test_string_lengths_count_characters_however_escaped(text, low, width, ascii_only):
    """Characters are code points: one outside the BMP, escaped as a surrogate pair, is one."""
    schema = {"type": "string", "minLength": low, "maxLength": low + width}
    assert whole(json.dumps(text, ensure_ascii=ascii_only), schema) == (low <= len(text) <= low + width)


def test_a_pydantic_models_field_bounds_are_held():
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(min_length=2, max_length=10)
        age: int = Field(ge=0, le=150)
        rank: int = Field(gt=0, lt=4)
        score: float = Field(ge=0, lt=1)

    schema = Person.model_json_schema()
    assert whole('{"name": "Ann", "age": 150, "rank": 3, "score": 0.25}', schema)
    good = {"name": "Ann", "age": 1, "rank": 1, "score": 0}
    for bad in ({"name": "A"}, {"age": 151}, {"rank": 4}, {"age": -1}, {"score": 1.0}, {"score": "1e-3"}):
        text = json.dumps({**good, **bad}).replace('"1e-3"', "1e-3")  # an exponent, refused where bounded
        assert not whole(text, schema), text
    with pytest.raises(SchemaError, match=re.escape("minimum (3) is greater than maximum (2)")):
        compile_schema({"type": "integer", "minimum": 3, "maximum": 2})


PATTERNS = [r"^\d{3}$", r"ab", r"^a|b$", r"^(a|b)*c{1,2}$", r"^$", r"x?", r"^[^a-c\n]+$", r"^(?:ab)+$", r"^a{2,}$",
            r"^[\w-]{0,3}$", r"^\s*\S\s*$", r"^(?<word>[a-c]+)\.$", r'^"[\\\d]+"$', r"^a.c$", r"\n|é$", r"^[\x61-\x63]+?$"]
pattern_text = st.text(st.sampled_from(list('abcx1-_. "\\\né')), max_size=6)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATTERNS), pattern_text, st.just(False))
def test_a_pattern_is_held_as_pythons_re_searches_it(pattern, text, ascii_only):
    """Whole strings (\\uXXXX escapes are not taken under a pattern) are accepted exactly when Python's re finds the pattern in them (ECMA's $
    is Python's \\Z, a named group its (?P<...>); the texts avoid where the two dialects differ)."""
    schema = {"type": "string", "pattern": pattern}
    want = re.search(pattern.replace("$", r"\Z").replace("(?<", "(?P<"), text, re.ASCII) is not None
    assert whole(json.dumps(text, ensure_ascii=ascii_only), schema) == want


@pytest.mark.parametrize("pattern, text, valid", [
    ("^a\\nb$", '"a\\nb"', True), ("^a\\nb$", '"a\\u000ab"', True), ("^a\\nb$", '"a\\tb"', False),
    ("^a", '"\\u0061x"', False), ("^a", '"\\u0062"', False), ("^.$", '"\\ud83d\\ude00"', False),  # no \u under one
    ("^.$", '"\U0001F600"', True), ("^[\\d]{2}$", '"12"', True),
])
def test_escapes_under_a_pattern_stand_for_their_characters(pattern, text, valid):
    assert whole(text, {"type": "string", "pattern": pattern}) == valid


@pytest.mark.parametrize("fmt, good, bad", [
    ("date", ["2024-02-28", "1999-12-31", "0001-01-01", "2024-02-29", "2000-02-29", "0004-02-29", "1600-02-29"],
     ["2024-02-30", "2024-13-01", "2024-1-01", "24-01-01", "2024-04-31"]),  # leap days: not told apart
    ("date-time", ["2024-06-01T12:30:00Z", "2024-06-01T23:59:59.123+02:00"], ["2024-06-01T24:00:00Z",
                                                                             "2024-06-01 12:30:00Z"]),
    ("time", ["08:15:00Z", "23:59:59-05:30"], ["8:15:00Z", "08:60:00Z"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "123e4567-e89b"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    ("email", ["ann.lee+x@example.co.uk"], ["ann@", "@example.com"]),
    ("uri", ["https://example.com/a?b=c"], ["example.com", "https://exa mple.com"]),
    ("hostname", ["my-host.example.com"], ["any text"]),
    ("uri-reference", ["any text"], []),  # a format the engine does not know is an annotation
])
def test_formats_a_model_is_asked_for_are_held(fmt, good, bad):
    for text in good:
        assert whole(json.dumps(text), {"type": "string", "format": fmt}), text
    for text in bad:
        assert not whole(json.dumps(text), {"type": "string", "format": fmt}), text


@settings(max_examples=100, deadline=None)
@given(st.datetimes(timezones=st.timezones()))
def test_what_a_date_time_format_takes_python_parses_and_the_reverse(when):
    import datetime as dt

    text = when.isoformat()
    taken = whole(json.dumps(text), {"type": "string", "format": "date-time"})
    if taken:
        assert dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    # refused: no offset (RFC 3339 wants one), an offset in seconds (old local mean times)
    assert taken == (when.utcoffset() is not None and when.utcoffset().seconds % 60 == 0)


@settings(max_examples=300, deadline=None)
@given(st.dates())
def test_a_date_format_takes_every_date_python_has(day):
    assert whole(json.dumps(day.isoformat()), {"type": "string", "format": "date"}), day


@pytest.mark.parametrize("pattern, fragment", [
    ("(?=a)", "lookaround"), ("(?<!a)b", "lookaround"), ("(a)\\1", "backreference"), ("\\bword", "word boundary"),
    ("a{3,2}", "the start must be <= the end"), ("(a", "unclosed group"), ("*a", "missing expression"),
    ("a)", "unopened group"), ("[b-a]", "the start must be <= the end"), ("\\q", "unrecognized escape"),
    ("^*", "anchor"),
])
def test_patterns_localpd_cannot_hold_are_one_line_errors(pattern, fragment):
    with pytest.raises(SchemaError, match=re.escape(fragment)):
        compile_schema({"type": "string", "pattern": pattern})


def test_a_pattern_and_string_lengths_are_held_together_so_neither_dead_ends():
    """Each character leaves some match of an allowed length: under `[a-z]*x` and maxLength 3 the third character
    must be the x; under `(ab)+` and maxLength 5 a third pair cannot begin; under minLength 5 the string cannot
    close at four. A schema whose pattern and lengths admit no string is refused when compiled."""
    def state(**s):
        return JsonPrefix(compile_schema({"type": "string", **s}))

    x = state(pattern="^[a-z]*x$", maxLength=3)
    assert x.feed('"ab') and not x.copy().feed("c") and x.feed('x"') and x.done
    pairs = state(pattern="^(ab)+$", maxLength=5)
    assert pairs.feed('"abab') and not pairs.copy().feed("a") and pairs.feed('"') and pairs.done
    longer = state(pattern="^(ab)+$", minLength=5)
    assert longer.feed('"abab') and not longer.copy().feed('"') and longer.feed('ab"') and longer.done
    dated = state(format="date", maxLength=10)  # the format's own length: nothing refused
    assert dated.feed('"2024-02-29"') and dated.done
    for s in ({"pattern": "^a{5}$", "maxLength": 3}, {"pattern": "^(ab)+$", "minLength": 5, "maxLength": 5},
              {"format": "uuid", "maxLength": 20}):
        with pytest.raises(SchemaError, match="no string matches the pattern"):
            compile_schema({"type": "string", **s})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["^[a-c]{2,6}$", "^(ab|c)+d?$", "^x*[0-9]{3}$", "^[a-z]+(-[a-z]+)*$"]),
       st.integers(0, 6), st.integers(0, 8), st.randoms(use_true_random=False))
def test_random_walks_under_a_pattern_and_lengths_always_finish(pattern, least, extra, rng):
    """Whatever characters a reply picks among those taken, it can always close the string: a walk that takes a
    random allowed character (or closes when it may) ends in a string of the pattern and the lengths."""
    import re

    schema = {"type": "string", "pattern": pattern, "minLength": least, "maxLength": least + extra}
    try:
        s = JsonPrefix(compile_schema(schema))
    except SchemaError:
        return
    assert s.feed('"')
    text = ""
    for _ in range(40):
        options = [c for c in 'abcdx0123-"' if s.copy().feed(c)]
        assert options, (schema, text)  # never a dead end
        c = rng.choice(options)
        assert s.feed(c)
        if c == '"':
            break
        text += c
    assert s.done and re.fullmatch(pattern.strip("^$"), text) and least <= len(text) <= least + extra


GRAMMARS = Path(__file__).parent / "grammars"


@pytest.mark.parametrize("name, good, bad", [
    ("json", ['{"a": [1, -2.5e3, "x\\n", true, null], "b": {}}', "{}", '{ "k" :\n  "v"}'],
     ["[1]", '{"a": 01}', '{"a": "\x01"}', '{"a": 1,}', "{} {}"]),
    ("arithmetic", ["1 + 2 = 3\n", "(10 * 4) - 2 = 38\n7 / 7 = 1\n"], ["1 + = 3\n", "1 + 2\n", "12345 = 1\n"]),
    ("list", ["- eggs\n- milk\n", "- one item\n"], ["eggs\n", "- \n", "- a\n" * 6]),
])
def test_gbnf_grammars_hold_their_sentences(name, good, bad):
    """llama.cpp's kinds of example grammar (written again here): a JSON object, arithmetic, a list."""
    grammar = text_grammar((GRAMMARS / f"{name}.gbnf").read_text())
    for text in good:
        reader = Reader(grammar)
        assert reader.feed(text) and reader.done, text
    for text in bad:
        reader = Reader(grammar)
        assert not (reader.feed(text) and reader.done), text


def test_lark_grammars_as_vllm_takes_them():
    grammar = text_grammar('start: greeting " " NAME "!"\ngreeting: "Hello" | "Hi"\nNAME: /[A-Z][a-z]{1,9}/')
    for text, whole in (("Hello Ann!", True), ("Hi Bob!", True), ("Hey Ann!", False), ("Hi ann!", False)):
        reader = Reader(grammar)
        assert (reader.feed(text) and reader.done) == whole, text


@pytest.mark.parametrize("text, fragment", [
    ('root ::= "a" missing', "Rule 'missing' not found"),
    ('root ::= [a-', "does not parse"),
    ('start: "a" | missing', "unknown name"),
    ('root ::= "a" root', "admits no string"),  # every expansion goes on: no reply could end
    ('start: item+\nitem: "(" item ")"', "admits no string"),
    ('root ::= ""', "admits no string"),
    ("", "non-empty"),
])
def test_grammars_the_engine_cannot_take_are_one_line_errors(text, fragment):
    """As the engine meets them: the grammar built, then the constraint on it (a vocabulary of the 256 bytes)."""
    from localpd.constrain.grammar import GrammarConstraint, Vocabulary, byte_vocabulary

    vocab = Vocabulary.__new__(Vocabulary)
    vocab.n, vocab.lt = 257, byte_vocabulary()
    with pytest.raises(GrammarError, match=re.escape(fragment)) as err:
        GrammarConstraint(vocab, text_grammar(text), {256})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("choices, texts", [
    (["a.b", "(x)", "1+1", "c:/d e", "☕ café"], ["a.b", "(x)", "1+1", "c:/d e", "☕ café"]),
])
def test_choices_are_matched_literally(choices, texts):
    from localpd.constrain.grammar import choice_pattern, regex_grammar

    grammar = regex_grammar(choice_pattern(choices))
    for text in texts:
        reader = Reader(grammar)
        assert reader.feed(text) and reader.done, text
    assert not Reader(grammar).feed("aXb")
    with pytest.raises(GrammarError, match="non-empty list"):
        choice_pattern([])


def test_numbers_without_bounds_are_bounded_so_a_reply_cannot_loop_on_digits():
    """An integer of at most 18 digits (int64 holds it), a number below 1e15; JSON mode's numbers alike."""
    integer = Reader(compile_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert integer.feed('{"n": ' + "1" * 18) and not integer.copy().feed("1") and integer.feed("}") and integer.done
    assert not JsonPrefix().feed('{"n": ' + "1" * 19)
    number = Reader(compile_schema({"type": "number"}))
    assert number.feed("1" * 15) and not number.copy().feed("1")


def test_lark_emptiness_reads_what_it_can_and_leaves_the_rest_to_the_engine():
    from localpd.constrain.lark_empty import derives_nothing

    assert derives_nothing('start: "a" start') and derives_nothing('start: b\nb: "b" b')
    assert derives_nothing('start: ("a" start)~2')
    for text in ('start: "a" start?', 'start: "a" | b\nb: "b" b', 'start: ("a" start)~0..2',
                 'start: "x" A\nA: /[a]/ & /[b]/', 'start: item{1,5}\nitem: "- " /[^\\n]{1,60}/ "\\n"',
                 "start: what ever this is ::= !!"):  # unread: left to the engine
        assert not derives_nothing(text), text
