"""Tool calling: tools and earlier calls into the prompt, calls out of the reply (localpd.constrain.tools)."""

import json
import random

import pytest

from localpd.text.chat_template import render
from localpd.errors import LocalpdError
from localpd.constrain.tools import CallStream, check_choice, check_tools, forced_prefix, parse_calls, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "",
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 18 C"}]

# A template that reads tools as Qwen2.5's does: the specs as JSON, earlier calls with their arguments as objects.
NATIVE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
          "{% for m in messages %}[{{ m.role }}]"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
          "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
          "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
LLAMA_LIKE = "{% if tools is not none %}{{ tools | tojson }}{% endif %}<|python_tag|> ipython {{ messages }}"


def test_a_template_that_reads_tools_gets_them_and_calls_with_object_arguments():
    messages, variables = template_messages(CALLED, [WEATHER], NATIVE)
    text = render(NATIVE, messages, **variables)
    assert f"<tools>{json.dumps(WEATHER)}</tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "[tool]Sunny, 18 C" in text
    assert CALLED[1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"  # the caller's list kept


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    system = [{"role": "system", "content": "Be brief."}]
    messages, variables = template_messages(system + CALLED, [WEATHER], template)
    assert variables == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system_text = messages[0]["content"]
    assert system_text.startswith("Be brief.\n\n") and json.dumps(WEATHER["function"]) in system_text
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>')
    assert messages[3]["content"] == "<tool_response>\nSunny, 18 C\n</tool_response>"
    alone, _ = template_messages(CALLED[:1], [WEATHER], template)
    assert alone[0]["role"] == "system" and "<tools>" in alone[0]["content"]
    plain, _ = template_messages(CALLED[:1], None, template)
    assert plain == CALLED[:1]


@pytest.mark.parametrize("text, content, calls", [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}',
     "", [("a", {}), ("b", {"x": 1})]),  # the last block unterminated (the reply ended at eos), arguments as text
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": [1, 2]}), ("g", {})]),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"q": "é"}}]', "", [("f", {"q": "é"})]),
])
def test_calls_parse_in_every_known_format(text, content, calls):
    got_content, got = parse_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("text", [
    "Paris is sunny today.",
    '{"answer": 42}',  # JSON, but not a call
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "Use <tool_call> tags to call a function.",
])
def test_text_that_is_not_a_call_stays_text(text):
    assert parse_calls(text) == (text, [])


def stream_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text", [
    'Checking the weather now.  \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '  {"name": "f", "parameters": {"a": 1}}',
    "It is <b>sunny</b> in Paris; <tool_ is not a tag.\n",
    '{"answer": 42} is the JSON you asked for.',
    '<|python_tag|>{"name": "f", "parameters": {}}',
])
def test_a_streamed_reply_sends_what_the_whole_reply_gives(text):
    whole_content, whole_calls = parse_calls(text)
    rng = random.Random(len(text))
    for _ in range(20):
        s, sent = CallStream(), []
        for piece in stream_pieces(text, rng):
            sent.append(s.feed(piece))
            assert "<tool_call>" not in "".join(sent)  # no part of a call is ever sent as text
        rest, calls = s.finish()
        assert "".join(sent) + rest == whole_content and calls == whole_calls


def test_a_forced_prefix_starts_the_call_the_stream_then_parses():
    prefix = forced_prefix(None, {"type": "function", "function": {"name": "get_weather"}})
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    s = CallStream(prefix)
    assert s.feed('{"city": "Paris"}}\n</tool_call>') == ""
    assert s.finish()[1][0].name == "get_weather"
    assert forced_prefix(LLAMA_LIKE, "required") == '{"name": "'
    assert forced_prefix(LLAMA_LIKE, {"function": {"name": "f"}}) == '{"name": "f", "parameters": '
    assert forced_prefix(NATIVE, "auto") == forced_prefix(NATIVE, "none") == ""
    with pytest.raises(LocalpdError, match="no known tool-call format"):
        forced_prefix("{{ tools }}{{ messages }}", "required")


@pytest.mark.parametrize("tools, fragment", [
    ("get_weather", "must be a list"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"description": "no name"}}], "name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters"),
])
def test_bad_tools_are_one_line_errors(tools, fragment):
    with pytest.raises(LocalpdError, match=fragment.replace("[", r"\[")):
        check_tools(tools)


def test_bad_choices_and_arguments_are_one_line_errors():
    with pytest.raises(LocalpdError, match="not in tools"):
        check_choice({"type": "function", "function": {"name": "send_mail"}}, [WEATHER])
    with pytest.raises(LocalpdError, match="needs tools"):
        check_choice("required", [])
    bad = [{**CALLED[1], "tool_calls": [{"function": {"name": "f", "arguments": "{city: Paris"}}]}]
    with pytest.raises(LocalpdError, match="not valid JSON"):
        template_messages(bad, [WEATHER], NATIVE)
    with pytest.raises(LocalpdError, match="tool_calls"):
        template_messages([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], None, NATIVE)
