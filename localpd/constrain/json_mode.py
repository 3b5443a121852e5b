"""JSON mode: the reply is one JSON value, token by token, optionally of a JSON schema.

JsonPrefix recognises the prefixes of a JSON text one character at a time (a pushdown automaton: a stack of open
objects and arrays, and where in a value or between values it stands). Given a schema (localpd.constrain.json_mode.Schema),
it also holds each value to it: its type, an object's properties (no others unless additionalProperties allows them;
the required ones before it closes), an array's items (its first ones each their own: prefixItems, a tuple) and
length, enum and const values. JsonConstraint puts it in front of the sampler: a token is allowed when the text it
adds keeps the reply a valid prefix; end of sequence is allowed only, and then alone, once the value is complete.
The sampler asks about candidates in order of probability and takes the first allowed one, so a model that wants to
write valid JSON pays one check per token.

Held too: a string's minLength and maxLength, a number's or an integer's minimum and maximum (exclusive ones
included): a character is taken only while some number it begins lies in range, and a bounded number is written
without an exponent. A choice between alternatives of one kind (anyOf two object schemas, a union of pydantic
models) is read on a branch per alternative, each held to its own (JsonPrefix). A string's pattern, or its
format's (localpd.constrain.pattern), is held character by character as its escapes decode, together with its lengths: a
character is taken only while some match of an allowed length goes on from it (Pattern.fits). uniqueItems is
held for scalar items (strings, numbers, literals): an enum's value already taken is not offered again, and a
string or number equal to an earlier item may not end there; objects and arrays as items are not compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction

from localpd.constrain.pattern import FORMATS, Pattern, PatternError, compiled
from localpd.text.tokenizer import TokenText

WS = " \t\n\r"
ESCAPES = '"\\/bfnrtu'
UNESCAPED = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}  # what an escape stands for (else itself)
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
NUMBER_ENDS = ("zero", "int", "frac", "exp")  # number states a value may end in
# whitespace in a row outside strings: a line break and an indent of 4 a level, and two line breaks in it; more is a
# model stuck on blanks (one that may not write what it wants next, say), not formatting
MAX_BREAKS = 2


def max_blanks(depth: int) -> int:
    return 2 + 4 * (depth + 1)
NUMBER_MOVES = {
    "sign": {**dict.fromkeys(DIGITS, "int"), "0": "zero"},
    "zero": {".": "dot", "e": "e", "E": "e"},
    "int": {**dict.fromkeys(DIGITS, "int"), ".": "dot", "e": "e", "E": "e"},
    "dot": dict.fromkeys(DIGITS, "frac"),
    "frac": {**dict.fromkeys(DIGITS, "frac"), "e": "e", "E": "e"},
    "e": {**dict.fromkeys(DIGITS, "exp"), "+": "esign", "-": "esign"},
    "esign": dict.fromkeys(DIGITS, "exp"),
    "exp": dict.fromkeys(DIGITS, "exp"),
}


class SchemaError(ValueError):
    pass


@dataclass(frozen=True)
class Schema:
    """One alternative of a JSON schema, as the recogniser holds values to it. kind: any, object, array, string,
    number, integer, texts (the value is one of `texts`: enum, const, boolean, null)."""

    kind: str = "any"
    texts: tuple[str, ...] = ()
    properties: tuple[tuple[str, object], ...] = ()  # (name, list of Schema alternatives), a lazily resolved ref
    required: frozenset = frozenset()
    extra: object = None  # additionalProperties: None (none allowed), True (any) or alternatives
    items: object = True  # an array's items (after its prefix): True (any), alternatives, or None (no more)
    prefix: tuple = ()  # an array's first items, each its own alternatives (prefixItems: a tuple)
    min_items: int = 0
    max_items: int | None = None
    unique: bool = False  # uniqueItems: no scalar item equal to an earlier one (objects and arrays as items: not held)
    min_length: int = 0  # a string's characters (an escape counts as one)
    max_length: int | None = None
    pattern: Pattern | None = None  # a string's pattern, or its format's
    low: float = -math.inf  # an integer's bounds, inclusive
    high: float = math.inf
    bounds: tuple | None = None  # a number's: ((low, closed) or None, (high, closed) or None), low and high Fractions


ANY = (Schema(),)
ANY_OBJECT, ANY_ARRAY = Schema("object", extra=True), Schema("array")
LITERALS = Schema("texts", ("true", "false", "null"))


def compile_schema(schema: dict) -> tuple[Schema, ...]:
    """A JSON schema (OpenAI's response_format json_schema, pydantic's model_json_schema) as alternatives.
    $ref into $defs/definitions is resolved; additionalProperties unset counts as false (strict, as OpenAI's
    structured outputs and vLLM's default take it)."""
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    memo: dict[int, tuple[Schema, ...]] = {}  # by the sub-schema's identity: a recursive $ref meets itself again

    def alternatives(s, depth=0) -> tuple[Schema, ...]:
        if isinstance(s, dict) and id(s) in memo:
            return memo[id(s)]
        if depth > 64:
            raise SchemaError("the JSON schema nests too deeply (or its $refs loop)")
        out = compile_one(s, depth)
        if isinstance(s, dict):
            memo[id(s)] = out
        return out

    def compile_one(s, depth) -> tuple[Schema, ...]:
        if s is True or s == {}:
            return ANY
        if not isinstance(s, dict):
            raise SchemaError(f"not a JSON schema: {s!r}"[:120])
        if "$ref" in s:
            name = str(s["$ref"]).rsplit("/", 1)[-1]
            if name not in defs:
                raise SchemaError(f"the JSON schema's $ref {s['$ref']!r} is not in its $defs")
            return alternatives(defs[name], depth + 1)
        if "const" in s:
            return (Schema("texts", (dump(s["const"]),)),)
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise SchemaError("a JSON schema's enum must be a non-empty list")
            return (Schema("texts", tuple(dump(v) for v in s["enum"])),)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return tuple(a for branch in s[key] for a in alternatives(branch, depth + 1))
        if "allOf" in s and len(s["allOf"]) == 1:
            return alternatives(s["allOf"][0], depth + 1)
        kinds = s.get("type")
        if kinds is None:
            kinds = "object" if "properties" in s else "array" if "items" in s else None
        if kinds is None:
            return ANY
        out = []
        for kind in kinds if isinstance(kinds, list) else [kinds]:
            if kind == "object":
                props = s.get("properties") or {}
                extra = s.get("additionalProperties", not props)  # unset: strict where properties are given
                out.append(Schema("object", properties=tuple((k, _Lazy(v, alternatives, depth)) for k, v in
                                                             props.items()),
                                  required=frozenset(s.get("required", ())),
                                  extra=None if extra is False else True if extra in (True, {}) else
                                  _Lazy(extra, alternatives, depth)))
            elif kind == "array":
                prefix, items = s.get("prefixItems", []), s.get("items", True)
                if isinstance(items, list):  # draft 4's tuple: items a list, the rest additionalItems
                    prefix, items = items, s.get("additionalItems", True)
                most = s.get("maxItems")
                if items is False:
                    most = len(prefix) if most is None else min(most, len(prefix))
                out.append(Schema("array", items=None if items is False else True if items in (True, {}) else
                                  _Lazy(items, alternatives, depth),
                                  prefix=tuple(_Lazy(p, alternatives, depth) for p in prefix),
                                  min_items=int(s.get("minItems", 0)), max_items=most,
                                  unique=bool(s.get("uniqueItems"))))
                if out[-1].unique and isinstance(out[-1].items, _Lazy) and not prefix:
                    alts = out[-1].items.get()
                    if all(a.kind == "texts" for a in alts) and out[-1].min_items > len({t for a in alts
                                                                                        for t in a.texts}):
                        raise SchemaError(f"minItems {out[-1].min_items} unique items, but the items may take "
                                          f"only these values: {s}"[:200])
            elif kind == "boolean":
                out.append(Schema("texts", ("true", "false")))
            elif kind == "null":
                out.append(Schema("texts", ("null",)))
            elif kind == "string":
                source = s.get("pattern", FORMATS.get(s.get("format")))
                out.append(Schema(kind, min_length=int(s.get("minLength", 0)), max_length=s.get("maxLength"),
                                  pattern=None if source is None else schema_pattern(str(source))))
                p, least, most = out[-1].pattern, out[-1].min_length, out[-1].max_length
                if p is not None and not p.fits(p.start(), 0, least, most):
                    raise SchemaError(f"no string matches the pattern {p.source!r} within minLength {least} and "
                                      f"maxLength {most}"[:200])
            elif kind in ("number", "integer"):
                low = number_bound(s, "minimum", "exclusiveMinimum", max)
                high = number_bound(s, "maximum", "exclusiveMaximum", min)
                if kind == "number":
                    out.append(Schema(kind, bounds=(low, high) if (low, high) != (None, None) else None))
                    continue
                out.append(Schema(kind, low=integer_edge(low, math.ceil, 1), high=integer_edge(high, math.floor, -1)))
                if out[-1].low > out[-1].high:
                    raise SchemaError(f"no integer lies between the schema's bounds: {s}"[:160])
            else:
                raise SchemaError(f"unknown JSON schema type {kind!r}")
        return tuple(out)

    root = alternatives(schema)
    seen: set[int] = set()
    todo = [root]
    while todo:  # compile every sub-schema now, so that an error is the request's and not a step's
        for alt in todo.pop():
            for sub in [v for _, v in alt.properties] + [alt.extra, alt.items, *alt.prefix]:
                if isinstance(sub, _Lazy) and id(sub) not in seen:
                    seen.add(id(sub))
                    todo.append(sub.get())
    return root


def schema_pattern(pattern: str) -> Pattern:
    try:
        return compiled(pattern)
    except PatternError as e:
        raise SchemaError(f"the JSON schema's {e}") from None


def integer_edge(bound: tuple[Fraction, bool] | None, to_int, step: int) -> float:
    """An integer's inclusive bound from a number's (number_bound): to_int rounds inward, and an open bound that
    is an integer itself moves one step inward."""
    if bound is None:
        return -math.inf if step > 0 else math.inf
    edge, closed = bound
    return to_int(edge) + (step if not closed and to_int(edge) == edge else 0)


def number_bound(s: dict, key: str, exclusive: str, tighter) -> tuple[Fraction, bool] | None:
    """A number's bound as (value, closed) from minimum/exclusiveMinimum (tighter: max) or the maxima (min); draft
    4's boolean exclusiveMinimum included."""
    found = []  # a float bound as the decimal it was written as (0.8, not the binary float nearest to it)
    if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool):
        found.append((Fraction(str(s[key])), s.get(exclusive) is True))
    ex = s.get(exclusive)
    if isinstance(ex, (int, float)) and not isinstance(ex, bool):
        found.append((Fraction(str(ex)), True))
    if not found:
        return None
    best = tighter(v for v, _ in found)
    return best, not any(is_open for v, is_open in found if v == best)


