"""Chat prompts rendered with jinja2 from the model's own ``tokenizer.chat_template``."""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from .errors import InvalidArgumentError, ModelFormatError, RequestCancelledError
from .template_sandbox import BoundedSandbox, RenderBudget, RenderBudgetExceeded, render_within

# Used only when a model ships no template; ChatML is what most small instruct models were tuned on.
FALLBACK_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
RENDER_SECONDS = 2.0  # templates render in milliseconds; this only stops one that loops
# The rendered prompt may be this many times the messages' own text, plus a fixed allowance for the template's.
RENDER_SIZE_FACTOR = 4
RENDER_SIZE_ALLOWANCE = 1 << 16


def _raise_exception(message: str) -> None:
    raise InvalidArgumentError(f"the chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


MAX_TEMPLATE_VALUE = 1 << 22  # characters (or items) of any one value a template builds


def _compile_env() -> BoundedSandbox:
    # Templates come from model files: render them sandboxed, with the helpers HF templates expect.
    env = BoundedSandbox(MAX_TEMPLATE_VALUE, trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _compile_env()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(f"the model's chat template does not parse (line {exc.lineno}: {exc.message})") from exc


@lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (``messages``, ``tools``, ...)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_compile_env().parse(source)))


def template_takes_tools(template: str | None) -> bool:
    """Whether the template renders a ``tools`` list itself (Hugging Face's tool-use templates do)."""
    return bool(template) and "tools" in template_variables(template)


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
    cancelled: Callable[[], bool] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages``; falls back to ChatML (with a warning) when ``template`` is None.
    ``tools`` (OpenAI-shaped function tools) reach the template as its ``tools`` variable, as in Hugging Face.

    The render is bounded (template_sandbox): RENDER_SECONDS, an output of RENDER_SIZE_FACTOR times the
    messages' text plus RENDER_SIZE_ALLOWANCE, and ``cancelled()`` (polled while it runs) stops it early.
    """
    if not template:
        warnings.warn("the model has no chat template; using ChatML", stacklevel=2)
        template = FALLBACK_CHATML
    clean = validate_messages(messages)
    text_size = sum(len(m["content"]) for m in clean)
    # Tools and earlier tool calls are rendered too (as JSON, by most templates).
    text_size += len(json.dumps([tools, [m.get("tool_calls") for m in clean]], ensure_ascii=False, default=str))
    budget = RenderBudget(
        seconds=RENDER_SECONDS,
        max_chars=RENDER_SIZE_FACTOR * text_size + RENDER_SIZE_ALLOWANCE,
        cancelled=cancelled,
    )
    variables = dict(
        messages=clean, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
    )
    if tools is not None:
        variables["tools"] = [dict(t) for t in tools]
    try:
        return render_within(_compile(template), variables, budget)
    except InvalidArgumentError:
        raise  # raise_exception() in the template: the conversation is what it rejects
    except RenderBudgetExceeded as exc:
        if cancelled is not None and cancelled():
            raise RequestCancelledError("the chat template's render was cancelled with its request") from None
        raise ModelFormatError(f"the model's chat template exceeded its render budget: {exc}") from None
    except Exception as exc:  # a template is the model file's code: any failure of it is the file's
        raise ModelFormatError(f"the model's chat template failed to render: {type(exc).__name__}: {exc}") from exc


def message_spans(
    rendered: str, contents: Sequence[Any], find_control_text: Callable[[str], str | None]
) -> list[tuple[int, int]]:
    """Where the messages that spell a control token sit in ``rendered`` (sorted (start, end) spans), so that
    the tokenizer keeps their text literal. Templates copy a message's text in order, sometimes stripped; one
    that spells a control token and cannot be found is refused rather than tokenized as control tokens."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, content in enumerate(contents):
        if not isinstance(content, str) or (spelled := find_control_text(content)) is None:
            continue
        for candidate in (content, content.strip()):
            start = rendered.find(candidate, pos)
            if start < 0:
                start = rendered.find(candidate)
            if start >= 0 and find_control_text(candidate) is not None:
                spans.append((start, start + len(candidate)))
                pos = start + len(candidate)
                break
        else:
            raise InvalidArgumentError(
                f"message {i} spells the control token {spelled!r}, and this model's chat template changes the "
                "message text so it cannot be kept as plain text; remove that text from the message"
            )
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:  # disjoint, as the tokenizer expects
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged
