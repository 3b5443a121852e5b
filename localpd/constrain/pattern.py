"""A JSON schema string's `pattern` (or its `format`) as an automaton over characters, for JSON mode.

The regular part of ECMA-262's regular expressions: characters and escapes (\\n, \\t, \\xHH, \\uHHHH, \\. ...),
`.`, classes ([a-z_], [^...], \\d \\w \\s and their negations), groups ((...), (?:...), (?<name>...)), alternation,
the quantifiers * + ? {n} {n,} {n,m} (lazy ones too: a recogniser does not care which match is found) and the
anchors ^ and $. As JSON schema says, a pattern matches anywhere in the string unless anchored. Backreferences,
lookaround and word boundaries are not regular here and are refused (PatternError).

PatternConstraint holds a whole reply to a pattern (vLLM's guided_regex, and guided_choice as an alternation of
the choices, escaped: choice_pattern).

Pattern builds a Thompson NFA. A reading is the frozenset of states the characters so far may have reached, kept
to the live ones (from which some string still ends in a match), so a reading that is not empty can always be
finished: step() on a character the pattern cannot go on with gives the empty set.
"""

from __future__ import annotations

import functools
import math
import re
from collections import deque

from localpd.text.tokenizer import TokenText

MAX = 0x10FFFF
MAX_STATES = 20_000


class PatternError(ValueError):
    pass