def _meet(a, b) -> bool:
    """Whether two intervals, each ((low, closed) or None, (high, closed) or None), share a point."""
    lows = [x for x in (a[0], b[0]) if x is not None]
    highs = [x for x in (a[1], b[1]) if x is not None]
    if not lows or not highs:
        return True
    lo = max(v for v, _ in lows)
    hi = min(v for v, _ in highs)
    lo_closed = all(c for v, c in lows if v == lo)
    hi_closed = all(c for v, c in highs if v == hi)
    return lo < hi or (lo == hi and lo_closed and hi_closed)


def number_reachable(text: str, bounds: tuple) -> bool:
    """Whether some number written as `text` and more digits or a fraction (no exponent) lies within bounds
    (Schema.bounds). An integer part v can still become [v * 10^k, (v + 1) * 10^k) for k = 0, 1, ...; "0" only
    [0, 1); after the point, the digits so far fix it to within 10^-digits."""
    low, high = want = bounds
    neg, body = text.startswith("-"), text.lstrip("-")

    def meets(lo: Fraction, hi: Fraction | None) -> bool:  # the interval [lo, hi) of magnitudes, signed
        if not neg:
            return _meet(((lo, True), None if hi is None else (hi, False)), want)
        return _meet((None if hi is None else (-hi, False), (-lo, True)), want)

    if not body:
        return meets(Fraction(0), None)
    whole, dot, frac = body.partition(".")
    if dot:
        start = Fraction(whole + "." + frac) if frac else Fraction(int(whole))
        return meets(start, start + Fraction(1, 10 ** len(frac)))
    if whole == "0":
        return meets(Fraction(0), Fraction(1))
    v = int(whole)
    for k in range(400):
        a, b = v * 10 ** k, (v + 1) * 10 ** k
        if meets(Fraction(a), Fraction(b)):
            return True
        edge = high if not neg else low
        if edge is not None and (a > edge[0] if not neg else -a < edge[0]):
            return False  # every longer one is further out
        if edge is None:
            return True  # unbounded on the side it grows toward
    return False


