"""The OpenAI wire format: validating request bodies into generation parameters, and shaping responses.

Mapping of OpenAI parameters (the rest are accepted and ignored, see docs/serving.md):
  temperature (default 1, 0 = greedy), top_p (default 1), seed, stop (string or up to 4 strings),
  max_tokens / max_completion_tokens, n (only 1), stream, stream_options.include_usage.
  perfx extensions: top_k (default 0 = off), min_p (default 0 = off), repetition_penalty, ignore_eos.
  frequency_penalty / presence_penalty are range-checked ([-2, 2]) and ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import ContextLengthError, InvalidArgumentError
from ..sampling import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request, ready for the scheduler."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _number(
    body: dict, name: str, default: float, low: float | None = None, high: float | None = None, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number; got {value!r}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        lo = f"({low}" if low_open else f"[{low}"
        raise bad_request(f"'{name}' must be in {lo}, {high if high is not None else 'inf'}]; got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer; got {value!r}", name)
    if value < low:
        raise bad_request(f"'{name}' must be >= {low}; got {value}", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false; got {value!r}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        if message["role"] not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role {message['role']!r} is not one of {', '.join(CHAT_ROLES)}", "messages"
            )
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": _message_text(message.get("content"), i)})
    return out


def parse_prompt(body: dict, tokenizer: Any, vocab_size: int) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return tokenizer.encode(prompt, add_special=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("only one prompt per request is supported; send one request per prompt", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")


def parse_request(body: Any, *, chat: bool, model_id: str, model: Any) -> ParsedRequest:
    """Validate an OpenAI request body against the loaded ``model``; raises APIError (400) on bad input."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'model' must be a string; got {name!r}", "model")
    if name and name != model_id:
        raise bad_request(
            f"model {name!r} is not served here; this server serves {model_id!r}", "model", "model_not_found"
        )
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise bad_request(f"'n' must be 1: one completion per request; got {n}", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p >= 1:
        raise bad_request("'min_p' must be in [0, 1)", "min_p")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, None, low_open=True)
    for ignored in ("frequency_penalty", "presence_penalty"):
        _number(body, ignored, 0.0, -2.0, 2.0)
    top_k = _integer(body, "top_k", 0) or 0
    seed = _integer(body, "seed", 0)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
    ):
        raise bad_request("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with \"stream\": true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    stop = _stop(body)
    ignore_eos = _boolean(body, "ignore_eos")
    if body.get("logprobs") not in (None, False, 0) or body.get("echo") or body.get("best_of") not in (None, 1):
        raise bad_request("logprobs, echo and best_of are not supported")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)

    if chat:
        messages = parse_messages(body)
        try:
            prompt_ids = model.chat_prompt_ids(messages)
        except Exception as exc:  # the model's own Jinja template can reject a conversation (e.g. role order)
            raise bad_request(f"the model's chat template rejected these messages: {exc}", "messages") from None
    else:
        prompt_ids = parse_prompt(body, model.tokenizer, model.config.vocab_size)
    context = model.context_length
    if max_tokens is None:
        room = context - len(prompt_ids)
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, room) if not chat else room
        max_tokens = max(max_tokens, 1)  # a prompt that fills the context still fails below, with numbers
    if len(prompt_ids) + max_tokens > context:
        param = "messages" if chat else "prompt"
        raise bad_request(
            str(ContextLengthError(len(prompt_ids), max_tokens, context)), param, "context_length_exceeded"
        )
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
    except InvalidArgumentError as exc:
        raise bad_request(str(exc)) from None
    return ParsedRequest(chat, model_id, prompt_ids, max_tokens, sampling, stop, stream, include_usage, ignore_eos)


# -- responses ----------------------------------------------------------------------------------------------
class ResponseBuilder:
    """Builds the JSON objects of one response (whole or streamed chunks) with a shared id and timestamp."""

    def __init__(self, request: ParsedRequest):
        self.request = request
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.request.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        if self.request.chat:
            body = self._base("chat.completion")
            body["choices"] = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ]
        else:
            body = self._base("text_completion")
            body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        body["usage"] = self.usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        if self.request.chat:
            body = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.request.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(prompt_tokens, completion_tokens)
        return body
