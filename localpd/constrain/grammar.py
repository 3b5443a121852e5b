"""Structured outputs on llguidance: a JSON schema, JSON mode, a regex, a choice or a grammar (GBNF or Lark) as a
grammar, and the constraint that masks every token of the vocabulary the grammar refuses, once a step.

llguidance (the engine llama.cpp and vLLM use) compiles a grammar in about a millisecond and computes the whole
vocabulary's mask in tens of microseconds a token (docs/PERF.md). What localpd adds: JSON written as people write
it (one space at most before the value, at most two line breaks and 32 blanks between its tokens, integers of at
most 18 digits and numbers below 1e15 where a schema sets no bounds, so a small model cannot loop on blanks or
digits), and errors that name what the engine cannot take.
"""

from __future__ import annotations

import functools
import json
import re

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from localpd.constrain.lark_empty import derives_nothing

INT_LIMIT = 10**18 - 1  # an integer without bounds: at most 18 digits (int64 holds them)
NUMBER_LIMIT = 1e15  # a number without bounds: below 1e15 in magnitude (a double holds 15 digits exactly)
BLANKS = r"[ \t]{1,32}|(\r?\n){1,2}[ \t]{0,32}"  # between a JSON value's tokens: blanks, or up to two line breaks
# and an indent
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": f"({BLANKS})?", "coerce_one_of": True,
                "json_allow_general_unicode_escapes": True}
FORMATS = {"date", "date-time", "time", "duration", "uuid", "ipv4", "ipv6", "email", "uri", "hostname"}  # held
NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema maps
RUST_META = set("\\.+*?()|[]{}^$#&-~")

# before the JSON: one space at most (" {" is one token of the BPE vocabularies, what a completion after "...:" writes),
# and a thinking model's blanks between its </think> and the JSON
LEAD, AFTER_REASONING = r" ?", r"[ \t]{0,2}(\r?\n[ \t]{0,2}){0,2}"

# JSON mode without a schema: one object, its numbers and blanks bounded as above
ANY_OBJECT = r"""
start: _LEAD object
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" _B? (pair (_B? "," _B? pair)* _B?)? "}"
pair: STRING _B? ":" _B? value
array: "[" _B? (value (_B? "," _B? value)* _B?)? "]"
STRING: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
NUMBER: /-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?/
_B: /@BLANKS@/
""".replace("@BLANKS@", BLANKS)


class GrammarError(ValueError):
    """A schema, pattern or grammar the engine cannot take, in one line that names what it could not."""


def json_grammar(schema: dict | None, after_reasoning: bool = False) -> str:
    """JSON mode's grammar: one object, or one value of a schema, opening the reply; after_reasoning: a thinking
    model's answer, which may open with a few blanks after its </think>."""
    lead = f"_LEAD: /{AFTER_REASONING if after_reasoning else LEAD}/\n"
    if schema is None:
        return llguidance.LLMatcher.grammar_from_lark(ANY_OBJECT + lead)
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    held = {**bounded(schema), "x-guidance": JSON_OPTIONS}
    return llguidance.LLMatcher.grammar_from_lark(f"start: _LEAD value\nvalue: %json {json.dumps(held)}\n{lead}")


def regex_grammar(pattern: str) -> str:
    if not isinstance(pattern, str):
        raise GrammarError("a pattern must be a string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_pattern(choices: list[str]) -> str:
    """A pattern whose whole matches are exactly the choices."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choices must be a non-empty list of non-empty strings")
    return "|".join("".join("\\" + c if c in RUST_META else c for c in choice) for choice in choices)


def text_grammar(text: str) -> str:
    """A grammar in llama.cpp's GBNF or in Lark (vLLM's and llguidance's), told apart by its rules' `::=`."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("a grammar must be non-empty text (GBNF or Lark)")
    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter raises its own errors and plain ones
        raise GrammarError(f"the GBNF grammar does not parse: {str(e).splitlines()[0]}") from None
    if derives_nothing(lark):
        raise GrammarError("the grammar admits no string: no expansion of its start rule ever ends")
    return llguidance.LLMatcher.grammar_from_lark(lark)


def bounded(schema):
    """The schema as localpd holds it: every integer and number that sets no bound of its own held to INT_LIMIT or
    NUMBER_LIMIT; an object with properties that does not say otherwise takes no others (as OpenAI's strict
    schemas say, and pydantic's models mean); uniqueItems and a format the engine does not know are annotations
    (pydantic's set[...] parses a list with repeats)."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "uniqueItems" or (key == "format" and isinstance(value, str) and value not in FORMATS):
            continue
        if key in NAMED and isinstance(value, dict):
            out[key] = {name: bounded(s) for name, s in value.items()}
        else:
            out[key] = value if key in ("enum", "const", "default", "examples", "required") else bounded(value)
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    limit = INT_LIMIT if "number" not in types else NUMBER_LIMIT
    if "integer" in types or "number" in types:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -limit
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = limit
    return out


def explain(error: str) -> str:
    """llguidance's error as one line a user can act on: the pattern or construct it could not take, and why."""
    text = error.strip()
    if m := re.search(r"regex parse error:\n\s*(.*)\n.*\nerror: (.*)", text):
        pattern, why = m[1].strip(), m[2].strip()
        for word, what in (("look-around", "lookaround"), ("backreferences", "a backreference")):
            if word in why:
                return f"pattern '{pattern}' uses {what}, which the grammar engine does not take"
        return f"pattern '{pattern}': {why}"
    if m := re.search(r"lookarounds not supported yet; (\w+) in regex /(.*)/", text):
        what = "a word boundary (\\b)" if m[1].startswith("Word") else f"an anchor ({m[1]}) inside the pattern"
        return f"pattern '{m[2]}' uses {what}, which the grammar engine does not take"
    if "Unsatisfiable schema: Regex is empty" in text:
        return "no string matches the pattern (and the lengths, or the format) the schema gives it"
    if m := re.search(r"Unsatisfiable schema: (.*)", text):
        return f"the schema admits no value: {m[1]}"
    if m := re.search(r"Invalid type: (\S+)", text):
        return f"unknown JSON schema type '{m[1]}'"
    if m := re.search(r"Unimplemented keys: \[(.*?)\]", text):
        return f"the JSON schema keyword {m[1]} is not supported"
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if "%json" not in text:  # a grammar's own line and column; a schema's say nothing to its writer
        return re.sub(r"^at (\d+)\((\d+)\): ", r"grammar line \1, column \2: ", line)
    line = re.sub(r"^at \d+\(\d+\): ", "", line)
    return line or "the grammar cannot be compiled"


class Vocabulary:
    """llguidance's view of a tokenizer (built once per engine: about 0.2 s for 49k tokens), n: the logits' width."""

    def __init__(self, tokenizer, n: int, eos_ids: set[int]):
        self.n = max(n, tokenizer.vocab_size)
        self.lt = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=self.n, eos_token=sorted(eos_ids))