def integer_reachable(text: str, low: float, high: float) -> bool:
    """Whether some integer written as `text` and more digits (text: "-", "-12", "0", "7", ...) lies in
    [low, high]: the values it can still become are the magnitudes [v * 10^k, (v + 1) * 10^k - 1], k = 0, 1, ..."""
    neg, digits = text.startswith("-"), text.lstrip("-")
    if not digits:
        return low <= min(-1, high)
    if digits == "0":
        return low <= 0 <= high
    v = int(digits)
    for k in range(400):
        a, b = v * 10 ** k, (v + 1) * 10 ** k - 1
        lo, hi = (-b, -a) if neg else (a, b)
        if lo <= high and hi >= low:
            return True
        if (a > high and not neg) or (-a < low and neg):
            return False  # every longer one is further out
    return False


class _Lazy:
    """A sub-schema compiled when a value first needs it (so $refs that recurse terminate)."""

    def __init__(self, schema, compile_, depth):
        self.schema, self.compile, self.depth, self.alts = schema, compile_, depth, None

    def get(self) -> tuple[Schema, ...]:
        if self.alts is None:
            self.alts = self.compile(self.schema, self.depth + 1)
        return self.alts


def resolve(x) -> tuple[Schema, ...]:
    return ANY if x is True else x.get() if isinstance(x, _Lazy) else x


