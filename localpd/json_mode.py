"""JSON mode: the reply is one JSON object, token by token.

JsonPrefix recognises the prefixes of a JSON text one character at a time (a pushdown automaton: a stack of open
objects and arrays, and where in a value or between values it stands). JsonConstraint puts it in front of the
sampler: a token is allowed when the text it adds keeps the reply a JSON prefix; end of sequence is allowed only,
and then alone, once the object is closed. The sampler asks about candidates in order of probability and takes
the first allowed one, so a model that wants to write JSON pays one check per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WS = " \t\n\r"
ESCAPES = '"\\/bfnrtu'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
NUMBER_ENDS = ("zero", "int", "frac", "exp")  # number states a value may end in
MAX_WS = 64  # whitespace in a row outside strings (an indent 32 levels deep), and line breaks in it: more is a
MAX_BREAKS = 2  # model stuck on blanks, not formatting


@dataclass
class JsonPrefix:
    """Where a JSON text stands after the characters fed so far; feed() says whether they keep it a prefix."""

    stack: list[str] = field(default_factory=list)  # "{" or "[" per open container
    expect: str = "top"  # top | value | key | key_or_close | colon | comma_or_close | value_or_close | done
    string: str | None = None  # inside a string: "key" or "value"
    escape: int = 0  # inside a string: -1 after a backslash, n > 0 hex digits of \\u still to come
    number: str | None = None  # inside a number: sign | zero | int | dot | frac | e | esign | exp
    literal: str = ""  # inside true/false/null: the letters still to come
    ws: int = 0  # whitespace characters in a row
    breaks: int = 0  # line breaks among them
    last_depth: int = 0  # > 0: the container open at this depth takes no member after the current one

    def copy(self) -> JsonPrefix:
        return JsonPrefix(list(self.stack), self.expect, self.string, self.escape, self.number, self.literal, self.ws,
                          self.breaks, self.last_depth)

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def feed(self, text: str) -> bool:
        return all(self._char(c) for c in text)

    def _char(self, c: str) -> bool:
        if self.string is not None:
            return self._string_char(c)
        if self.literal:
            if c != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_ended()
            return True
        if self.number is not None:
            if self._number_char(c):
                return True
            if self.number not in NUMBER_ENDS:
                return False
            self.number = None
            self._value_ended()  # c is the first character after the number
        if c in WS:
            self.ws += 1
            self.breaks += c == "\n"
            return self.ws <= MAX_WS and self.breaks <= MAX_BREAKS
        self.ws = self.breaks = 0
        e = self.expect
        if e == "top":
            return self._open(c) if c == "{" else False
        if e in ("value", "value_or_close"):
            if c == "]" and e == "value_or_close":
                return self._close("[")
            return self._value_start(c)
        if e in ("key", "key_or_close"):
            if c == "}" and e == "key_or_close":
                return self._close("{")
            if c == '"':
                self.string = "key"
                return True
            return False
        if e == "colon":
            if c == ":":
                self.expect = "value"
                return True
            return False
        if e == "comma_or_close":
            if c == "," and len(self.stack) != self.last_depth:
                self.expect = "key" if self.stack[-1] == "{" else "value"
                return True
            if c in "}]":
                return self._close("{" if c == "}" else "[")
            return False
        return False  # done: nothing but the end may follow

    def _value_start(self, c: str) -> bool:
        if c in "{[":
            return self._open(c)
        if c == '"':
            self.string = "value"
            return True
        if c in LITERALS:
            self.literal = LITERALS[c]
            return True
        if c == "-":
            self.number = "sign"
            return True
        if c in DIGITS:
            self.number = "zero" if c == "0" else "int"
            return True
        return False

    def _open(self, c: str) -> bool:
        self.stack.append(c)
        self.expect = "key_or_close" if c == "{" else "value_or_close"
        return True

    def _close(self, kind: str) -> bool:
        if not self.stack or self.stack[-1] != kind:
            return False
        self.stack.pop()
        self._value_ended()
        return True

    def _value_ended(self) -> None:
        self.expect = "comma_or_close" if self.stack else "done"

    def _string_char(self, c: str) -> bool:
        if self.escape == -1:
            if c not in ESCAPES:
                return False
            self.escape = 4 if c == "u" else 0
            return True
        if self.escape > 0:
            if c not in HEX:
                return False
            self.escape -= 1
            return True
        if c == "\\":
            self.escape = -1
            return True
        if c == '"':
            kind, self.string = self.string, None
            if kind == "key":
                self.expect = "colon"
            else:
                self._value_ended()
            return True
        return ord(c) >= 0x20

    def _number_char(self, c: str) -> bool:
        n = self.number
        moves = {
            "sign": {**dict.fromkeys(DIGITS, "int"), "0": "zero"},
            "zero": {".": "dot", "e": "e", "E": "e"},
            "int": {**dict.fromkeys(DIGITS, "int"), ".": "dot", "e": "e", "E": "e"},
            "dot": dict.fromkeys(DIGITS, "frac"),
            "frac": {**dict.fromkeys(DIGITS, "frac"), "e": "e", "E": "e"},
            "e": {**dict.fromkeys(DIGITS, "exp"), "+": "esign", "-": "esign"},
            "esign": dict.fromkeys(DIGITS, "exp"),
            "exp": dict.fromkeys(DIGITS, "exp"),
        }[n]
        if c not in moves:
            return False
        self.number = moves[c]
        return True


class JsonConstraint:
    """The tokens that keep a reply one JSON object. lead: JSON the prompt already opened, which the reply goes on
    from; a lead that stops where a member's value begins (a forced tool call's `{"name": "f", "arguments": `) makes
    that member the object's last."""

    def __init__(self, tokenizer, eos_ids: set[int], lead: str = ""):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.state = JsonPrefix()
        if not self.state.feed(lead):
            raise ValueError(f"not the start of a JSON object: {lead!r}")
        if self.state.expect == "value":
            self.state.last_depth = len(self.state.stack)
        self.output: list[int] = []
        self._text = ""  # decode(self.output[-WINDOW:]), what a candidate's text is measured against

    WINDOW = 4  # tokens decoded with a candidate, so that pieces that depend on their neighbours come out right

    def allows(self, token: int) -> bool:
        if token in self.eos_ids:
            return self.state.done
        if self.state.done:
            return False
        added, pending = self._added(token)
        if not added:  # bytes of a character still to come are allowed where any character is: in a string
            return pending and self.state.string is not None
        return self.state.copy().feed(added)

    def advance(self, token: int) -> None:
        if token not in self.eos_ids:
            self.state.feed(self._added(token)[0])
        self.output.append(token)
        self._text = self.tokenizer.decode(self.output[-self.WINDOW:]).rstrip("\ufffd")

    def _added(self, token: int) -> tuple[str, bool]:
        """The whole characters a token adds to the reply, and whether it leaves bytes of one more pending."""
        text = self.tokenizer.decode(self.output[-self.WINDOW:] + [token])
        if not text.startswith(self._text):
            return "", False
        added = text[len(self._text):]
        whole = added.rstrip("\ufffd")
        return whole, whole != added
