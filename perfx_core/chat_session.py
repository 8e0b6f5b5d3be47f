"""One conversation of ``perfx chat``: its messages, its slash commands, and each turn's generation.

The KV cache carries over between turns through the model's prefix caching (perfx_core.prefix_cache): a turn's
prompt is the whole conversation rendered again, and the slot the previous turn used already holds all of it but
the new message, so only that part is prefilled (``stats.prompt_tokens - stats.cached_prompt_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import defaults
from .generation import Generation

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "leave (also /quit, /bye or Ctrl-D)",
}
EXIT_COMMANDS = ("/exit", "/quit", "/bye")


@dataclass(frozen=True)
class Reply:
    """What a line typed in the chat asks for: ``text`` to print (a command's answer), ``generation`` to stream,
    or ``exit``."""

    text: str = ""
    generation: Generation | None = None
    exit: bool = False


def help_text() -> str:
    lines = [f"  {name:8s} {what}" for name, what in COMMANDS.items()]
    lines.append("  Start a message with // to send one that begins with /.")
    return "\n".join(["Commands:", *lines])


class ChatSession:
    """``sampling``: Model.generate's keyword arguments; a None ``max_tokens`` is defaults.MAX_TOKENS, lowered to
    what the context has left so that a long conversation still gets an answer."""

    def __init__(self, model: Any, system: str | None = None, sampling: Mapping[str, Any] | None = None):
        self.model = model
        self.system = system
        self.sampling = dict(sampling or {})
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def handle(self, line: str) -> Reply:
        """A typed line: a command's answer, or the generation of the model's reply (stream it, then ``finish``)."""
        text = line.strip()
        if not text:
            return Reply()
        if text.startswith("/") and not text.startswith("//"):
            return self._command(text)
        if text.startswith("//"):
            line = line.replace("//", "/", 1)
        return Reply(generation=self.ask(line))

    def _command(self, text: str) -> Reply:
        name = text.split()[0].lower()
        if name in EXIT_COMMANDS:
            return Reply(exit=True)
        if name == "/help":
            return Reply(text=help_text())
        if name == "/reset":
            self.reset()
            kept = " (the system prompt stays)" if self.system else ""
            return Reply(text=f"Conversation cleared{kept}.")
        return Reply(text=f"Unknown command {name}; /help lists the commands. Nothing was sent to the model.")

    def ask(self, content: str) -> Generation:
        """Start the model's reply to ``content``; the message joins the conversation once ``finish`` is called."""
        messages = [*self.messages, {"role": "user", "content": content}]
        ids = self.model.chat_prompt_ids(messages)
        sampling = dict(self.sampling)
        if sampling.get("max_tokens") is None:
            # At least 1: a conversation that fills the context then fails in generate with the numbers.
            sampling["max_tokens"] = max(1, min(defaults.MAX_TOKENS, self.model.context_length - len(ids)))
        generation = self.model.generate(ids, **sampling)
        self._pending = messages
        return generation

    def finish(self, generation: Generation) -> None:
        """Record the exchange (after the reply ended or was stopped: its text so far is kept)."""
        self.messages = [*self._pending, {"role": "assistant", "content": generation.text}]
