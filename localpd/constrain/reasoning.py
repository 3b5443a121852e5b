"""A thinking model's reply in two parts: its reasoning (inside <think>...</think>) and its answer.

Qwen3, QwQ, SmolLM3 and the DeepSeek-R1 distills think first. Some templates open the <think> block in the prompt
(then the reply starts inside it and only closes it); others let the model open it. A reply cut off before
</think> is all reasoning. Whitespace around the tags is dropped.
"""

from __future__ import annotations

from localpd.text.stops import partial_tail
from localpd.text.tokenizer import TokenText

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


class ThinkFirst:
    """A constraint on a thinking model's answer alone (JSON mode's, a grammar's): the reasoning in <think>...</think> is free,
    and `make()` gives the constraint the answer after it is held to. inside: the prompt left a <think> block open;
    otherwise the reply may open one first. While it reasons, the reply may not end; a token that closes the block
    may carry blanks after </think> but nothing else, so the answer starts on a token of its own."""

    def __init__(self, make, tokenizer, eos_ids: set[int], inside: bool):
        self.make, self.eos_ids = make, set(eos_ids)
        self.answer = make()  # until the reply opens a <think> block, the answer's constraint holds
        self.text = TokenText(tokenizer)
        self.phase = "think" if inside else "start"  # start, opening (part of <think> written), think, answer
        self.reply = ""  # the reply's text while it is not yet in the answer

    def prepare(self) -> None:
        """The answer's mask ahead of the logits, where the answer's constraint judges the next token."""
        if self.phase in ("start", "answer"):
            self.answer.prepare()

    def mask(self, logits) -> bool:
        """The answer's mask once in the answer; while reasoning, only the end of the reply is refused (before the
        reply shows whether it reasons, allows() judges each token). Whether any token is left."""
        if self.phase == "answer":
            return self.answer.mask(logits)
        if self.phase != "start":
            logits[sorted(self.eos_ids)] = float("-inf")
        return True

    def allows(self, token: int) -> bool:
        if self.phase == "answer":
            return self.answer.allows(token)
        text = self.reply + self.text.added(token)[0]
        if self.phase == "start" and not opening(text):
            return self.answer.allows(token)
        if token in self.eos_ids:
            return False
        if self.phase == "opening":
            return opening(text)
        end = text.find(CLOSE)
        return end < 0 or not text[end + len(CLOSE):].strip()

    def advance(self, token: int) -> None:
        if self.phase == "answer" or (self.phase == "start" and not opening(self.reply + self.text.added(token)[0])):
            self.text.push(token)
            self.answer.advance(token)
            return
        self.reply += self.text.push(token)
        if self.phase in ("start", "opening"):
            self.phase = "think" if self.reply.lstrip().startswith(OPEN) else "opening"
        if self.phase == "think" and CLOSE in self.reply:
            self.phase, self.answer = "answer", self.make()


def opening(text: str) -> bool:
    """Whether a reply's text is (blanks and) part or all of <think>, or more after it."""
    head = text.lstrip()
    return bool(head) and (OPEN.startswith(head) or head.startswith(OPEN))
