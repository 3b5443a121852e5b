"""A request's constraint from its sampling parameters: JSON mode's, a JSON schema's, a pattern's or a grammar's,
with a thinking model's reasoning left free before it."""

from __future__ import annotations

from typing import Callable

from localpd.constrain.grammar import (GrammarConstraint, GrammarError, Vocabulary, json_grammar, regex_grammar,
                                      text_grammar)
from localpd.constrain.reasoning import ThinkFirst, reply_split
from localpd.errors import LocalpdError
from localpd.text.tokenizer import Tokenizer


def request_constraint(params, tokenizer: Tokenizer | None, vocabulary: Callable[[], Vocabulary], eos: set[int],
                       prompt: list[int], model_name: str):
    """The constraint of a request's SamplingParams (localpd.engine.sampling), or None: JSON mode's, a pattern's or
    a grammar's; a thinking model's reasoning before the JSON (or the match) is left free (a forced tool call's
    prompt opened the JSON already, so that reply does not reason first). vocabulary: llguidance's view of the
    tokenizer, built once by its owner. What the grammar engine cannot take is a LocalpdError naming it (param:
    regex, grammar or None)."""
    if not params.json_object and params.regex is None and params.grammar is None:
        return None
    if tokenizer is None or not eos:
        raise LocalpdError(f"a constrained reply needs a tokenizer with an end-of-sequence token; {model_name} "
                           f"has none")
    param = "regex" if params.regex is not None else "grammar" if params.grammar is not None else None
    split = None if params.json_lead else reply_split(tokenizer, prompt)
    try:
        if params.grammar is not None:
            grammar = text_grammar(params.grammar)
        elif params.regex is not None:
            grammar = regex_grammar(params.regex)
        else:
            grammar = json_grammar(params.json_schema, after_reasoning=split is not None)
        words = vocabulary()

        def make():
            return GrammarConstraint(words, grammar, eos, params.json_lead)

        return make() if split is None else ThinkFirst(make, tokenizer, eos, split.inside)
    except GrammarError as e:
        raise LocalpdError(str(e), param=param) from None
