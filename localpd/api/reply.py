"""A chat reply as it streams or as a whole: a thinking model's reasoning apart from its answer, and tool calls
parsed out of the answer."""

from __future__ import annotations

import uuid

from localpd.constrain.reasoning import ThinkSplit, split_reply
from localpd.constrain.tools import CallStream, ToolCall, parse_calls


class Reply:
    """A chat reply's parts as it streams: the reasoning of a thinking model (localpd.constrain.reasoning), then the
    answer's text and its tool calls (localpd.constrain.tools).

    think: the reasoning's splitter (None: no split); call_prefix: None (no tools), or the start of a call that
    tool_choice put in the prompt ("" for auto)."""

    def __init__(self, think: ThinkSplit | None, call_prefix: str | None, parallel_calls: bool = True):
        self.think = think
        self.calls = None if call_prefix is None else CallStream(call_prefix)
        self.call_prefix, self.parallel_calls = call_prefix, parallel_calls

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer text) that can be sent now."""
        reasoning, answer = ("", delta) if self.think is None else self.think.feed(delta)
        return reasoning, answer if self.calls is None else self.calls.feed(answer)

    def finish(self) -> tuple[str, str, list[dict]]:
        """The rest of the reasoning and the answer, and the calls."""
        reasoning, answer = ("", "") if self.think is None else self.think.finish()
        if self.calls is None:
            return reasoning, answer, []
        answer = self.calls.feed(answer)
        rest, found = self.calls.finish()
        return reasoning, answer + rest, self._shaped(found)

    def whole(self, text: str) -> tuple[str, str, list[dict]]:
        """(reasoning, answer text, calls) of a reply that was not streamed."""
        reasoning, answer = ("", text) if self.think is None else split_reply(text, self.think.inside)
        if self.calls is None:
            return reasoning, answer, []
        answer, found = parse_calls(self.call_prefix + answer)
        return reasoning, answer, self._shaped(found)

    def _shaped(self, found: list[ToolCall]) -> list[dict]:
        found = found if self.parallel_calls else found[:1]
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in found]
