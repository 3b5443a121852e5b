"""Chat templates come from model files and are untrusted: render them in jinja2's immutable sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localpd.errors import LocalpdError


class _TemplateRaised(LocalpdError):
    """The template itself called raise_exception(msg)."""


def _raise(message: str):
    raise _TemplateRaised(f"chat template error: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # Like transformers: no HTML escaping (jinja's own tojson has it) and non-ASCII kept as is.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): render the body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")  # what localpd itself passes


def check_template_vars(extra: dict) -> None:
    """Variables a caller adds to a template (enable_thinking, ...) must not replace the ones render passes."""
    taken = [k for k in extra if k in RESERVED]
    if taken:
        raise LocalpdError(f"the chat template variable '{taken[0]}' is set by localpd and cannot be passed")


def think_vars(think: str | None) -> dict:
    """The template variables of a think setting: "on" or "off" is Qwen3's enable_thinking; None leaves it to the
    model's template."""
    return {} if think is None else {"enable_thinking": think == "on"}


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
           eos_token: str = "", **extra) -> str:
    """The prompt text `template` makes of `messages`; extra: more variables for the template (Qwen3's
    enable_thinking, say; check_template_vars first). Any failure is a one-line LocalpdError."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except _TemplateRaised:
        raise
    except Exception as e:  # noqa: BLE001 -- syntax errors, sandbox refusals, and whatever the template's own code trips on
        message = str(e).splitlines()[0] if str(e) else ""
        raise LocalpdError(f"chat template error: {type(e).__name__}: {message}") from None