def ranges(*pairs: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """A set of code points as sorted, disjoint, non-adjacent inclusive ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(pairs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(rs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for lo, hi in rs:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX:
        out.append((start, MAX))
    return tuple(out)


def chars(text: str) -> tuple[tuple[int, int], ...]:
    return ranges(*((ord(c), ord(c)) for c in text))


DIGIT = chars("0123456789")
WORD = ranges((48, 57), (65, 90), (95, 95), (97, 122))
SPACE = ranges(*((ord(c), ord(c)) for c in "\t\n\v\f\r \u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff"),
               (0x2000, 0x200A))
ANY = ((0, MAX),)
DOT = complement(chars("\n\r\u2028\u2029"))
CLASS_ESCAPES = {"d": DIGIT, "D": complement(DIGIT), "w": WORD, "W": complement(WORD), "s": SPACE,
                 "S": complement(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}

# the formats a model is asked for most (pydantic's date, datetime, time, UUID, EmailStr, IPv4Address, AnyUrl);
# others are annotations and are not held. Whatever is written parses: years 0001-9999 (Python's), each month's
# days, and the 29th of February in leap years only (divisible by 4, and a century only if by 400).
_YEAR = r"([1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_DATE = rf"({_YEAR}-{_DAY}|{_LEAP}-02-29)"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "time": rf"^{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63}){1,4}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*://[^\s\x00-\x1f\"<>\\^`{|}]+$",
}


def _parse(pattern: str):
    """The pattern as a tree: ("set", ranges), ("seq", [nodes]), ("alt", [nodes]), ("rep", node, lo, hi or None),
    ("^",), ("$",)."""
    pos = 0

    def error(what: str) -> PatternError:
        return PatternError(f"pattern {pattern!r} {what}"[:200])

    def peek() -> str:
        return pattern[pos] if pos < len(pattern) else ""

    def take() -> str:
        nonlocal pos
        if pos >= len(pattern):
            raise error("ends in the middle of an escape or a class")
        pos += 1
        return pattern[pos - 1]

    def hex_digits(n: int) -> int:
        digits = "".join(take() for _ in range(n))
        if not re.fullmatch(r"[0-9a-fA-F]+", digits):
            raise error(f"has a bad escape (\\x or \\u with {digits!r})")
        return int(digits, 16)

    def escape(in_class: bool):
        """After a backslash: the ranges it stands for."""
        c = take()
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CHAR_ESCAPES:
            return chars(CHAR_ESCAPES[c])
        if c == "x":
            return chars(chr(hex_digits(2)))
        if c == "u":
            return chars(chr(hex_digits(4)))
        if c == "b" and in_class:
            return chars("\b")
        if c in "bB":
            raise error("uses a word boundary (\\b), which localpd cannot hold")
        if c.isdigit():
            raise error("uses a backreference, which localpd cannot hold")
        if c.isalnum():
            raise error(f"uses the escape \\{c}, which localpd does not know")
        return chars(c)

    def klass():
        negate = peek() == "^"
        if negate:
            take()
        parts = []
        while True:
            c = take()
            if c == "]":
                break
            lo = escape(True) if c == "\\" else chars(c)
            if peek() == "-" and pos + 1 < len(pattern) and pattern[pos + 1] != "]":
                take()
                c2 = take()
                hi = escape(True) if c2 == "\\" else chars(c2)
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise error("has a class range between sets")
                if lo[0][0] > hi[0][0]:
                    raise error("has a class range out of order")
                parts.append((lo[0][0], hi[0][0]))
            else:
                parts.extend(lo)
        rs = ranges(*parts)
        return complement(rs) if negate else rs

    def atom():
        nonlocal pos
        c = take()
        if c == "(":
            if pattern.startswith("?:", pos):
                pos += 2
            elif pattern.startswith("?<", pos) and not pattern.startswith(("?<=", "?<!"), pos):
                end = pattern.find(">", pos)
                if end < 0:
                    raise error("has an unclosed group name")
                pos = end + 1
            elif peek() == "?":
                raise error("uses lookaround, which localpd cannot hold")
            node = alternation()
            if peek() != ")":
                raise error("has an unclosed group")
            pos += 1
            return node
        if c == "[":
            return ("set", klass())
        if c == ".":
            return ("set", DOT)
        if c in "^$":
            return (c,)
        if c == "\\":
            return ("set", escape(False))
        if c in "*+?":
            raise error(f"has nothing for {c} to repeat")
        if c == ")":
            raise error("has an unmatched )")
        return ("set", chars(c))

    def repeated():
        nonlocal pos
        node = atom()
        while True:
            c = peek()
            if c in ("*", "+", "?", "{") and node[0] in ("^", "$"):
                raise error("repeats an anchor")
            if c in ("*", "+", "?"):
                pos += 1
                node = ("rep", node, 0 if c != "+" else 1, 1 if c == "?" else None)
            elif c == "{" and (m := re.match(r"\{(\d+)(,(\d*))?\}", pattern[pos:])):
                pos += m.end()
                lo = int(m[1])
                hi = lo if m[2] is None else int(m[3]) if m[3] else None
                if hi is not None and hi < lo:
                    raise error("has a repeat {n,m} with m < n")
                node = ("rep", node, lo, hi)
            else:
                return node
            if peek() == "?":  # lazy: the same strings
                pos += 1

    def sequence():
        items = []
        while peek() not in ("", "|", ")"):
            items.append(repeated())
        return ("seq", items)

    def alternation():
        nonlocal pos
        branches = [sequence()]
        while peek() == "|":
            pos += 1
            branches.append(sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    tree = alternation()
    if pos != len(pattern):
        raise error("has an unmatched )")
    return tree


@functools.lru_cache(maxsize=256)
def compiled(pattern: str, whole: bool = False) -> Pattern:
    """Pattern(pattern, whole), built once for the requests and schemas that repeat it."""
    return Pattern(pattern, whole)


class Pattern:
    """An NFA of a pattern, searched anywhere in the string (whole: matching all of it): state 0 starts, `accept`
    ends. moves[s]: (ranges, target) edges on a character; empty[s]: (kind, target) edges on none, kind "" always,
    "^" only before the first character, "$" only after the last."""

    def __init__(self, pattern: str, whole: bool = False):
        self.source = pattern
        self.moves: list[list] = []
        self.empty: list[list] = []
        start, self.accept = self._state(), self._state()
        around = [("^",), ("$",)] if whole else [("rep", ("set", ANY), 0, None)] * 2
        s, e = self._build(("seq", [around[0], _parse(pattern), around[1]]))
        self.empty[start].append(("", s))
        self.empty[e].append(("", self.accept))
        self.live = self._live()
        self.first = self._close({start}, True)
        self._steps: dict = {}
        self._dist: list[float] | None = None  # fewest characters from each state to a match (_shortest)
        self._anys: dict = {}
        self._fits: dict = {}

    def _state(self) -> int:
        if len(self.moves) >= MAX_STATES:
            raise PatternError(f"pattern {self.source!r} is too large to hold"[:200])
        self.moves.append([])
        self.empty.append([])
        return len(self.moves) - 1

    def _build(self, node) -> tuple[int, int]:
        kind = node[0]
        s = self._state()
        if kind == "set":
            e = self._state()
            self.moves[s].append((node[1], e))
            return s, e
        if kind in ("^", "$"):
            e = self._state()
            self.empty[s].append((kind, e))
            return s, e
        if kind == "alt":
            e = self._state()
            for branch in node[1]:
                bs, be = self._build(branch)
                self.empty[s].append(("", bs))
                self.empty[be].append(("", e))
            return s, e
        if kind == "seq":
            e = s
            for part in node[1]:
                e = self._then(e, part)
            return s, e
        _, sub, lo, hi = node  # a repeat: lo copies, then one that loops or hi - lo that may each be the last
        e = s
        for _ in range(lo):
            e = self._then(e, sub)
        end = self._state()
        if hi is None:
            ps, pe = self._build(sub)
            self.empty[e].append(("", ps))
            self.empty[pe] += [("", ps), ("", end)]
        else:
            for _ in range(hi - lo):
                self.empty[e].append(("", end))
                e = self._then(e, sub)
        self.empty[e].append(("", end))
        return s, end

    def _then(self, e: int, node) -> int:
        """node's automaton after state e; its end."""
        ps, pe = self._build(node)
        self.empty[e].append(("", ps))
        return pe

    def _close(self, states, at_start: bool, at_end: bool = False) -> frozenset:
        out, todo = set(states), list(states)
        while todo:
            for kind, t in self.empty[todo.pop()]:
                if t not in out and (kind == "" or kind == "^" and at_start or kind == "$" and at_end):
                    out.add(t)
                    todo.append(t)
        return frozenset(out)

    def _live(self) -> frozenset:
        """The states from which some string ends in a match: through characters and plain empty edges they
        reach one from which empty edges alone end it ("$" among them: after the last character)."""
        back_end: list[list[int]] = [[] for _ in self.moves]
        back: list[list[int]] = [[] for _ in self.moves]
        for s in range(len(self.moves)):
            for _, t in self.moves[s]:
                back[t].append(s)
            for kind, t in self.empty[s]:
                if kind != "^":
                    back_end[t].append(s)
                if kind == "":
                    back[t].append(s)
        return frozenset(_reach(back, _reach(back_end, {self.accept})))

    def start(self) -> frozenset:
        return self.first & self.live

    def step(self, states: frozenset, ch: str) -> frozenset:
        key = (states, ch)
        if key not in self._steps:
            cp = ord(ch)
            nxt = {t for s in states for rs, t in self.moves[s] if _within(rs, cp)}
            if len(self._steps) > 100_000:
                self._steps.clear()
            self._steps[key] = self._close(nxt, False) & self.live
        return self._steps[key]

    def accepts(self, states: frozenset) -> bool:
        return self.accept in self._close(states, False, True)

    def fits(self, states: frozenset, used: int, least: int, most: int | None) -> bool:
        """Whether from these states, `used` characters in, some string ends in a match with least <= its whole
        length <= most (None: no limit): a pattern and a string's minLength/maxLength held together, so that
        neither leads the other into a string no character can finish."""
        key = (states, max(0, least - used), None if most is None else most - used)
        if key not in self._fits:
            if len(self._fits) > 100_000:
                self._fits.clear()
            self._fits[key] = self._fit(states, *key[1:])
        return self._fits[key]

    def _fit(self, states: frozenset, least: int, most: int | None) -> bool:
        dist = self._shortest()
        for k in range(least + 1):  # k more characters, whatever they are
            if not states or most is not None and k > most:
                return False
            if k == least:  # every live state leads to a match; the nearest must be near enough
                return most is None or k + min(dist[s] for s in states) <= most
            states = self._any(states)
        return False

    def _any(self, states: frozenset) -> frozenset:
        """The live states one character (any) on."""
        if states not in self._anys:
            if len(self._anys) > 100_000:
                self._anys.clear()
            self._anys[states] = self._close({t for s in states for _, t in self.moves[s]}, False) & self.live
        return self._anys[states]

    def _shortest(self) -> list[float]:
        """Fewest characters from each state to one from which empty edges end a match (0-1 BFS backwards:
        a character edge weighs 1, a plain empty edge 0; "^" edges cannot be taken past the start)."""
        if self._dist is None:
            back: list[list[tuple[int, int]]] = [[] for _ in self.moves]
            back_end: list[list[int]] = [[] for _ in self.moves]
            for s in range(len(self.moves)):
                for _, t in self.moves[s]:
                    back[t].append((s, 1))
                for kind, t in self.empty[s]:
                    if kind == "":
                        back[t].append((s, 0))
                    if kind != "^":
                        back_end[t].append(s)
            dist = [math.inf] * len(self.moves)
            todo: deque = deque()
            for s in _reach(back_end, {self.accept}):
                dist[s] = 0
                todo.append(s)
            while todo:
                t = todo.popleft()
                for s, w in back[t]:
                    if dist[t] + w < dist[s]:
                        dist[s] = dist[t] + w
                        todo.appendleft(s) if w == 0 else todo.append(s)
            self._dist = dist
        return self._dist

    def takes(self, states: frozenset, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] goes on from these states."""
        return any(t in self.live and any(a <= hi and lo <= b for a, b in rs)
                   for s in states for rs, t in self.moves[s])


def _within(rs, cp: int) -> bool:
    return any(a <= cp <= b for a, b in rs)


def _reach(back: list[list[int]], seeds: set[int]) -> set[int]:
    out, todo = set(seeds), list(seeds)
    while todo:
        for s in back[todo.pop()]:
            if s not in out:
                out.add(s)
                todo.append(s)
    return out


def escape(text: str) -> str:
    """text as a pattern that matches it alone."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/-])", r"\\\1", text)


