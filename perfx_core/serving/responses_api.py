"""`POST /v1/responses`, OpenAI's Responses API mapped onto chat: ``input`` (a string or message items) and
``instructions`` become the chat messages, ``max_output_tokens``, ``temperature``, ``top_p`` (and perfx's
sampling extensions) the chat parameters, ``text.format`` the chat ``response_format``; the answer is one output
message, whole or streamed as the Responses events (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed or response.incomplete).

Nothing is stored (``store`` is accepted; the response says ``"store": false``), so ``previous_response_id``
and ``conversation`` are refused, as are tools, reasoning and other features this mapping has no chat
counterpart for: a 400 naming the parameter.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import RequestCancelledError
from .admission import admit
from .choices import generation_jobs
from .guard import error_response, refusal
from .job_events import ClientGone, JobRun, JobStreamResponse, ServingState
from .protocol import APIError, ParsedRequest, bad_request, parse_request
from .scheduler import Failed, Finished, TextDelta

# Parameters passed on to chat as they are (perfx's sampling extensions included).
PASSED_ON = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop")
# Refused unless absent or at their no-op value. Others (metadata, user, store, parallel_tool_calls, ...) are
# accepted: reported back, or of no effect on one model without tools or storage.
REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "previous_response_id": (),
    "conversation": (),
    "background": (False,),
    "prompt": (),
    "reasoning": (),
    "include": ([],),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "truncation": ("disabled",),
}
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}.content[{j}]: only text parts are supported; got {kind!r}", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "input")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The chat conversation of a Responses request: instructions first (as the system message), then input."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        if not raw:
            raise bad_request("'input' is an empty string", "input")
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            where = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise bad_request(f"{where}: only message items are supported (no tool calls); got {kind!r}", "input")
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", "input")
            messages.append({"role": role, "content": _content_text(item.get("content"), where)})
    else:
        raise bad_request("'input' must be a non-empty string or a non-empty list of message items", "input")
    return messages


def _response_format(text: Any) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if (
        not isinstance(text, dict)
        or set(text) - {"format", "verbosity"}
        or (fmt is not None and not isinstance(fmt, dict))
    ):
        raise bad_request('\'text\' must be an object like {"format": {"type": "text"}}', "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return dict(fmt)


def chat_body(body: Any) -> dict:
    """The chat completions body a Responses body maps onto (raises APIError for what does not map)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, harmless in REFUSED.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise bad_request(
                f"'{name}' is not supported by this server's /v1/responses", name, "unsupported_parameter"
            )
    chat = {k: body[k] for k in PASSED_ON if k in body}
    chat["messages"] = chat_messages(body)
    chat["model"] = body.get("model")
    chat["stream"] = body.get("stream", False)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _parse(body: Any, model_name: str, model: Any, cancelled: Callable[[], bool]) -> ParsedRequest:
    chat = chat_body(body)
    try:
        return parse_request(chat, chat=True, model_id=model_name, model=model, cancelled=cancelled)
    except APIError as error:  # name the Responses parameter, not the chat one it became
        renamed = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
        if error.param in renamed:
            error.param = renamed[error.param]
            error.message = error.message.replace("max_completion_tokens", "max_output_tokens")
        raise


class ResponseShapes:
    """The JSON objects of one response: the response itself at each stage, its message item, the events."""

    def __init__(self, body: dict, parsed: ParsedRequest):
        self.body, self.parsed = body, parsed
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = (
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status != "in_progress"
            else []
        )
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(
        self, status: str, text: str | None = None, usage: tuple[int, int] | None = None, error: str | None = None
    ) -> dict[str, Any]:
        body, parsed = self.body, self.parsed
        fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": parsed.model,
            "output": [self.message(text, "incomplete" if status == "incomplete" else "completed")] if done else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": parsed.sampling.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": [],
            "top_p": parsed.sampling.top_p,
            "truncation": "disabled",
            "usage": _usage(*usage) if usage else None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def part_fields(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def responses_endpoint(state: ServingState) -> Callable[[Request], Any]:
    """The route's handler, bound to the server's shared state."""

    async def responses(request: Request) -> Response:
        metrics = state.metrics
        try:
            scheduler, body, _, parsed = await admit(
                state, request, lambda body, name, cancelled: _parse(body, name, state.model, cancelled)
            )
            run = JobRun(state, scheduler)
            run.submit(generation_jobs(parsed, run.emitter))
        except APIError as error:
            return refusal(metrics, error)
        except (ClientGone, RequestCancelledError):
            return refusal(metrics, None)
        shapes = ResponseShapes(body, parsed)
        if parsed.stream:
            return JobStreamResponse(_events(run, shapes), run)
        try:
            text, finished = await _whole(request, run)
        except APIError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        return JSONResponse(shapes.response(status, text, (finished.prompt_tokens, finished.completion_tokens)))

    return responses


async def _whole(request: Request, run: JobRun) -> tuple[str, Finished]:
    pieces = []
    try:
        while True:
            _, event = await run.next_event(request)
            if isinstance(event, TextDelta):
                pieces.append(event.text)
            elif isinstance(event, Finished):
                return "".join(pieces), event
            elif isinstance(event, Failed):
                raise APIError(500, event.message, type="server_error")
    except BaseException:
        run.cancel()
        raise


async def _events(run: JobRun, shapes: ResponseShapes) -> AsyncIterator[str]:
    yield shapes.event("response.created", response=shapes.response("in_progress"))
    yield shapes.event("response.in_progress", response=shapes.response("in_progress"))
    yield shapes.event("response.output_item.added", output_index=0, item=shapes.message("", "in_progress"))
    empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield shapes.event("response.content_part.added", **shapes.part_fields(), part=empty_part)
    pieces = []
    while True:
        _, event = await run.next_event()
        if isinstance(event, TextDelta):
            if event.text:
                pieces.append(event.text)
                yield shapes.event("response.output_text.delta", **shapes.part_fields(), delta=event.text, logprobs=[])
        elif isinstance(event, Finished):
            break
        elif isinstance(event, Failed):
            yield shapes.event("response.failed", response=shapes.response("failed", error=event.message))
            return
    text = "".join(pieces)
    status = "incomplete" if event.finish_reason == "length" else "completed"
    item = shapes.message(text, "incomplete" if status == "incomplete" else "completed")
    yield shapes.event("response.output_text.done", **shapes.part_fields(), text=text, logprobs=[])
    yield shapes.event("response.content_part.done", **shapes.part_fields(), part=item["content"][0])
    yield shapes.event("response.output_item.done", output_index=0, item=item)
    final = shapes.response(status, text, (event.prompt_tokens, event.completion_tokens))
    yield shapes.event(f"response.{status}", response=final)
