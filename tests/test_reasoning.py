"""A thinking model's reply split into reasoning and answer (localpd.reasoning), whole and streamed."""

import random

import pytest

from localpd.reasoning import ThinkSplit, opens_thinking, split_reply, thinks


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
