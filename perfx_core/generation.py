"""The generation loop: prefill, then decode token by token, streaming text and measuring itself."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .errors import ContextLengthError, InvalidArgumentError
from .measure import peak_host_bytes
from .sampling import Sampler, SamplingParams, TokenConstraint
from .stop_strings import StopMatcher, check_stop_strings

if TYPE_CHECKING:
    from .model import LlamaModel
    from .tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completed (may be "" while a UTF-8 character or stop string is pending)."""

    id: int
    text: str


def take_token(
    token: int,
    generated: list[int],
    eos_ids: Collection[int],
    ignore_eos: bool,
    max_tokens: int,
    complete: bool = False,
) -> str | None:
    """The part of accepting a sampled token that needs no text (the server's scheduler does it before the text):
    an end-of-sequence token ends the sequence without joining ``generated`` ("stop"); any other is appended,
    and ends it when its grammar allows nothing more (``complete``: "stop") or when it is the max_tokens-th
    ("length"). None: go on."""
    if token in eos_ids and not ignore_eos:
        return "stop"
    generated.append(token)
    if complete:
        return "stop"
    return "length" if len(generated) >= max_tokens else None


def accept_token(
    token: int,
    generated: list[int],
    streaming: StreamingText,
    eos_ids: Collection[int],
    ignore_eos: bool,
    max_tokens: int,
    complete: bool = False,
) -> tuple[str | None, str | None]:
    """Apply one sampled token to a sequence: take_token, then its text.

    Returns (text delta, finish reason). The delta is None when the token ends the sequence without being
    part of it (an end-of-sequence token); otherwise its text (possibly "" while a UTF-8 character or a stop
    string is incomplete). The reason is "stop" (EOS or a stop string, which wins over max_tokens on the same
    token), "length" (max_tokens reached) or None (go on).
    """
    before = len(generated)
    reason = take_token(token, generated, eos_ids, ignore_eos, max_tokens, complete)
    if len(generated) == before:  # an end-of-sequence token: no text
        return None, reason
    delta = streaming.push(token)
    return delta, "stop" if streaming.stopped else reason


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of which already in the KV cache (prefix caching): not prefilled again
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0  # from the first next() to the first sampled token (prompt already tokenized)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the decode steps after the first token (includes the consumer's time between tokens)
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    peak_host_bytes: int = 0  # peak resident memory of this process so far
    backend_bytes: int = 0  # bytes the backend holds (weights, KV cache, buffers)
    backend_peak_bytes: int = 0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length", or "cancelled"
    op_profile: dict | None = field(default=None)  # seconds and calls per op, when profiling

    def as_dict(self) -> dict:
        return asdict(self)


CONTEXT_TOKENS = 4
CHECKPOINT_EVERY = 32


