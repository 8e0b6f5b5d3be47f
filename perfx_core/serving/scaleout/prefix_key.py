"""The prompt-prefix key a request is routed by: requests with equal keys go to the same engine replica, whose
prefix cache (perfx_core.prefix_cache) then already holds the start of their prompts.

- Chat: the messages up to and including the first user message (a system prompt and the question that opened
  the conversation). Every later turn of a conversation repeats them, so the whole conversation keeps one key
  and one replica while its history grows.
- Completions: the first COMPLETION_PREFIX_CHARS characters of the (first) prompt, or its first
  COMPLETION_PREFIX_TOKENS token ids: prompts built on one template or document share it.

The key is a short digest computed from the raw JSON body, before perfx parses it: a body that is not a valid
request has no key (it is routed to the least-loaded replica, which answers the 400).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CHAT_PREFIX_CHARS = 4096  # of the opening messages: enough to tell conversations apart, bounded work per request
COMPLETION_PREFIX_CHARS = 256
COMPLETION_PREFIX_TOKENS = 64
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat?


def prefix_key(path: str, body: bytes) -> str | None:
    """The routing key of a POST to ``path`` with ``body``; None when the request has no prompt to key on."""
    chat = GENERATION_PATHS.get(path)
    if chat is None or not body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit: perfx answers the 400
        return None
    if not isinstance(request, dict):
        return None
    text = _chat_prefix(request.get("messages")) if chat else _completion_prefix(request.get("prompt"))
    if not text:
        return None
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _chat_prefix(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        parts.append(f"{role}\x00{_content_text(message.get('content'))}\x00")
        if role == "user" or sum(map(len, parts)) >= CHAT_PREFIX_CHARS:
            break
    return "".join(parts)[:CHAT_PREFIX_CHARS]


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text of its parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _completion_prefix(prompt: Any) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: keyed by its first
    if isinstance(prompt, str):
        return "t\x00" + prompt[:COMPLETION_PREFIX_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:COMPLETION_PREFIX_TOKENS]):
        return "i\x00" + ",".join(map(str, prompt[:COMPLETION_PREFIX_TOKENS]))
    return None
