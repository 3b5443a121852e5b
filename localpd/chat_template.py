"""Chat templates come from model files and are untrusted: render them in jinja2's immutable sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localpd.errors import LocalpdError


def _raise(message: str):
    raise LocalpdError(f"chat template refused the conversation: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
           eos_token: str = "", **extra) -> str:
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except LocalpdError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise LocalpdError(f"chat template error: {type(e).__name__}: {e}") from None
