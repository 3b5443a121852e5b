"""Whether a Lark grammar's start rule derives no string at all (llguidance compiles `start: "a" start` and the
reply would run to its budget on a's): the rules that derive some string, found as a fixpoint over the grammar's
expansions. Text it cannot read is taken as deriving something, so an unusual grammar is never refused here.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r'''\s+|//[^\n]*|"(?:\\.|[^"\\])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|[A-Za-z_][A-Za-z_0-9]*|\.\.
                   |\d+|[()|?*+~\[\]{},&.]''', re.VERBOSE)


def tokens_of(body: str) -> list[str] | None:
    """An expansion's tokens (blanks and comments dropped); None where some text is no token."""
    out, i = [], 0
    while i < len(body):
        m = TOKEN.match(body, i)
        if not m:
            return None
        if m[0].strip() and not m[0].startswith("//"):
            out.append(m[0])
        i = m.end()
    return out


def rules_of(lark: str) -> dict[str, list[str]] | None:
    """Each rule's (and terminal's) expansion tokens, alternatives split by "|"; an inline JSON schema is one
    token. None where a line is not `name: ...`, `| ...` or a directive."""
    rules: dict[str, list[str]] = {}
    name = None
    for line in lark.splitlines():
        text = line.strip()
        if not text or text.startswith("//"):
            continue
        if text.startswith("%"):
            name = None
            continue
        m = re.match(r"^[?!]?([A-Za-z_][A-Za-z_0-9]*)(\.-?\d+)?\s*:(.*)$", text)
        if m:
            name, body = m[1], m[3]
            if name in rules:
                rules[name].append("|")
            rules.setdefault(name, [])
        elif text.startswith("|") and name is not None:
            body = text
        else:
            return None
        if "%json" in body:
            body = body[:body.index("%json")] + '"json"'  # a schema's value: some string (llguidance checks it)
            name_after = None
        else:
            name_after = name
        tokens = tokens_of(body)
        if tokens is None:
            return None
        rules[name] += tokens
        name = name_after
    return rules


def derives_nothing(lark: str, start: str = "start") -> bool:
    rules = rules_of(lark)
    if not rules or start not in rules:
        return False
    live: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, tokens in rules.items():
            if name not in live:
                try:
                    ok, _ = _alternatives(tokens, 0, rules, live)
                except (IndexError, ValueError):
                    return False  # not read: taken as deriving something
                if ok:
                    live.add(name)
                    grew = True
    return start not in live


def _alternatives(tokens: list[str], i: int, rules, live) -> tuple[bool, int]:
    ok, i = _sequence(tokens, i, rules, live)
    while i < len(tokens) and tokens[i] == "|":
        more, i = _sequence(tokens, i + 1, rules, live)
        ok = ok or more
    return ok, i


def _sequence(tokens: list[str], i: int, rules, live) -> tuple[bool, int]:
    ok = True
    while i < len(tokens) and tokens[i] not in ("|", ")", "]"):
        item, i = _item(tokens, i, rules, live)
        ok = ok and item
    return ok, i


def _item(tokens: list[str], i: int, rules, live) -> tuple[bool, int]:
    t = tokens[i]
    if t in ("(", "["):
        ok, i = _alternatives(tokens, i + 1, rules, live)
        if tokens[i] != {"(": ")", "[": "]"}[t]:
            raise ValueError("unbalanced")
        ok, i = ok or t == "[", i + 1
    elif t[0] in "\"/%" or t == ".." or t == "&":
        ok, i = True, i + 1
    elif re.fullmatch(r"[A-Za-z_]\w*", t):
        ok, i = t in live or t not in rules, i + 1  # a name not defined: llguidance's own error, not ours
    else:
        raise ValueError(t)
    while i < len(tokens) and tokens[i] in ("?", "*", "+", "~", "{"):
        op = tokens[i]
        if op in ("?", "*"):
            ok, i = True, i + 1
        elif op == "+":
            i += 1
        elif op == "~":
            low = int(tokens[i + 1])
            i += 2
            if i < len(tokens) and tokens[i] == "..":
                i += 2
            ok = ok or low == 0
        else:  # {m} or {m,n}
            low = int(tokens[i + 1])
            i += 2
            while tokens[i] != "}":
                i += 1
            i += 1
            ok = ok or low == 0
    return ok, i
