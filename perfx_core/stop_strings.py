"""Finding stop strings in a growing text, in time linear in the text whatever the stops' lengths.

One Aho-Corasick automaton over all the stop strings: each new character moves it one state; the state's depth is
the longest tail of the text that could still become a stop string (the text a stream must hold back), and a
state where a stop string ends is a match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .errors import InvalidArgumentError

MAX_STOP_CHARS = 16384  # all stop strings of a request together


def check_stop_strings(stop: Sequence[str]) -> list[str]:
    if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgumentError("stop must be a list of strings")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise InvalidArgumentError(f"the stop strings are {total} characters together; at most {MAX_STOP_CHARS}")
    return [s for s in stop if s]


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._match = [0]  # length of the longest stop string ending at this state (0: none)
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(0)
                state = nxt
            self._match[state] = max(self._match[state], len(stop))
        self._fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:  # breadth first: a state's fallback is shallower, so it is final before it is used
            state = queue.popleft()
            for ch, child in self._goto[state].items():
                if state:
                    self._fail[child] = self._next(self._fail[state], ch)
                self._match[child] = max(self._match[child], self._match[self._fail[child]])
                queue.append(child)
        self.max_len = max((len(s) for s in stops), default=0)
        self._state = 0
        self._text = ""  # what has been fed

    def _next(self, state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    def feed(self, text: str, emitted: int) -> tuple[tuple[int, int] | None, int]:
        """Take ``text`` (the whole text so far; ``emitted`` of its characters are already out). Returns ((start,
        end) of the first stop string, or None; the length of the tail to hold back)."""
        if text.startswith(self._text):
            start = len(self._text)
        else:  # the text changed behind us (a re-decoded token): look again from what may still be unsent
            start = max(0, emitted - self.max_len)
            self._state = 0
        self._text = text
        state = self._state
        for i in range(start, len(text)):
            state = self._next(state, text[i])
            if self._match[state]:
                self._state = state
                return (i + 1 - self._match[state], i + 1), 0
        self._state = state
        return None, self._depth[state]
