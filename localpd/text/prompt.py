"""A conversation as a prompt: its token ids in the model's chat template, and a conversation fitted into the
context (the oldest turns dropped, a user message and its reply at a time)."""

from __future__ import annotations

from typing import Callable

from localpd.errors import LocalpdError
from localpd.text.tokenizer import Tokenizer


def check_messages(messages: list[dict]) -> None:
    """Each message a dict with a known role and string content, else a LocalpdError."""
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise LocalpdError(f"unknown message role {m.get('role') if isinstance(m, dict) else m!r}; "
                               f"expected system, user, assistant or tool")
        if not isinstance(m.get("content", ""), str):
            raise LocalpdError("message content must be a string")


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    template_vars: dict | None = None, tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template; template_vars: more variables for it (Qwen3's
    enable_thinking); tools: OpenAI-style function specs the model may call, already checked
    (localpd.constrain.tools.check_tools); continue_final: the last message is the start of the assistant's reply,
    which the model goes on with (vLLM's continue_final_message): the prompt ends where its text does, before the
    template closes the turn."""
    check_messages(messages)
    if continue_final:
        if not messages or messages[-1].get("role") != "assistant" or not messages[-1].get("content"):
            raise LocalpdError("continuing the final message needs a last message from the assistant with text")
        add_generation_prompt = False
    text = tokenizer.render_chat(messages, add_generation_prompt, tools, **(template_vars or {}))
    if continue_final:
        content = messages[-1]["content"]
        end = text.rfind(content)
        end = end + len(content) if end >= 0 else text.rfind(content.strip()) + len(content.strip())
        if end < len(content.strip()):
            raise LocalpdError("the chat template does not show the final message's text as written, so it "
                               "cannot be continued")
        text = text[:end]
    return tokenizer.encode(text, add_bos=False)


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
