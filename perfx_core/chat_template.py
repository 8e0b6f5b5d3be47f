"""Chat prompts rendered with jinja2 from the model's own ``tokenizer.chat_template``."""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidArgumentError, ModelFormatError

# Used only when a model ships no template; ChatML is what most small instruct models were tuned on.
FALLBACK_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


def _raise_exception(message: str) -> None:
    raise InvalidArgumentError(f"the chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Templates come from model files: render them sandboxed, with the helpers HF templates expect.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(f"the model's chat template does not parse (line {exc.lineno}: {exc.message})") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            raise InvalidArgumentError(f"message {i} must be a dict with a string 'content'")
        if message.get("role") not in ROLES:
            raise InvalidArgumentError(f"message {i} has role {message.get('role')!r}; use one of {', '.join(ROLES)}")
        clean.append(dict(message))
    return clean


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages``; falls back to ChatML (with a warning) when ``template`` is None."""
    if not template:
        warnings.warn("the model has no chat template; using ChatML", stacklevel=2)
        template = FALLBACK_CHATML
    try:
        return _compile(template).render(
            messages=validate_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except InvalidArgumentError:
        raise  # raise_exception() in the template: the conversation is what it rejects
    except Exception as exc:  # a template is the model file's code: any failure of it is the file's
        raise ModelFormatError(f"the model's chat template failed to render: {type(exc).__name__}: {exc}") from exc
