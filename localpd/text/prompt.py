"""A conversation fitted into the context: the oldest turns dropped, a user message and its reply at a time."""

from __future__ import annotations

from typing import Callable


def fit_turns(encode: Callable[[list[dict]], list[int]], system: list[dict], history: list[dict], new: list[dict],
              max_context: int, max_tokens: int) -> tuple[list[int], list[dict]]:
    """(token ids, the history kept) of system + history + new messages, the oldest turns of history dropped two
    at a time until the prompt leaves room for the reply: max_tokens, at most a quarter of the context. The new
    messages are never dropped. encode: messages -> token ids in the model's chat template."""
    limit = max_context - min(max_tokens, max_context // 4)
    while True:
        ids = encode(system + history + new)
        if len(ids) <= limit or not history:
            return ids, history
        history = history[2:]
