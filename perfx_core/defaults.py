"""The generation defaults, written once: the Python API, the command line and the desktop app all read them.

MAX_TOKENS is high enough that a chat model's usual answer ends on its own end-of-turn token rather than mid-word;
the command line lowers it to what is left of the context when a conversation grows. The OpenAI-compatible server
follows OpenAI's own defaults instead (perfx_core.serving.protocol), since its clients expect those.
"""

from __future__ import annotations

MAX_TOKENS = 512
TEMPERATURE = 0.8  # as llama.cpp and ollama; 0 is greedy
TOP_K = 40  # 0 disables
TOP_P = 0.95  # 1 disables
MIN_P = 0.05  # 0 disables
REPETITION_PENALTY = 1.0  # 1 disables
