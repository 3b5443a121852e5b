"""Tool (function) calling: tools into the prompt, calls out of the reply.

In: a chat template that reads `tools` (Qwen2.5/3, Llama 3.1+, SmolLM3, Mistral...) gets them as its own variable,
and the assistant's earlier calls with their arguments as objects, as transformers passes them. A template that
does not read `tools` (SmolLM2, say) gets them described in the system message, with the `<tool_call>` reply
format of Hermes and Qwen, and earlier calls and results written as text in that format.

Out: a reply holds calls as `<tool_call>{json}</tool_call>` blocks (Hermes, Qwen) or is a bare JSON object or
list of them (Llama 3.x, Mistral); each object has "name" and "arguments" (or Llama's "parameters"). Anything
that does not parse as calls stays text.

Forcing (tool_choice "required" or a named function) puts the start of a call at the end of the prompt and decodes
the rest in JSON mode (localpd.constrain.grammar): a named function's arguments follow its parameters' schema,
"required" takes one of the tools' names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from localpd.errors import LocalpdError
from localpd.text.stops import partial_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_LEADS = ("<|python_tag|>", "[TOOL_CALLS]")  # markers some formats put before a bare JSON call


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


def check_tools(tools: list) -> list[dict]:
    """OpenAI `tools` as the templates take them: [{"type": "function", "function": {"name", ...}}]."""
    if not isinstance(tools, list):
        raise LocalpdError("tools must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise LocalpdError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise LocalpdError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise LocalpdError(f"tools[{i}].function.parameters must be a JSON schema object")
    return [{"type": "function", "function": t["function"]} for t in tools]


def reads_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def call_format(template: str | None) -> str:
    """How the model writes a call: "tags" (<tool_call>, ours too for a template without tools), "llama"
    (a bare {"name", "parameters"} object) or "json" (a bare object or list, marker unknown)."""
    if not reads_tools(template) or OPEN in template:
        return "tags"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama"
    return "json"


def args_key(template: str | None) -> str:
    """The member of a call object that holds its arguments: Llama's "parameters", everyone else's "arguments"."""
    return "parameters" if call_format(template) == "llama" else "arguments"


def forced_prefix(template: str | None, choice: str | dict | None) -> str:
    """The start of a call that tool_choice puts at the end of the prompt ("" for auto and none)."""
    if choice in (None, "auto", "none"):
        return ""
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    fmt = call_format(template)
    if fmt == "json":
        raise LocalpdError("this model's chat template has no known tool-call format to force; use tool_choice "
                           "\"auto\"")
    head = f"{OPEN}\n" if fmt == "tags" else ""
    if name is None:
        return head + '{"name": "'
    return head + json.dumps({"name": name})[:-1] + f', "{args_key(template)}": '


def call_schema(template: str | None, choice: str | dict | None, tools: list[dict]) -> dict | None:
    """The JSON schema a forced call is decoded in (None for auto and none): for a named function its name and
    its parameters' schema, for "required" one of those for each tool. The tools' $defs are gathered at the root,
    where the schema's $refs find them."""
    if choice in (None, "auto", "none"):
        return None
    args = args_key(template)
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [fn for fn in fns if fn["name"] == choice["function"]["name"]][:1]
    calls, defs = [], {}
    for fn in fns:
        params = dict(fn.get("parameters") or {"type": "object"})
        defs.update(params.pop("definitions", {}))
        defs.update(params.pop("$defs", {}))
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args: params},
                      "required": ["name", args]})
    return {"anyOf": calls, "$defs": defs}


def check_choice(choice, tools: list[dict] | None) -> None:
    if choice in (None, "auto", "none"):
        return
    if choice == "required":
        if not tools:
            raise LocalpdError("tool_choice \"required\" needs tools")
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise LocalpdError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in [t["function"]["name"] for t in tools or []]:
        raise LocalpdError(f"tool_choice names the function '{name}', which is not in tools")


def _arguments(args) -> dict:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise LocalpdError("a tool call's arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise LocalpdError("a tool call's arguments must be a JSON object")
    return args


def _call_of(call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise LocalpdError("an assistant message's tool_calls must be [{\"function\": {\"name\", \"arguments\"}}]")
    return {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))}


def _system_text(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions. They are described by these JSON schemas:\n<tools>\n" + listed + "\n</tools>\n"
            "To call one, reply with a JSON object naming it and giving its arguments, inside tags, one block per "
            f"call:\n{OPEN}\n{{\"name\": \"function_name\", \"arguments\": {{\"argument\": \"value\"}}}}\n{CLOSE}\n"
            "Reply with plain text when no call is needed.")


def template_messages(messages: list[dict], tools: list[dict] | None, template: str | None) -> tuple[list, dict]:
    """The messages and variables a template gets for a conversation with tools and calls in it."""
    native = reads_tools(template)
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            parsed = [_call_of(c) for c in calls]
            if native:
                out.append({**m, "tool_calls": [{"type": "function", "id": c.get("id"), "function": p}
                                                for c, p in zip(calls, parsed)]})
            else:
                blocks = "\n".join(f"{OPEN}\n{json.dumps(p, ensure_ascii=False)}\n{CLOSE}" for p in parsed)
                out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content"), blocks) if x)})
        elif m["role"] == "tool" and not native:
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append(m)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + _system_text(tools)}] + out[1:], {}
    return [{"role": "system", "content": _system_text(tools)}] + out, {}


def _call_objects(text: str) -> list[dict] | None:
    """The call objects in `text` (JSON objects or lists of them, one after another), or None if it is not that."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        for v in value if isinstance(value, list) else [value]:
            args = v.get("arguments", v.get("parameters")) if isinstance(v, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not isinstance(args, dict):
                return None
            calls.append({"name": v["name"], "arguments": args})
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    return calls or None


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the reply's text before its calls, the calls); (text, []) when it holds none that parse."""
    start = text.find(OPEN)
    if start >= 0:
        bodies = re.findall(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text[start:], re.S)
        objects = [_call_objects(b) for b in bodies]
        if bodies and all(objects):
            return text[:start].rstrip(), [ToolCall(o["name"], json.dumps(o["arguments"], ensure_ascii=False))
                                           for found in objects for o in found]
        return text, []
    body = text.lstrip()
    for lead in JSON_LEADS:
        body = body.removeprefix(lead)
    found = _call_objects(body) if body.lstrip()[:1] in ("{", "[") else None
    if found:
        return "", [ToolCall(o["name"], json.dumps(o["arguments"], ensure_ascii=False)) for o in found]
    return text, []


class CallStream:
    """Streams a reply's text while holding back what may be a call: from a `<tool_call>` tag on, or the whole
    reply when it starts as bare JSON. feed(delta) gives the text that is safe to send now; finish() the rest and
    the calls."""

    def __init__(self, prefix: str = ""):
        self.text, self.sent = "", 0
        self.feed(prefix)

    def feed(self, delta: str) -> str:
        self.text += delta
        cut = max(self.sent, self._held_from())
        out, self.sent = self.text[self.sent:cut], cut
        return out

    def _held_from(self) -> int:
        """Where the text still held back starts."""
        head = self.text.lstrip()
        if not head or head[0] in "{[" or any(x.startswith(head[:len(x)]) for x in JSON_LEADS):
            return 0  # the whole reply may be a bare call
        end = self.text.find(OPEN)
        if end < 0:  # no tag yet: hold a tail that may be the start of one
            end = len(self.text) - partial_tail(self.text, OPEN)
        return len(self.text[:end].rstrip())  # whitespace before a call is dropped with it

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_calls(self.text)
        if calls:
            return content[self.sent:], calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, []
