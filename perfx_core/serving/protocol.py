"""The OpenAI wire format: validating request bodies into generation parameters (responses.py shapes the answers).

Mapping of OpenAI parameters (see docs/serving.md):
  temperature (default 1, 0 = greedy), top_p (default 1), seed, stop (strings, bounded in total length),
  max_tokens / max_completion_tokens (0 with echo: scoring), n (up to the server's slots), stream,
  stream_options.include_usage, logprobs / top_logprobs, echo, prompt lists (n choices each).
  perfx extensions: top_k (default 0 = off), min_p (default 0 = off), repetition_penalty, ignore_eos.
  frequency_penalty, presence_penalty, logit_bias; vLLM's min_tokens, stop_token_ids,
  include_stop_str_in_output. response_format (json_object, json_schema) and tools / tool_choice /
  parallel_tool_calls (chat), enforced with a grammar (perfx_core.grammar, perfx_core.tools).
  Parameters perfx does not implement (functions, suffix, grammar, guided_*, ...) are 400s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ContextLengthError, InvalidArgumentError, RequestCancelledError
from ..grammar import Grammar, GrammarError, TokenConstraint, json_schema_grammar, response_format_schema
from ..logprobs import MAX_TOP_LOGPROBS
from ..sampling import INT32_MAX, MAX_LOGIT_BIAS, UINT64_MAX, SamplingParams
from ..stop_strings import check_stop_strings
from ..tools import ToolChoice, ToolSpecError, tool_choice

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 64  # any number, bounded with their total length (stop_strings.MAX_STOP_CHARS)
MAX_PROMPTS = 64  # prompts in one completions request (each is queued like a request of its own)
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
class Prompt:
    ids: list[int]
    text: str  # what ``echo`` returns: the prompt as sent, or the decoded ids


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request, ready for the scheduler: one choice per prompt."""

    chat: bool
    model: str
    prompts: list[Prompt]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    logprobs: int | None = None  # alternatives reported per token; None: no logprobs
    echo: bool = False  # completions: the prompt is part of the text (and of the logprobs)
    n: int = 1  # choices per prompt: ``prompts`` holds each prompt n times in a row
    tools: ToolChoice | None = None  # tools offered (chat): their calls are parsed out of the text
    constraints: tuple[TokenConstraint, ...] = ()  # structured output: each choice's grammar state

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0].ids


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


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer; got {value!r}", name)
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad_request(f"'{name}' must be {bounds}; got {value}", name)
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
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) for s in stop)):
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    try:
        return check_stop_strings(stop)
    except InvalidArgumentError as exc:
        raise bad_request(str(exc), "stop") from None


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
        clean = {"role": role, "content": _message_text(message.get("content"), i)}
        # An assistant's tool calls and a tool result's call id are part of the conversation (checked by tools.py).
        clean.update({k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k) is not None})
        out.append(clean)
    return out