def canonical(text: str) -> str:
    """The JSON value `text` begins with (anything after it ignored: the character that ended a number), written
    one way: numbers compare by value (1.0 is 1), strings by what their escapes stand for."""
    value, _ = json.JSONDecoder().raw_decode(text.strip())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value)


def dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _starts(alt: Schema, c: str) -> bool:
    """Whether a value of this alternative may start with c."""
    k = alt.kind
    return (k == "any" and (c in '{["-' or c in DIGITS or c in "tfn") or k == "object" and c == "{"
            or k == "array" and c == "[" or k == "string" and c == '"'
            or k in ("number", "integer") and (c == "-" or c in DIGITS)
            or k == "texts" and any(t.startswith(c) for t in alt.texts))


def _fits(alts: tuple[Schema, ...], c: str) -> list[Schema]:
    """The alternatives a value starting with c may follow: "any" alone where it is one of them (it takes every
    value), the texts of several merged into one, the rest each a branch of its own."""
    fits = [a for a in alts if _starts(a, c)]
    if any(a.kind == "any" for a in fits):
        return list(ANY)
    texts = [t for a in fits if a.kind == "texts" for t in a.texts]
    rest = list(dict.fromkeys(a for a in fits if a.kind != "texts"))  # an alternative listed twice is one branch
    return rest + [Schema("texts", tuple(dict.fromkeys(texts)))] if texts else rest


@dataclass
class Frame:
    """An open object or array: its schema, and for an object the keys written and the one whose value comes."""

    kind: str  # "{" or "["
    schema: Schema
    keys: tuple[str, ...] = ()
    count: int = 0  # an array's values so far
    seen: tuple[str, ...] = ()  # an array with uniqueItems: its scalar items so far, canonical (canonical())


