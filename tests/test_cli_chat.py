"""``perfx chat``: slash commands, the KV cache kept between turns, and line editing at a real terminal (a pty)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perfx_core.chat_session import ChatSession

STATS = re.compile(
    r"\[(\d+) prompt tokens(?: \((\d+) already in the KV cache\))?, (\d+) prefilled at [\d.]+ tok/s; (\d+) generated"
    r".*finish: (\w+)"
)
GREEDY = {"temperature": 0, "max_tokens": 40}


def test_each_turn_prefills_only_the_new_message(smollm2):
    session = ChatSession(smollm2, sampling=GREEDY)
    turns = []
    questions = ("What is the capital of France?", "And of Germany?", "Which of the two is larger?")
    for question in questions:
        generation = session.handle(question).generation
        if question == questions[-1]:  # its prefill is what is measured: one token will do
            reply = next(generation).text
            generation.close()
        else:
            reply = generation.run()
        session.finish(generation)
        turns.append((question, reply, generation.stats))
    assert "Paris" in turns[0][1] and "Berlin" in turns[1][1]
    for (_, _, before), (question, _, stats) in zip(turns, turns[1:], strict=False):
        # Everything the previous turn put in the cache (its prompt and reply; the end-of-turn token it sampled
        # never went in) is reused; what is prefilled is that token, the new message and the template around it.
        assert before.finish_reason == "stop"
        assert stats.cached_prompt_tokens == before.prompt_tokens + before.generated_tokens
        prefilled = stats.prompt_tokens - stats.cached_prompt_tokens
        assert prefilled <= len(smollm2.tokenizer.encode(question)) + 12, (prefilled, stats)
    assert turns[2][2].prompt_tokens > 4 * (turns[2][2].prompt_tokens - turns[2][2].cached_prompt_tokens)


def test_slash_commands_are_answered_not_sent(smollm2):
    session = ChatSession(smollm2, system="Answer in one word.", sampling=GREEDY)
    for line in ("/help", "/reset", "/nope", "/HELP me"):
        reply = session.handle(line)
        assert reply.generation is None and not reply.exit and reply.text, line
    assert "/reset" in session.handle("/help").text
    assert session.handle("/reset").text == "Conversation cleared (the system prompt stays)."
    assert session.handle("/nope").text.startswith("Unknown command /nope; /help lists the commands.")
    assert all(session.handle(word).exit for word in ("/exit", "/quit", "/bye"))
    assert session.messages == [{"role": "system", "content": "Answer in one word."}]
    assert session.handle("   ").generation is None
    generation = session.handle("//slash is a character").generation  # "//" sends a message starting with "/"
    generation.run()
    session.finish(generation)
    assert session.messages[1] == {"role": "user", "content": "/slash is a character"}
    session.handle("/reset")
    assert session.messages == [{"role": "system", "content": "Answer in one word."}]


def test_chat_commands_and_cached_turns_through_the_cli():
    from test_cli import perfx

    lines = ["What is the capital of France?", "/help", "/foo", "/reset", "What is the capital of France?", "Germany?"]
    result = perfx("chat", "-t", "0", "-n", "40", input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    assert "Commands:" in result.stderr and "Unknown command /foo" in result.stderr
    assert "Conversation cleared." in result.stderr
    stats = [(*(int(g or 0) for g in m.groups()[:4]), m.group(5)) for m in STATS.finditer(result.stderr)]
    assert len(stats) == 3, result.stderr  # three messages reached the model; the commands did not
    assert result.stdout.count("Paris") >= 2
    (p1, c1, f1, _, _), (p2, c2, f2, g2, finish2), (p3, c3, f3, _, _) = stats
    assert (c1, f1) == (0, p1)
    assert (p2, c2, f2) == (p1, p1 - 1, 1)  # after /reset the same question: all but the last token was cached
    assert finish2 == "stop" and c3 == p2 + g2 and f3 == p3 - c3 < 20


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
def test_line_editing_history_and_completion_at_a_terminal(tmp_path):
    """At a terminal, input goes through readline: the cursor moves, Up recalls the last line, Tab completes a
    command, and the history is saved for the next session."""
    env = dict(os.environ, TERM="xterm", PERFX_CACHE_DIR=str(tmp_path / "cache"))
    exe = Path(sys.executable).with_name("perfx")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "perfx_core"]
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([*command, "chat", "-q"], stdin=secondary, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    terminal = _Terminal(primary)
    try:
        terminal.read_until(b"> ", timeout=120)  # the model has loaded
        terminal.type(b"/rset" + b"\x1b[D" * 3 + b"e\r")  # Left x3 puts the cursor after "/r": "/reset"
        assert b"Conversation cleared." in terminal.read_until(b"> ")
        terminal.type(b"\x1b[A\r")  # Up: the previous line again
        assert b"Conversation cleared." in terminal.read_until(b"> ")
        terminal.type(b"/he\t\r")  # Tab completes /help
        assert b"Commands:" in terminal.read_until(b"> ")
        terminal.type(b"\x04")  # Ctrl-D
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(primary)
    assert (tmp_path / "cache" / "chat_history").read_text().split() == ["/reset", "/help"]  # repeats are kept once


class _Terminal:
    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def read_until(self, marker: bytes, timeout: float = 30) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {marker!r} within {timeout} s; the terminal shows {self.buffer!r}")
            try:
                self.buffer += os.read(self.fd, 4096)
            except OSError:  # the process closed the terminal
                raise AssertionError(f"the terminal closed; it showed {self.buffer!r}") from None
        end = self.buffer.index(marker) + len(marker)
        seen, self.buffer = self.buffer[:end], self.buffer[end:]
        return seen
