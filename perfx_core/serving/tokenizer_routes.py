"""`/tokenize`, `/detokenize` and `/tokenizer_info` in vLLM's shapes, so clients such as lm-evaluation-harness
need no local copy of the tokenizer."""

from __future__ import annotations

from typing import Any

from ..errors import PerfxError
from .protocol import bad_request, parse_messages

MAX_DETOKENIZE_TOKENS = 1 << 20


def tokenize_body(body: Any, model: Any) -> dict[str, Any]:
    """{"prompt": text} or {"messages": [...]} (rendered with the chat template), "add_special_tokens" (BOS;
    default true), "return_token_strs" -> {"count", "max_model_len", "tokens"[, "token_strs"]}. Control tokens
    spelled in a prompt are parsed, as Hugging Face tokenizers do."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    tok = model.tokenizer
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("'add_special_tokens' must be true or false", "add_special_tokens")
    if "messages" in body:
        try:
            ids = model.chat_prompt_ids(parse_messages(body))
        except PerfxError as exc:
            raise bad_request(f"the model's chat template rejected these messages: {exc}", "messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string (or send 'messages')", "prompt")
        ids = tok.encode(prompt, add_special=add_special, parse_special=True)
    result: dict[str, Any] = {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}
    if body.get("return_token_strs"):
        result["token_strs"] = [tok.token_to_piece(i) for i in ids]
    return result


def detokenize_body(body: Any, model: Any) -> dict[str, Any]:
    """{"tokens": [ids]} -> {"prompt": text}."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = model.config.vocab_size
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_DETOKENIZE_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)
    ):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": model.tokenizer.decode(tokens)}


def tokenizer_info_body(model: Any, model_id: str) -> dict[str, Any]:
    tok = model.tokenizer

    def piece(token_id: int | None) -> str | None:
        return tok.token_to_piece(token_id) if token_id is not None else None

    return {
        "model": model_id,
        "tokenizer_class": type(tok).__name__,
        "vocab_size": tok.vocab_size,
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(tok.eos_id),
        "pad_token": piece(tok.pad_id),
        "add_bos_token": tok.add_bos,
        "model_max_length": model.context_length,
        "chat_template": model.chat_template,
    }
