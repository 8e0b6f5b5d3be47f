"""The OpenAI response shapes: whole responses and streamed chunks, one choice per prompt, with logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..logprobs import TokenLogprob
from ..tokenizer import TokenType
from ..tools import ToolCallStream, parse_tool_calls
from .protocol import ParsedRequest


@dataclass
class ChoiceResult:
    """One prompt's outcome, gathered from its events."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt's (with echo), then generated


class ResponseBuilder:
    """Builds the JSON objects of one response (whole or streamed chunks) with a shared id and timestamp."""

    def __init__(self, request: ParsedRequest, tokenizer: Any):
        self.request = request
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._streams: dict[int, ToolCallStream] = {}  # per choice, when tools are offered and the reply streams

    def _base(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.request.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def whole(self, choices: Sequence[ChoiceResult]) -> dict[str, Any]:
        wants_logprobs = self.request.logprobs is not None
        if self.request.chat:
            body = self._base("chat.completion")
            body["choices"] = []
            for c in choices:
                message = self.message(c.text)
                body["choices"].append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": self.chat_logprobs(c.logprobs) if wants_logprobs else None,
                        "finish_reason": self.finish_reason(c.finish_reason, "tool_calls" in message),
                    }
                )
        else:
            body = self._base("text_completion")
            body["choices"] = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self.completion_logprobs(c.logprobs) if wants_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        body["usage"] = self.usage(sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices))
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        index: int = 0,
        logprobs: Sequence[TokenLogprob] = (),
        text_offset: int = 0,
    ) -> dict[str, Any] | None:
        """One streamed chunk; None where it would say nothing (text held back while it may start a tool call)."""
        wants_logprobs = self.request.logprobs is not None
        if self.request.chat:
            body = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if self.request.tools is not None and not first:
                text = self._tool_delta(delta, index, text, finish_reason is not None)
                finish_reason = self.finish_reason(finish_reason, bool(self._streams[index].calls))
            if text:
                delta["content"] = text
            shaped = self.chat_logprobs(logprobs) if wants_logprobs and logprobs else None
            if not delta and finish_reason is None and shaped is None:
                return None
            body["choices"] = [{"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}]
        else:
            body = self._base("text_completion")
            shaped = self.completion_logprobs(logprobs, text_offset) if wants_logprobs and logprobs else None
            body["choices"] = [{"index": index, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}]
        if self.request.include_usage:
            body["usage"] = None
        return body

    # -- tool calls ----------------------------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        """A whole chat message: its text, or with tools offered the content and calls parsed from it."""
        if self.request.tools is None:
            return {"role": "assistant", "content": text}
        content, calls = parse_tool_calls(text, self.request.tools)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return message

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """OpenAI's: a message that ends in tool calls ends with "tool_calls"."""
        return "tool_calls" if called and reason == "stop" else reason

    def _tool_delta(self, delta: dict[str, Any], index: int, text: str | None, last: bool) -> str:
        """Feed ``text`` to choice ``index``'s tool-call parser: sets ``delta["tool_calls"]`` for the calls it
        completes, and returns the content to stream (text that may start a call is held until it is one)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolCallStream(self.request.tools.names)
        before = len(stream.calls)
        content, calls = stream.push(text or "")
        if last:
            content += stream.flush()
        if calls:
            delta["tool_calls"] = [{"index": before + k, **call.as_dict()} for k, call in enumerate(calls)]
        return content

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.request.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(prompt_tokens, completion_tokens)
        return body

    # -- logprobs ----------------------------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.tokenizer.token_to_piece(token)

    def text_length(self, token: int) -> int:
        """How many characters ``token`` adds to a completion's text (control tokens: none)."""
        if self.tokenizer.token_type(token) in (TokenType.CONTROL, TokenType.UNKNOWN):
            return 0
        return len(self._piece(token))

    def completion_logprobs(self, entries: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        """The legacy completions shape: parallel lists over the tokens (with echo the prompt's first, whose
        logprob and alternatives are null: nothing predicts it)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for entry in entries:
            tokens.append(self._piece(entry.token))
            token_logprobs.append(entry.logprob)
            top_logprobs.append({self._piece(t): lp for t, lp in entry.top} if entry.logprob is not None else None)
            offsets.append(offset)
            offset += self.text_length(entry.token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        def item(token: int, logprob: float) -> dict[str, Any]:
            return {
                "token": self._piece(token),
                "logprob": logprob,
                "bytes": list(self.tokenizer.token_to_bytes(token)),
            }

        return {
            "content": [
                {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
                if e.logprob is not None
            ]
        }