def _one_prompt(prompt: Any, tokenizer: Any, vocab_size: int, where: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{where} is empty", "prompt")
        return Prompt(tokenizer.encode(prompt, add_special=True), prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise bad_request(f"{where}: token ids must be in [0, {vocab_size})", "prompt")
        return Prompt(list(prompt), tokenizer.decode(prompt))
    raise bad_request(f"{where} must be a non-empty string or a list of token ids", "prompt")


def parse_prompts(body: dict, tokenizer: Any, vocab_size: int) -> list[Prompt]:
    """A string, a list of token ids, or a list of those (one choice each)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request; got {len(prompt)}", "prompt")
        return [_one_prompt(p, tokenizer, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, tokenizer, vocab_size, "'prompt'")]


# Parameters perfx does not implement yet: a 400 naming them beats a reply that silently ignores them.
UNSUPPORTED = (
    "functions",
    "function_call",
    "suffix",
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
HARMLESS_VALUES = {"suffix": ("",)}


def _output_rules(body: dict, chat: bool, tokenizer: Any) -> tuple[ToolChoice | None, Grammar | None]:
    """The tools a chat request offers and the grammar its output must match (response_format and/or the tool
    choice; perfx_core.grammar, perfx_core.tools); 400s name the parameter at fault."""
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise bad_request(f"'{name}' applies to /v1/chat/completions", name)
    try:
        tools = tool_choice(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ToolSpecError as exc:
        raise bad_request(str(exc), exc.param) from None
    response_format = body.get("response_format")
    try:
        schema = response_format_schema(response_format) if response_format is not None else None
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format") from None
    try:
        content = json_schema_grammar(schema, tokenizer) if schema is not None else None
    except GrammarError as exc:
        raise bad_request(f"response_format: {exc}", "response_format", "invalid_schema") from None
    if tools is None:
        return None, content
    try:
        return tools, tools.grammar(tokenizer, schema)
    except GrammarError as exc:
        raise bad_request(f"tools: {exc}", "tools", "invalid_schema") from None


def _refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        value = body.get(name)
        if value is not None and value not in HARMLESS_VALUES.get(name, ()):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
            raise bad_request(f"'logit_bias' keys must be token ids in [0, {vocab}); got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100]; got {value!r}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _token_id_list(body: dict, name: str, vocab: int) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_STRINGS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
    ):
        raise bad_request(f"'{name}' must be a list of at most {MAX_STOP_STRINGS} token ids in [0, {vocab})", name)
    return ids


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives. Chat: ``logprobs`` is a switch and
    ``top_logprobs`` the number."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if not _boolean(body, "logprobs"):
        if body.get("top_logprobs") is not None:
            raise bad_request("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
        return None
    return _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0


def parse_request(
    body: Any, *, chat: bool, model_id: str, model: Any, cancelled: Callable[[], bool] | None = None
) -> ParsedRequest:
    """Validate an OpenAI request body against the loaded ``model``; raises APIError (400) on bad input, and
    RequestCancelledError when ``cancelled()`` turns true while the chat template renders. ``model_id`` is the
    name the response reports: the caller has checked the requested name (ServerConfig.response_model_name)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'model' must be a string; got {name!r}", "model")
    # n choices decode side by side, one KV-cache slot each: at most as many as the server has slots.
    n = _integer(body, "n", 1, model.engine.n_slots) or 1
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p >= 1:
        raise bad_request("'min_p' must be in [0, 1)", "min_p")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, None, low_open=True)
    frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    _refuse_unsupported(body)
    tools, grammar = _output_rules(body, chat, model.tokenizer)
    vocab = model.config.vocab_size
    logit_bias = _logit_bias(body, vocab)
    stop_token_ids = _token_id_list(body, "stop_token_ids", vocab)
    include_stop = _boolean(body, "include_stop_str_in_output")
    min_tokens = _integer(body, "min_tokens", 0) or 0
    top_k = _integer(body, "top_k", 0, INT32_MAX) or 0
    seed = _integer(body, "seed", 0, UINT64_MAX)
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
    if body.get("best_of") not in (None, 1):
        raise bad_request("'best_of' must be 1", "best_of")
    logprobs = _logprobs(body, chat)
    echo = False if chat else _boolean(body, "echo")
    if chat and body.get("echo") is not None:
        raise bad_request("'echo' applies to /v1/completions", "echo")
    # max_tokens 0 only scores the prompt: with echo, as OpenAI's legacy completions allowed.
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0 if echo else 1)

    if chat:
        messages = parse_messages(body)
        try:
            prompts = [Prompt(model.chat_prompt_ids(messages, cancelled=cancelled, tools=tools), "")]
        except RequestCancelledError:
            raise
        except ToolSpecError as exc:  # a malformed tool call or tool message in the history
            raise bad_request(str(exc), exc.param) from None
        except Exception as exc:  # the model's own Jinja template can reject a conversation (e.g. role order)
            raise bad_request(f"the model's chat template rejected these messages: {exc}", "messages") from None
    else:
        prompts = parse_prompts(body, model.tokenizer, model.config.vocab_size)
    if len(prompts) * n > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} choices per request (prompts x n); got {len(prompts) * n}", "n")
    prompts = [prompt for prompt in prompts for _ in range(n)]  # choice index = prompt index * n + j
    context = model.context_length
    longest = max(len(p.ids) for p in prompts)
    if max_tokens is None:
        room = context - longest
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, room) if not chat else room
        max_tokens = max(max_tokens, 1)  # a prompt that fills the context still fails below, with numbers
    if longest + max_tokens > context:
        param = "messages" if chat else "prompt"
        raise bad_request(str(ContextLengthError(longest, max_tokens, context)), param, "context_length_exceeded")
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias=logit_bias,
            min_tokens=min_tokens,
        )
    except InvalidArgumentError as exc:
        raise bad_request(str(exc)) from None
    if min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    try:  # each choice follows the grammar on its own (made here, in the request's worker thread)
        constraints = tuple(grammar.constraint() for _ in prompts) if grammar is not None else ()
    except GrammarError as exc:
        raise bad_request(str(exc), "tools" if tools is not None else "response_format", "invalid_schema") from None
    return ParsedRequest(
        chat,
        model_id,
        prompts,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos,
        frozenset(stop_token_ids),
        include_stop,
        logprobs,
        echo,
        n,
        tools=tools,
        constraints=constraints,
    )
