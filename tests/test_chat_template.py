"""Chat templates rendered with jinja2, sandboxed, with the helpers Hugging Face templates use."""

from __future__ import annotations

import pytest

from perfx_core import InvalidArgumentError, ModelFormatError
from perfx_core.chat_template import render_chat

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
    "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_renders_with_bos_and_generation_prompt():
    text = render_chat(LLAMA3_LIKE, [{"role": "user", "content": " hi "}], bos_token="<|begin_of_text|>")
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_fallback_chatml_warns():
    with pytest.warns(UserWarning, match="ChatML"):
        text = render_chat(None, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_in_template_is_typed():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    with pytest.raises(InvalidArgumentError, match="first message must be user"):
        render_chat(template, [{"role": "assistant", "content": "x"}])


def test_broken_template_is_a_model_format_error():
    with pytest.raises(ModelFormatError, match="does not parse"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])


def test_template_cannot_escape_the_sandbox():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ModelFormatError):
        render_chat(evil, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "user"}], [{"role": "wizard", "content": "x"}], ["hello"], [{"role": "user", "content": 3}]],
)
def test_bad_messages(messages):
    with pytest.raises(InvalidArgumentError):
        render_chat(LLAMA3_LIKE, messages)