@dataclass
class Branch:
    """One reading of a JSON text: where it stands after the characters fed so far, with one alternative of the
    schema taken at each value that had several (JsonPrefix holds every reading still alive).
    schema: the alternatives the whole value may follow (None: an object of any shape, JSON mode's)."""

    schema: tuple[Schema, ...] | None = None
    stack: list[Frame] = field(default_factory=list)
    expect: str = "top"  # top | value | key | key_or_close | colon | comma_or_close | value_or_close | done
    string: str | None = None  # inside a string: "key" or "value"
    text: str = ""  # the key being written (its characters, escapes as written)
    escape: int = 0  # inside a string: -1 after a backslash, n > 0 hex digits of \\u still to come
    number: str | None = None  # inside a number: sign | zero | int | dot | frac | e | esign | exp
    integer: bool = False  # the number may not take a fraction or an exponent
    choices: tuple[str, ...] = ()  # inside a value (or key) that must be one of these texts: what is left of each
    choosing_key: bool = False
    ws: int = 0  # whitespace characters in a row
    breaks: int = 0  # line breaks among them
    last_depth: int = 0  # > 0: the container open at this depth takes no member after the current one
    value: Schema = ANY[0]  # the schema of the string or number being written (its length, its bounds)
    length: int = 0  # inside a string value: its characters so far
    digits: str = ""  # inside an integer: its text so far
    hexa: str = ""  # inside a string value's \u escape: its hex digits so far
    high: bool = False  # the string value's last character was a \u escape of a high surrogate
    matched: frozenset | None = None  # inside a string value with a pattern: the pattern's states so far
    item: str | None = None  # inside a scalar item of an array with uniqueItems: its text so far
    forks: list = field(default_factory=list)  # the branches the last character opened beside this one

    def copy(self) -> Branch:
        c = Branch.__new__(Branch)
        c.__dict__.update(self.__dict__)
        c.stack = [Frame(f.kind, f.schema, f.keys, f.count, f.seen) for f in self.stack]
        c.forks = []
        return c

    def key(self) -> tuple:
        """Two branches with the same key read the rest of the text alike: one of them is enough."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("stack", "forks", "value", "schema")}
        return (tuple((f.kind, id(f.schema), f.keys, f.count, f.seen) for f in self.stack), id(self.value),
                tuple(d.values()))

    def step(self, c: str) -> list[Branch]:
        """The branches this one becomes on c: itself if c is taken, and any the value c begins opened."""
        if self.item is not None:
            self.item += c  # (a branch that refuses c is dropped, so c need not be taken back)
        ok = self._char(c)
        out = ([self] if ok else []) + self.forks
        self.forks = []
        return out

    @property
    def done(self) -> bool:
        """A whole value: closed, or a top-level number or text that may end here."""
        if self.expect == "done":
            return True
        return not self.stack and self.string is None and ("" in self.choices or self.number in NUMBER_ENDS
                                                           and self._in_range())

    # -- where the next value's schema comes from ------------------------------------------------------------
    def _value_schema(self) -> tuple[Schema, ...]:
        if not self.stack:
            return self.schema if self.schema is not None else (ANY_OBJECT,)
        f = self.stack[-1]
        if f.kind == "[":
            return resolve(f.schema.prefix[f.count] if f.count < len(f.schema.prefix) else f.schema.items)
        key = f.keys[-1]
        for name, sub in f.schema.properties:
            if name == key:
                return resolve(sub)
        return resolve(f.schema.extra)

    def _char(self, c: str) -> bool:
        if self.string is not None:
            return self._string_char(c)
        if self.choices:
            left = tuple(t[1:] for t in self.choices if t and t[0] == c)
            if left:
                self.choices = left
                if self.choosing_key:
                    self.text += c
                if left == ("",):
                    self._choice_made()
                return True
            if "" not in self.choices:
                return False
            self._choice_made()  # a complete text, and c is the first character after it
        if self.number is not None:
            moves = NUMBER_MOVES[self.number]
            refused = ".eE" if self.integer else "eE" if self.value.bounds else ""  # a bounded number: no exponent
            if c in moves and c not in refused:
                if not self._reachable(self.digits + c):
                    return False
                self.number, self.digits = moves[c], self.digits + c
                return True
            if self.number not in NUMBER_ENDS or not self._in_range():
                return False
            self.number = None
            if not self._value_ended():  # c is the first character after the number
                return False
        if c in WS:
            self.ws += 1
            self.breaks += c == "\n"
            return self.ws <= max_blanks(len(self.stack)) and self.breaks <= MAX_BREAKS
        self.ws = self.breaks = 0
        e = self.expect
        if e in ("top", "value", "value_or_close"):
            if e == "value_or_close" and (c == "]" or self.stack[-1].schema.max_items == 0):
                return c == "]" and self._close_array()
            return self._value_start(c)
        if e in ("key", "key_or_close"):
            if c == "}" and e == "key_or_close":
                return self._close_object()
            return c == '"' and self._key_start()
        if e == "colon":
            if c == ":":
                self.expect = "value"
                return True
            return False
        if e == "comma_or_close":
            f = self.stack[-1]
            if c == "," and len(self.stack) != self.last_depth:
                if f.kind == "{":
                    if f.schema.extra is None and not self._keys_left(f):
                        return False
                    self.expect = "key"
                    return True
                if f.schema.max_items is not None and f.count >= f.schema.max_items:
                    return False
                self.expect = "value"
                return True
            if c == "}" and f.kind == "{":
                return self._close_object()
            if c == "]" and f.kind == "[":
                return self._close_array()
            return False
        return False  # done: nothing but the end may follow

    def _value_start(self, c: str) -> bool:
        f = self.stack[-1] if self.stack else None
        if f is not None and f.kind == "[" and f.schema.unique and c not in "{[":
            self.item = c  # a scalar item: its text is kept to compare with the earlier ones
        fits = _fits(self._value_schema(), c)
        if not fits:
            return False
        for alt in fits[1:]:  # several alternatives may begin so: each is read on a branch of its own
            other = self.copy()
            if other._begin(alt, c):
                self.forks.append(other)
        return self._begin(fits[0], c)

    def _begin(self, alt: Schema, c: str) -> bool:
        """A value of alternative `alt` begins with c."""
        if alt.kind == "any" and c in "tfn":
            alt = LITERALS  # any value starting so is one of JSON's literals
        if alt.kind == "texts":
            seen = self.stack[-1].seen if self.item is not None else ()
            self.choices = tuple(t[1:] for t in alt.texts if t.startswith(c) and canonical(t) not in seen)
            self.choosing_key = False
            if not self.choices:
                return False
            if self.choices == ("",):
                self._choice_made()
            return True
        if c == "{":
            self.stack.append(Frame("{", alt if alt.kind == "object" else ANY_OBJECT))
            self.expect = "key_or_close"
            return True
        if c == "[":
            self.stack.append(Frame("[", alt if alt.kind == "array" else ANY_ARRAY))
            self.expect = "value_or_close"
            return True
        if c == '"':
            self.string, self.value, self.length = "value", alt, 0
            self.matched = None if alt.pattern is None else alt.pattern.start()
            return True
        self.number, self.integer = ("sign" if c == "-" else "zero" if c == "0" else "int"), alt.kind == "integer"
        self.value, self.digits = alt, c
        return self._reachable(c)

    def _reachable(self, text: str) -> bool:
        """Whether the number written so far as `text` can still end within its schema's bounds."""
        if self.integer:
            return integer_reachable(text, self.value.low, self.value.high)
        return self.value.bounds is None or number_reachable(text, self.value.bounds)

    def _in_range(self) -> bool:
        """A number that ends here lies within its bounds."""
        if self.integer:
            return self.value.low <= int(self.digits) <= self.value.high
        if self.value.bounds is None:
            return True
        x = Fraction(self.digits)
        return _meet(((x, True), (x, True)), self.value.bounds)

    def _counted(self) -> bool:
        """One more character in a string value, within its maxLength."""
        self.length += 1
        return self.value.max_length is None or self.length <= self.value.max_length

    def _keys_left(self, f: Frame) -> list[str]:
        return [name for name, _ in f.schema.properties if name not in f.keys]

    def _key_start(self) -> bool:
        f = self.stack[-1]
        if f.schema.extra is None:  # only the schema's own keys, each once: one of their texts
            left = self._keys_left(f)
            if not left:
                return False
            self.choices, self.choosing_key, self.text = tuple(dump(k)[1:] for k in left), True, ""
            return True
        self.string, self.text = "key", ""
        return True

    def _choice_made(self) -> None:
        """A text of the choices is complete: a key (its closing quote included) or a value."""
        key = self.choosing_key
        self.choices, self.choosing_key = (), False
        if key:
            self.stack[-1].keys += (json.loads('"' + self.text),)
            self.expect = "colon"
        else:
            self._value_ended()

    def _close_object(self) -> bool:
        f = self.stack[-1]
        if not f.schema.required <= set(f.keys):
            return False
        self.stack.pop()
        self._value_ended()
        return True

    def _close_array(self) -> bool:
        f = self.stack[-1]
        if f.count < f.schema.min_items:
            return False
        self.stack.pop()
        self._value_ended()
        return True

    def _value_ended(self) -> bool:
        """A value is complete; False if it is a scalar item its array (uniqueItems) holds already."""
        self.value, self.length, self.digits, self.integer, self.hexa, self.high = ANY[0], 0, "", False, "", False
        self.matched = None
        if self.item is not None:
            item, self.item = canonical(self.item), None
            if item in self.stack[-1].seen:
                return False
            self.stack[-1].seen += (item,)
        if self.stack and self.stack[-1].kind == "[":
            self.stack[-1].count += 1
        self.expect = "comma_or_close" if self.stack else "done"
        return True

    def _string_char(self, c: str) -> bool:
        """A character of a string value. Its length counts characters: an escape is one, counted at its
        backslash, except after a high surrogate's \\u escape, where it is counted at its end unless it is the
        pair's low half (the pair is one character). Under a pattern an escape is taken only while a character it
        may still stand for goes on with the pattern, and surrogates are not escaped."""
        if self.string == "key":
            return self._key_char(c)
        if self.escape == -1:  # after a backslash
            if c not in ESCAPES:
                return False
            self.escape, self.hexa = (4 if c == "u" else 0), ""
            if c == "u":
                return self._may_take(0, 0xFFFF)
            after_high, self.high = self.high, False
            return (not after_high or self._counted()) and self._matches(UNESCAPED.get(c, c))
        if self.escape > 0:  # a \\u escape's hex digits
            if c not in HEX:
                return False
            self.escape, self.hexa = self.escape - 1, self.hexa + c
            if self.escape > 0:
                lo = int(self.hexa, 16) << 4 * self.escape
                return self._may_take(lo, lo + (1 << 4 * self.escape) - 1)
            code, after_high = int(self.hexa, 16), self.high
            self.high = 0xD800 <= code <= 0xDBFF
            if self.matched is not None:
                return self._matches(chr(code))  # not a surrogate: _may_take refused them
            return not after_high or 0xDC00 <= code <= 0xDFFF or self._counted()
        if c == "\\":
            self.escape = -1
            return (self.high or self._counted()) and self._may_take(0, 0xFFFF)
        self.high = False
        if c == '"':
            if self.length < self.value.min_length or self.matched is not None and not \
                    self.value.pattern.accepts(self.matched):
                return False
            self.string = None
            return self._value_ended()
        return ord(c) >= 0x20 and self._counted() and self._matches(c)

    def may_take(self, lo: int, hi: int) -> bool:
        """Whether a character in [lo, hi] (not ASCII) may come next: in one of the texts chosen among, or as
        written in a string (a key, or a value with room left and a pattern that takes one)."""
        if self.choices:
            return any(t and lo <= ord(t[0]) <= hi for t in self.choices)
        if self.string is None or self.escape:
            return False
        if self.string == "key":
            return True
        room = self.value.max_length is None or self.length < self.value.max_length
        return room and self._may_take(lo, hi)

    def _matches(self, ch: str) -> bool:
        """The string value goes on with ch under its pattern (if it has one), to some match of a length its
        minLength and maxLength allow."""
        if self.matched is None:
            return True
        v = self.value
        self.matched = v.pattern.step(self.matched, ch)
        if self.matched and (v.min_length or v.max_length is not None):
            return v.pattern.fits(self.matched, self.length, v.min_length, v.max_length)
        return bool(self.matched)

    def _may_take(self, lo: int, hi: int) -> bool:
        """Some character in [lo, hi], not a surrogate, goes on with the string value's pattern (if it has one)."""
        if self.matched is None:
            return True
        p = self.value.pattern
        return (lo <= 0xD7FF and p.takes(self.matched, lo, min(hi, 0xD7FF))
                or hi >= 0xE000 and p.takes(self.matched, max(lo, 0xE000), hi))

    def _key_char(self, c: str) -> bool:
        if self.escape == -1:
            if c not in ESCAPES:
                return False
            self.escape = 4 if c == "u" else 0
        elif self.escape > 0:
            if c not in HEX:
                return False
            self.escape -= 1
        elif c == "\\":
            self.escape = -1
        elif c == '"':
            self.string = None
            f = self.stack[-1]
            name = json.loads('"' + self.text + '"')
            if name in f.keys:
                return False
            f.keys += (name,)
            self.expect = "colon"
            return True
        elif ord(c) < 0x20:
            return False
        self.text += c
        return True