class StreamingText:
    """Turns a growing list of token ids into text deltas, holding back an unfinished UTF-8 character
    and any tail that could be the start of a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.include_stop = include_stop  # the text ends with the stop string found, not before it
        self.stop = check_stop_strings(stop)
        self._stops = StopMatcher(self.stop)
        self.ids: list[int] = []
        self._checkpoint = 0  # decode(ids[:_checkpoint]) == _checkpoint_text
        self._checkpoint_text = ""
        self._checkpoint_head = ""  # decode of the CONTEXT_TOKENS ids before the checkpoint
        self.emitted = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stopped:  # the completion ended at its stop string: nothing after it is text
            return ""
        text = self._decoded_text()
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is split across tokens: wait for the rest
        if not self.stop:
            return self._emit(text)
        found, pending = self._stops.feed(text, len(self.emitted))
        if found is not None:
            self.stopped = True
            return self._emit(text[: found[1] if self.include_stop else found[0]])
        return self._emit(text[: len(text) - pending])

    def _decoded_text(self) -> str:
        """decode(self.ids), re-decoding only the tokens after the last checkpoint (linear, not quadratic).

        A few tokens before the checkpoint are decoded with the tail and their text stripped again, since a
        token's text can depend on its left neighbour (SentencePiece's leading space).
        """
        start = max(0, self._checkpoint - CONTEXT_TOKENS)
        tail = self.tokenizer.decode(self.ids[start:])
        if not tail.startswith(self._checkpoint_head):
            return self.tokenizer.decode(self.ids)
        text = self._checkpoint_text + tail[len(self._checkpoint_head) :]
        if len(self.ids) - self._checkpoint >= CHECKPOINT_EVERY and not text.endswith("\ufffd"):
            self._checkpoint, self._checkpoint_text = len(self.ids), text
            self._checkpoint_head = self.tokenizer.decode(self.ids[max(0, self._checkpoint - CONTEXT_TOKENS) :])
        return text

    def _emit(self, text: str) -> str:
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def flush(self) -> str:
        """At the end, release held-back text that turned out not to be a stop string."""
        if self.stopped:
            return ""
        return self._emit(self._decoded_text())


class Generation:
    """An iterator of TokenEvent for one request; ``stats``, ``text`` and ``token_ids`` fill in as it runs.

    Stopping early (``close()``, or dropping it after leaving a for-loop with break) ends it with finish_reason
    "cancelled". ``lock`` is held for each step, so generations on other slots of the same model may be
    iterated from other threads; ``on_end`` is called once, when it ends for any reason.
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        slot: int = 0,
        profile: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: Collection[int] = (),
        include_stop: bool = False,
        lock: AbstractContextManager | None = None,
        on_end: Callable[[Generation], None] | None = None,
        constraint: TokenConstraint | None = None,
    ):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
        if len(prompt_ids) == 0:
            raise InvalidArgumentError("the prompt is empty: give at least one token of text")
        if len(prompt_ids) + max_tokens > model.max_seq_len:
            raise ContextLengthError(len(prompt_ids), int(max_tokens), model.max_seq_len)
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = int(max_tokens)
        self.end_ids = frozenset(tokenizer.eos_ids) | frozenset(stop_token_ids)
        self.sampler = Sampler(sampling, self.end_ids, constraint)  # constraint: structured output's grammar
        self.streaming = StreamingText(tokenizer, stop, include_stop=include_stop)
        self.slot = slot
        self.profile = profile
        self.ignore_eos = ignore_eos
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.token_ids: list[int] = []
        self.text = ""
        self._decode_steps = 0
        self.cached = 0  # prompt tokens already in the slot's cache (prefix caching): prefill starts after them
        self._kv_tokens = 0  # positions of the slot's cache this generation has written, from 0
        self._lock = lock if lock is not None else nullcontext()
        self._on_end = on_end
        self._events = self._run()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        with self._lock:
            return next(self._events)

    def close(self) -> None:
        with self._lock:
            self._events.close()
            self._end()  # a generation never started has no ``finally`` to run

    def cached_tokens(self) -> list[int]:
        """The tokens whose keys and values this generation left in its slot, from position 0 (only as far as
        it wrote them: a prefill that failed part-way leaves what was there before)."""
        return (self.prompt_ids + self.token_ids)[: self._kv_tokens]

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(self)

    def run(self) -> str:
        """Consume the whole generation; returns the text."""
        for _ in self:
            pass
        return self.text

    def _run(self) -> Iterator[TokenEvent]:
        model, stats = self.model, self.stats
        ops = model.rt.ops
        if self.profile:
            ops.start_profiling()
        stats.finish_reason = "cancelled"
        start = time.perf_counter()
        try:
            self._kv_tokens = self.cached
            logits = model.prefill(self.prompt_ids[self.cached :], slot=self.slot, start=self.cached)
            self._kv_tokens = len(self.prompt_ids)
            stats.cached_prompt_tokens = self.cached
            stats.prefill_s = time.perf_counter() - start
            decode_start = time.perf_counter()
            position = len(self.prompt_ids)
            # Without a repetition penalty the engine picks the token, greedy or drawn with any filters (on the
            # device when the backend can; the draw is the same on the host, see sampling.engine_draw).
            # A grammar masks the logits on the host (structured output): the engine returns them.
            params, constrained = self.sampler.params, self.sampler.constrained
            device_argmax, picked, ahead = params.plain_argmax and not constrained, None, None
            device_sample = not params.greedy and params.engine_sampleable and not constrained
            while True:
                if picked is not None:
                    token = picked
                else:
                    # The history only matters to the penalties: do not rebuild it for every token.
                    history = self.prompt_ids + self.token_ids if params.needs_history else ()
                    token = self.sampler(logits, history, self.token_ids)
                if not self.token_ids:
                    stats.time_to_first_token_s = time.perf_counter() - start
                    decode_start = time.perf_counter()
                delta, reason = accept_token(
                    token,
                    self.token_ids,
                    self.streaming,
                    self.end_ids,
                    self.ignore_eos,
                    self.max_tokens,
                    self.sampler.complete,
                )
                if delta is not None:
                    stats.generated_tokens = len(self.token_ids)
                    self.text += delta
                    yield TokenEvent(token, delta)
                if reason is not None:
                    stats.finish_reason = reason
                    break
                if device_argmax or device_sample:
                    step = ahead or model.queue_decode([token], [self.slot], [position], **self._device_pick())
                    # On a device with its own queue the step after it goes in before this one's token is read,
                    # fed from its pick on the device: the device runs on while the host reads, checks and streams
                    # the token. Not where that token is sure to be the last; a step wasted after an end token
                    # only writes the cache past the sequence.
                    ahead = None
                    if model.rt.device_index_inputs and len(self.token_ids) + 1 < self.max_tokens:
                        ahead = model.queue_decode(step, [self.slot], [position + 1], **self._device_pick())
                    picked = int(step.result()[0])
                else:
                    logits = model.decode([token], [self.slot], [position])[0]
                position += 1
                self._kv_tokens = position
                self._decode_steps += 1
                stats.decode_s = time.perf_counter() - decode_start
            tail = self.streaming.flush()
            if tail:
                self.text += tail
                yield TokenEvent(self.token_ids[-1], tail)
        finally:
            self._finish_stats(ops)
            self._end()

    def _device_pick(self) -> dict:
        """How the engine picks a step's token on the device: argmax, or a draw with the next step's row."""
        if self.sampler.params.plain_argmax:
            return {"argmax": True}
        return {"sampling": self.sampler.engine_row()[None, :]}

    def _finish_stats(self, ops) -> None:
        stats = self.stats
        if stats.prefill_s > 0:
            stats.prefill_tokens_per_s = (stats.prompt_tokens - stats.cached_prompt_tokens) / stats.prefill_s
        if self._decode_steps and stats.decode_s > 0:
            stats.decode_tokens_per_s = self._decode_steps / stats.decode_s
        stats.peak_host_bytes = peak_host_bytes()
        stats.backend_bytes = self.model.rt.allocated_bytes
        stats.backend_peak_bytes = self.model.rt.peak_allocated_bytes
        if self.profile:
            profile = ops.stop_profiling()
            stats.op_profile = profile.as_dict() if profile else None
