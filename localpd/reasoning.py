"""A thinking model's reply in two parts: its reasoning (inside <think>...</think>) and its answer.

Qwen3, QwQ, SmolLM3 and the DeepSeek-R1 distills think first. Some templates open the <think> block in the prompt
(then the reply starts inside it and only closes it); others let the model open it. A reply cut off before
</think> is all reasoning. Whitespace around the tags is dropped.
"""

from __future__ import annotations

from localpd.stops import partial_tail

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template knows the think tags (the model's replies may hold reasoning)."""
    return bool(template) and CLOSE in template


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt leaves a <think> block open for the reply to go on in."""
    return prompt_text.rstrip().endswith(OPEN)


def reply_split(tokenizer, prompt_ids: list[int]) -> ThinkSplit | None:
    """The splitter for the reply to a prompt; None when the model's template has no think tags."""
    if tokenizer is None or not thinks(tokenizer.chat_template):
        return None
    return ThinkSplit(opens_thinking(tokenizer.decode(prompt_ids[-4:], skip_special=False)))


def split_reply(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply; inside: the prompt left a <think> block open."""
    head = text.lstrip()
    if head.startswith(OPEN):
        text = head[len(OPEN):]
    elif not inside:
        return "", text
    end = text.find(CLOSE)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(CLOSE):].lstrip()


class ThinkSplit:
    """A streamed reply's two parts: feed(delta) gives the (reasoning, answer) text that more text cannot change,
    finish() the rest of each; together they are split_reply of the whole."""

    def __init__(self, inside: bool = False):
        self.inside, self.text, self.sent = inside, "", (0, 0)

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._next(self._settled())

    def finish(self) -> tuple[str, str]:
        return self._next(split_reply(self.text, self.inside))

    def _next(self, parts: tuple[str, str]) -> tuple[str, str]:
        (r, a), (sr, sa) = parts, self.sent
        self.sent = (max(sr, len(r)), max(sa, len(a)))
        return r[sr:], a[sa:]

    def _settled(self) -> tuple[str, str]:
        head = self.text.lstrip()
        if OPEN.startswith(head):  # nothing yet, or what may still become <think>
            return "", ""
        if not head.startswith(OPEN) and not self.inside:
            return "", self.text
        body = head[len(OPEN):] if head.startswith(OPEN) else self.text
        if CLOSE in body:
            return split_reply(self.text, self.inside)
        return body[:len(body) - partial_tail(body, CLOSE)].strip(), ""
