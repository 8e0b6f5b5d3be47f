"""Line editing, history and slash-command completion for ``perfx chat`` at a terminal, through GNU readline
(or libedit) from the standard library: once ``readline`` is imported, ``input()`` edits lines with it.

The history lives in the user cache directory (``chat_history``; PERFX_CACHE_DIR moves it) and survives sessions.
Where the platform has no readline module (Windows without pyreadline3), chat still works without editing.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

from .chat_session import COMMANDS, EXIT_COMMANDS
from .settings import cache_dir

HISTORY_LINES = 1000


class LineEditing:
    def __init__(self, enabled: bool):
        self.readline = None
        if enabled:
            try:
                import readline
            except ImportError:
                return
            self.readline = readline
        self.history = cache_dir() / "chat_history"

    def __enter__(self) -> LineEditing:
        rl = self.readline
        if rl is None:
            return self
        with contextlib.suppress(OSError):
            rl.read_history_file(self.history)
        rl.set_history_length(HISTORY_LINES)
        names = sorted({*COMMANDS, *EXIT_COMMANDS})

        def complete(text: str, state: int) -> str | None:
            matches = [n for n in names if n.startswith(text)] if text.startswith("/") else []
            return matches[state] if state < len(matches) else None

        rl.set_completer(complete)
        rl.set_completer_delims(" \t\n")
        # libedit (macOS's Python) spells the binding differently
        rl.parse_and_bind("bind ^I rl_complete" if "libedit" in (rl.__doc__ or "") else "tab: complete")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.readline is None:
            return
        with contextlib.suppress(OSError):  # a read-only cache directory costs the history, not the chat
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
