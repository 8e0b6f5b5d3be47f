"""Tool (function) calling: the tools offered to the model, the grammar that holds it to them, and the calls
parsed back out of its text.

The call syntax is the one Qwen 2.5/3 and Hermes models are trained on, one call per block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Tools reach the model through its own chat template (its ``tools`` variable, as Hugging Face's
``apply_chat_template`` passes them) when the template uses one; otherwise (SmolLM2's, for one) through a system
message that lists the tools and this syntax, with earlier calls and their results written into the
conversation in the same syntax (``<tool_response>`` blocks in a user turn). The grammar engine then holds the
output to the choice: ``required`` or a named function allow only calls (of that function, with arguments valid
against its parameter schema); ``auto`` allows either a message that does not start a call, or calls;
``none`` offers no tools at all.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError
from .grammar import Grammar, embedded_json, lark_grammar

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (plus dots, which some clients use)
CHOICES = ("none", "auto", "required")


class ToolSpecError(InvalidArgumentError):
    """A malformed ``tools``, ``tool_choice`` or tool message; ``param`` names the parameter."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of the arguments object

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face shape templates expect."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """The tools a request offers and how the model may use them."""

    functions: tuple[Function, ...]
    choice: str = "auto"  # "auto", "required", or "function" (then ``name``)
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def grammar(self, tokenizer: Tokenizer, content_schema: Mapping[str, Any] | bool | None = None) -> Grammar:
        """What the model may write: calls only (``required``, a named function), or (``auto``) either calls or
        a message: free text that does not start a call, or with ``content_schema`` one JSON value of it."""
        offered = [f for f in self.functions if self.choice != "function" or f.name == self.name]
        calls = [_call_schema(f, f"tool{i}") for i, f in enumerate(offered)]
        call_schema: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else dict(calls[0])
        # Each function's parameters live under $defs, their own local references ("#/$defs/...") rebased there.
        call_schema["$defs"] = {f"tool{i}": _rebased(f.parameters, f"#/$defs/tool{i}") for i, f in enumerate(offered)}
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        rules = [
            f"calls: {calls}",
            f'call: "{_lark_text(OPEN)}\\n" {embedded_json(call_schema)} "\\n{_lark_text(CLOSE)}"',
        ]
        if self.choice == "auto":
            rules.insert(0, "start: content | calls")
            if content_schema is None:
                # Any text at all, except text starting a call: a call must be whole, and valid.
                rules.append("content: TEXT")
                rules.append(f"TEXT: /(.|\\n)+/ & ~/{re.escape(OPEN)}(.|\\n)*/")
            else:
                rules.append(f"content: {embedded_json(content_schema)}")
        else:
            rules.insert(0, "start: calls")
        return lark_grammar("\n".join(rules) + "\n", tokenizer)


def _call_schema(function: Function, arguments_def: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": {"$ref": f"#/$defs/{arguments_def}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references ("#", "#/$defs/X") pointing under ``root`` instead of its own root."""
    if isinstance(schema, Mapping):
        return {
            k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, root)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    return schema


def _lark_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# -- request parsing ------------------------------------------------------------------------------------------


def parse_tools(tools: Any) -> tuple[Function, ...]:
    """OpenAI's ``tools``: [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolSpecError(f"'tools' must be a list of at most {MAX_TOOLS} function tools", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        spec = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(spec, Mapping):
            raise ToolSpecError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolSpecError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'", "tools")
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise ToolSpecError(f"{where}.function.description must be a string", "tools")
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ToolSpecError(f"{where}.function.parameters must be a JSON schema object", "tools")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise ToolSpecError(f"{where}.function.strict must be true or false", "tools")
        functions.append(Function(name, description, parameters))
    if len({f.name for f in functions}) != len(functions):
        raise ToolSpecError("'tools' has two functions of the same name", "tools")
    return tuple(functions)


def tool_choice(tools: Any, choice: Any = None, parallel: Any = None) -> ToolChoice | None:
    """The validated ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a request; None when no tool is
    offered (no tools, or ``"none"``)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolSpecError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    functions = parse_tools(tools) if tools is not None else ()
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, Mapping):
        function = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
        ):
            raise ToolSpecError('\'tool_choice\' must be "none", "auto", "required" or a function', "tool_choice")
        name = function["name"]
        if name not in {f.name for f in functions}:
            raise ToolSpecError(f"'tool_choice' names {name!r}, which is not one of the tools", "tool_choice")
        choice = "function"
    elif choice not in CHOICES:
        raise ToolSpecError('\'tool_choice\' must be "none", "auto", "required" or a function', "tool_choice")
    if choice == "none" or not functions:
        if choice in ("required", "function"):
            raise ToolSpecError("'tool_choice' asks for a tool call but 'tools' is empty", "tool_choice")
        return None
    return ToolChoice(functions, choice, name, parallel is not False)


