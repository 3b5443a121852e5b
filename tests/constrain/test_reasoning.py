"""A thinking model's reply split into reasoning and answer (localpd.constrain.reasoning), whole and streamed."""

import random

import pytest

from localpd.constrain.reasoning import ThinkSplit, opens_thinking, split_reply, thinks


@pytest.mark.parametrize("text, inside, reasoning, answer", [
    ("<think>\nParis is in France.\n</think>\n\nThe capital is Paris.", False, "Paris is in France.",
     "The capital is Paris."),
    ("France... Paris.\n</think>\n\nParis.", True, "France... Paris.", "Paris."),  # the prompt opened the block
    ("<think>\nstill thinking when max_tokens hit", False, "still thinking when max_tokens hit", ""),
    ("cut off inside", True, "cut off inside", ""),
    ("<think>\n\n</think>\n\nAt once.", False, "", "At once."),
    ("No block here. <think> later is text.", False, "", "No block here. <think> later is text."),
    ("<thinking>is not the tag</thinking>", False, "", "<thinking>is not the tag</thinking>"),
    ("  Answer with leading spaces kept", False, "", "  Answer with leading spaces kept"),
])
def test_a_reply_splits_into_reasoning_and_answer(text, inside, reasoning, answer):
    assert split_reply(text, inside) == (reasoning, answer)


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", [
    "<think>\nLet me think.\n\nStep two: </thi-not-a-tag.\n</think>\n\nParis is the capital.",
    "  <think> a </think> b ",
    "Plain answer, <think> and </think> inside it",
    "<", " <thi", "<think>", "",
])
def test_a_streamed_reply_splits_as_the_whole_one(text, inside):
    whole = split_reply(text, inside)
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
        split, reasoning, answer = ThinkSplit(inside), "", ""
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            r, t = split.feed(text[a:b])
            reasoning, answer = reasoning + r, answer + t
        r, t = split.finish()
        assert (reasoning + r, answer + t) == whole


def test_which_templates_and_prompts_think():
    assert thinks("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert not thinks("{{ messages }}") and not thinks(None)
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def script(tok, text):
    """The tokens of a reply's text, which decode to it again."""
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    return ids


@pytest.mark.parametrize("inside, reply", [
    (True, 'The user wants JSON.\n</think>\n\n{"city": "Paris"}'),
    (False, '<think>\nThe user wants JSON. {not: json}\n</think>\n\n{"city": "Paris"}'),
    (False, '  <think></think>{"city": "Paris"}'),
    (False, '{"city": "Paris"}'),  # no reasoning: the answer's constraint from the first token
    (False, ' \n{"city": "Paris"}'),
])
def test_json_modes_constraint_starts_after_the_reasoning(engine, inside, reply):
    """A thinking model in JSON mode (the real tokenizer, whose pieces split the tags): the reasoning is free text,
    the reply cannot end inside it, and the answer after </think> is held to the schema."""
    from localpd.constrain.grammar import GrammarConstraint, Vocabulary, json_grammar
    from localpd.constrain.reasoning import ThinkFirst

    tok, eos = engine.tokenizer, set(engine.tokenizer.eos_ids)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    vocab = Vocabulary(tok, engine.config.vocab_size, eos)
    c = ThinkFirst(lambda: GrammarConstraint(vocab, json_grammar(schema, after_reasoning=True), eos), tok, eos, inside)
    prose, ids = tok.encode(" Sure! Here", add_bos=False)[0], script(tok, reply)
    for i, t in enumerate(ids):
        c.prepare()  # the runner's call during the forward: the answer's mask made ahead where it judges the token
        assert c.allows(t), (tok.decode(ids[:i]), tok.decode([t]))
        assert not any(c.allows(e) for e in eos)  # not while thinking, nor before the JSON is whole
        before = tok.decode(ids[:i])
        if not inside and "<think>" not in reply and not before.strip() or before.endswith(("</think>", "</think>\n\n")):
            assert not c.allows(prose)  # the answer starts as JSON does
        c.advance(t)
    assert all(c.allows(e) for e in eos) and c.phase == ("answer" if "</think>" in reply else "start")


def test_a_token_that_closes_the_reasoning_may_not_start_the_answer_too(engine):
    from localpd.constrain.grammar import GrammarConstraint, Vocabulary, json_grammar
    from localpd.constrain.reasoning import ThinkFirst

    tok, eos = engine.tokenizer, set(engine.tokenizer.eos_ids)
    vocab = Vocabulary(tok, engine.config.vocab_size, eos)
    c = ThinkFirst(lambda: GrammarConstraint(vocab, json_grammar(None), eos), tok, eos, inside=True)
    for t in script(tok, "Done.\n</think"):
        c.advance(t)
    assert c.allows(tok.encode(">", add_bos=False)[0]) and c.allows(tok.encode(">\n\n", add_bos=False)[0])
    closing_prose = [t for t in range(tok.vocab_size) if tok.decode([t]).startswith(">") and
                     tok.decode([t])[1:].strip()][:20]
    assert closing_prose and not any(c.allows(t) for t in closing_prose)