def choice_pattern(choices: list[str]) -> str:
    """A pattern whose whole matches are exactly the choices."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise PatternError("the choices must be a non-empty list of non-empty strings")
    return "|".join(escape(c) for c in choices)


class PatternConstraint:
    """The tokens that keep a reply the prefix of a whole match of `pattern`; the end of sequence only once the
    reply is one (the sampler's constraint, as json_mode.JsonConstraint)."""

    def __init__(self, tokenizer, eos_ids: set[int], pattern: str):
        self.pattern = compiled(pattern, whole=True)
        self.states = self.pattern.start()
        self.eos_ids = set(eos_ids)
        self.text = TokenText(tokenizer)

    def _feed(self, states: frozenset, text: str) -> frozenset:
        for ch in text:
            states = self.pattern.step(states, ch)
            if not states:
                break
        return states

    def allows(self, token: int) -> bool:
        if token in self.eos_ids:
            return self.pattern.accepts(self.states)
        added, pending = self.text.added(token)
        states = self._feed(self.states, added)
        if not states:
            return False
        if pending is not None:  # bytes of one more character to come: a character they may become must go on
            return self.pattern.takes(states, *pending)
        return bool(added)

    def advance(self, token: int) -> None:
        added = self.text.push(token)
        if token not in self.eos_ids:
            self.states = self._feed(self.states, added)