# -- the conversation as the chat template sees it ------------------------------------------------------------


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages with the tool fields checked: an assistant's ``tool_calls`` (arguments, a JSON string in
    the wire format, become the object Hugging Face templates expect) and a tool message's ``tool_call_id``."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            out.append(message)  # the chat template's own checks say what is wrong with it
            continue
        clean = dict(message)
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolSpecError(f"messages[{i}].tool_calls must be a list on an assistant message", "messages")
            where = f"messages[{i}].tool_calls"
            clean["tool_calls"] = [_history_call(call, f"{where}[{k}]") for k, call in enumerate(calls)]
            if clean.get("content") is None:
                clean["content"] = ""
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ToolSpecError(f"messages[{i}].{key} must be a string", "messages")
        out.append(clean)
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ToolSpecError(f'{where} must be {{"type": "function", "function": {{"name", "arguments"}}}}', "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ToolSpecError(f"{where}.function.arguments is not JSON", "messages") from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def conversation_for_template(
    messages: Sequence[Mapping[str, Any]], tools: ToolChoice | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render. ``native``: the template takes ``tools`` and tool messages itself.
    Otherwise the tools are described in a system message, and calls and results are written as text."""
    if not isinstance(messages, (list, tuple)):
        return messages, None  # (rendering refuses it, saying why)
    messages = normalize_messages(messages)
    if native:
        return messages, [f.as_tool() for f in tools.functions] if tools else None
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            out.append(message)
        elif message.get("tool_calls"):
            blocks = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif message.get("role") == "tool":
            result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            # The results of one turn's calls share one user turn.
            if out and isinstance(out[-1], dict) and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(message)
    for message in out:
        if isinstance(message, dict):
            message.pop("tool_results", None)
    if tools is not None:
        prompt = system_prompt(tools)
        if out and isinstance(out[0], Mapping) and out[0].get("role") == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def system_prompt(tools: ToolChoice) -> str:
    """The tools and the call syntax, for a template that cannot take ``tools`` itself."""
    listing = "\n".join(json.dumps(f.as_tool()["function"], ensure_ascii=False) for f in tools.functions)
    if tools.choice == "function":
        ask = f"You must call the function {tools.name}."
    elif tools.choice == "required":
        ask = "You must call one or more of these functions."
    else:
        ask = "Call a function when it helps to answer; otherwise answer normally."
    return (
        "You can call these functions:\n"
        f"{listing}\n\n{ask} To call a function, reply with one block per call:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}\n'
        "Results come back in <tool_response> blocks."
    )


def format_call(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


# -- calls parsed from the output ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire format)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """Splits a completion's text, as it streams, into message content and tool calls. Text that may be the start
    of a call is held back until it is one (or is not); whitespace next to a call is not content."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._inside = False
        self._space = ""  # whitespace not yet given out: content only if more content follows
        self._after_call = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) that ``text`` completes."""
        self._buffer += text
        content: list[str] = []
        found: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                call = self._parse(body)
                if call is None:  # not a call after all: it stays text
                    content.append(self._text(OPEN + body + CLOSE))
                else:
                    self._space, self._after_call = "", True
                    found.append(call)
            else:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    content.append(self._text(self._buffer[: len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._text(self._buffer[:start]))
                self._space = ""
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside = True
        self.calls.extend(found)
        return "".join(content), found

    def flush(self) -> str:
        """At the end: content still held back (an unfinished call is text)."""
        rest = (OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        text = self._text(rest)
        if not self.calls:
            text, self._space = text + self._space, ""
        return text

    def _text(self, text: str) -> str:
        """Content, with trailing whitespace held until more content follows it (dropped before a call), and
        leading whitespace after a call dropped."""
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self._space += text
            return ""
        out = self._space + stripped
        self._space = text[len(stripped) :]
        if self._after_call:
            out, self._after_call = out.lstrip(), False
        return out

    def _parse(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, tools: ToolChoice | Sequence[str | Mapping[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole completion; ``tools``: the offered tools (OpenAI's dicts) or their names."""
    if isinstance(tools, ToolChoice):
        names = tools.names
    else:
        names = frozenset(t if isinstance(t, str) else t["function"]["name"] for t in tools)
    stream = ToolCallStream(names)
    content, calls = stream.push(text)
    return content + stream.flush(), calls