class GrammarConstraint:
    """The tokens that keep a reply a prefix of the grammar's language: mask(logits) sets the others to -inf before
    sampling; the end of sequence is allowed once the reply is whole, and alone once nothing can follow. lead: text
    the prompt already holds that the reply goes on from (a forced tool call's opening JSON). The mask is numpy's
    on the CPU: torch's ops over a 49k row wait on its thread pool, milliseconds on a busy machine."""

    def __init__(self, vocab: Vocabulary, grammar: str, eos_ids: set[int], lead: str = ""):
        self.vocab, self.eos_ids = vocab, set(eos_ids)
        self.matcher = llguidance.LLMatcher(vocab.lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(explain(self.matcher.get_error()))
        if lead and not self.matcher.consume_tokens(vocab.lt.tokenize_str(lead)):
            raise GrammarError(f"the reply's start {lead!r} does not fit its schema")
        self._eos = np.array(sorted(self.eos_ids), dtype=np.int64)
        self._allowed: np.ndarray | None = None
        if not lead and int(self.allowed().sum()) == self.allowed()[self._eos].sum():
            raise GrammarError("the grammar admits no string (or only the empty one)")

    def prepare(self) -> None:
        """Computes this step's mask ahead of the logits (the runner calls it while the forward runs)."""
        self.allowed()

    def allowed(self) -> np.ndarray:
        """This step's mask over the vocabulary (bool, n), computed once a step."""
        if self._allowed is None:
            if self.matcher.is_error() or self.matcher.is_stopped():
                bits = np.zeros(self.vocab.n, dtype=bool)
            else:
                packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
                bits = np.unpackbits(packed, bitorder="little")[:self.vocab.n].astype(bool)
            bits[self._eos] = self.matcher.is_accepting() or self.matcher.is_error()
            if not bits.any():  # a dead end: the reply ends
                bits[self._eos] = True
            self._allowed = bits
        return self._allowed

    def mask(self, logits: torch.Tensor) -> bool:
        """Refused tokens' logits to -inf, in place; whether any token is left (the caller's own -inf counted)."""
        refused = ~self.allowed()
        n = refused.size
        if logits.device.type == "cpu":
            row = logits.numpy()
            row[n:] = -np.inf
            np.putmask(row[:n], refused, -np.inf)
            return bool(row.max() > -np.inf)
        logits[n:] = float("-inf")
        logits[:n].masked_fill_(torch.from_numpy(refused).to(logits.device, non_blocking=True), float("-inf"))
        return bool(logits.max() > float("-inf"))

    def allows(self, token: int) -> bool:
        return 0 <= token < self.vocab.n and bool(self.allowed()[token])

    def advance(self, token: int) -> None:
        self._allowed = None
        if token not in self.eos_ids:
            self.matcher.consume_token(token)

    def prefix_allowed(self, tokens: list[int]) -> int:
        """How many of tokens, in a row from the first, the grammar takes from here (a speculative draft's length
        worth verifying), without advancing."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(list(tokens))


def check(grammar: str, vocab: Vocabulary | None = None) -> None:
    """Raises GrammarError when the engine cannot compile a grammar (json_grammar's, regex_grammar's, ...)."""
    error = llguidance.LLMatcher.validate_grammar(grammar, vocab.lt if vocab else None)
    if error:
        raise GrammarError(explain(error))


@functools.cache
def byte_vocabulary() -> llguidance.LLTokenizer:
    """A vocabulary of the 256 bytes (GPT-2's byte alphabet) and an end-of-sequence token, 256: a text fed a byte a
    token is taken exactly when it is a prefix of the grammar's language."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from localpd.text.tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    tok = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return llguidance.LLTokenizer(tok.to_str(), eos_token=256)


class Reader:
    """A text read against a grammar (JSON mode's object when None) without a model's vocabulary: feed() says
    whether the text so far is a prefix of a sentence, done whether it is one (checks of replies, the tests)."""

    def __init__(self, grammar: str | None = None):
        self.matcher = llguidance.LLMatcher(byte_vocabulary(), grammar or json_grammar(None), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(explain(self.matcher.get_error()))

    def copy(self) -> Reader:
        c = Reader.__new__(Reader)
        c.matcher = self.matcher.deep_copy()
        return c

    @property
    def done(self) -> bool:
        return self.matcher.is_accepting()

    def feed(self, text: str) -> bool:
        data = list(text.encode())
        return self.matcher.try_consume_tokens(data) == len(data)