MAX_BRANCHES = 64  # readings kept at once; a schema that opens more loses its latest (never a dead end: each lives)


class JsonPrefix:
    """Where a JSON text stands after the characters fed so far; feed() says whether they keep it a prefix of a
    value (of the schema's alternatives, None: an object of any shape, JSON mode's). Where the schema offers
    several alternatives a value may begin as (anyOf two object schemas), each is read on a branch of its own and
    dropped when the text leaves it; branches that come to read the rest alike merge."""

    def __init__(self, schema: tuple[Schema, ...] | None = None):
        self.branches = [Branch(schema)]

    def copy(self) -> JsonPrefix:
        c = JsonPrefix.__new__(JsonPrefix)
        c.branches = [b.copy() for b in self.branches]
        return c

    @property
    def done(self) -> bool:
        return any(b.done for b in self.branches)

    def may_take(self, lo: int, hi: int) -> bool:
        """Some reading may go on with a character in [lo, hi] (the one whose bytes a token began)."""
        return any(b.may_take(lo, hi) for b in self.branches)

    def last_member(self) -> None:
        """Where the text stops at the start of a member's value (a lead such as a forced tool call's
        `{"name": "f", "arguments": `), that member is its object's last."""
        for b in self.branches:
            if b.expect == "value" and b.string is None and b.number is None and not b.choices:
                b.last_depth = len(b.stack)

    def feed(self, text: str) -> bool:
        for c in text:
            alive: dict[tuple, Branch] = {}
            for b in self.branches:
                for n in b.step(c):
                    alive.setdefault(n.key(), n)
            if not alive:
                return False
            self.branches = list(alive.values())[:MAX_BRANCHES]
        return True


class JsonConstraint:
    """The tokens that keep a reply one JSON object, or one value of `schema` (a JSON schema). lead: JSON the prompt
    already opened, which the reply goes on from; a lead that stops where a member's value begins (a forced tool
    call's `{"name": "f", "arguments": `) makes that member the object's last."""

    def __init__(self, tokenizer, eos_ids: set[int], lead: str = "", schema: dict | None = None):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.state = JsonPrefix(compile_schema(schema) if schema is not None else None)
        if not self.state.feed(lead):
            raise SchemaError(f"not the start of a JSON value of the schema: {lead!r}")
        self.state.last_member()
        self.text = TokenText(tokenizer)

    def allows(self, token: int) -> bool:
        if token in self.eos_ids:
            return self.state.done
        if self.state.done:
            return False
        added, pending = self.text.added(token)
        after = self.state.copy()
        if not after.feed(added) or not (added or pending):
            return False
        return pending is None or after.may_take(*pending)  # bytes of a character to come: one it may become

    def advance(self, token: int) -> None:
        added = self.text.push(token)
        if token not in self.eos_ids:
            self.state.feed(added)
