"""Continuous batching: one thread owns the LlamaModel and interleaves prompt chunks with batched decode steps.

Each KV-cache slot holds one running sequence. Every iteration the scheduler drops cancelled requests, admits
waiting ones into free slots, prefills at most one chunk of one prompt, then runs ONE decode step
(``engine.queue_decode``) for every sequence that has a token to feed. With ``mixed_steps`` the chunk (at most
``mixed_chunk`` tokens) rides in that decode's forward pass instead when something is decoding and the engine
has room for it. Results go back through each request's thread-safe ``emit`` callback.

A step's tokens are taken in two parts: first what the next step needs (the token, and whether an end-of-sequence
token or max_tokens ends the sequence), then the text (detokenizing, stop strings, events, latency metrics).
With ``overlap_output`` the text of step N is handled after step N+1 is queued, while the device runs it, so the
device does not wait for the host's bookkeeping between steps. A stop string found then ends its sequence one
step late: that sequence's row in step N+1 is computed and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..generation import StreamingText, take_token
from ..sampling import Sampler, SamplingParams
from .config import DEFAULT_MIXED_CHUNK

if TYPE_CHECKING:
    from ..model import LlamaModel
    from ..tokenizer import Tokenizer
    from .metrics import ServerMetrics

log = logging.getLogger("perfx.serving")


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue is at its limit."""


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = TextDelta | Finished | Failed


@dataclass
class GenerationRequest:
    """What one HTTP request asks the scheduler for. ``emit`` is called from the scheduler thread."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the request's thread; the scheduler drops it before its next step

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Sequence:
    """A request admitted into a KV-cache slot."""

    request: GenerationRequest
    slot: int
    sampler: Sampler
    streaming: StreamingText
    prefilled: int = 0  # prompt tokens already in the cache
    pending: int | None = None  # sampled token not yet fed through decode
    position: int = 0  # cache position of ``pending``
    generated: list[int] = field(default_factory=list)
    unsent: int = 0  # the last tokens of ``generated`` whose text is not handled yet (_send_text)
    ending: str | None = None  # a finish reason the tokens gave (EOS, max_tokens), applied once the text is sent
    last_token_time: float = 0.0  # 0 until the first token
    finish_reason: str | None = None
    done: bool = False

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_ids)


class Scheduler:
    """Owns ``engine`` (n_slots = max running sequences) from its own thread; other threads only submit/cancel."""

    def __init__(
        self,
        engine: LlamaModel,
        tokenizer: Tokenizer,
        *,
        max_queue: int,
        prefill_chunk: int,
        metrics: ServerMetrics | None = None,
        mixed_steps: bool = False,
        mixed_chunk: int = DEFAULT_MIXED_CHUNK,
        overlap_output: bool = False,
        hold_events: Callable[[], AbstractContextManager[None]] = nullcontext,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        # A prompt chunk rides along with the decode rows in one forward pass (engine.mixed_prompt_room).
        self.mixed_steps = mixed_steps
        # Its most prompt tokens: the sequences decoding wait for the whole step, whose cost grows with its rows
        # (ServerConfig.mixed_chunk).
        self.mixed_chunk = mixed_chunk
        # A step's text is handled while the device runs the next step (module docstring).
        self.overlap_output = overlap_output
        # Entered around each handling of text: emitted events may wait in it, so whoever receives them is woken
        # once it is done, not in the middle of it (the two threads would take turns on the GIL).
        self.hold_events = hold_events
        self.n_slots = engine.n_slots
        self.max_batch_size = 0  # largest decode batch so far: shows batching really happened
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(self.n_slots))
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="perfx-scheduler", daemon=True)

    # -- called from other threads ----------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def slots_used(self) -> int:
        return self.n_slots - len(self._free_slots)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        """True once the scheduler thread has ended (its engine is no longer in use)."""
        return not self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; raises QueueFullError when it can neither run now nor wait."""
        with self._cond:
            if self._stopping:  # nobody would ever answer it
                raise QueueFullError("the server is shutting down; retry on another instance")
            # Requests not yet admitted but with a free slot ahead of them are not queued: they run next step.
            queued = len(self._waiting) - len(self._free_slots)
            if queued >= self.max_queue:
                raise QueueFullError(
                    f"the server is at capacity ({self.n_slots} running, {len(self._waiting)} waiting); retry later"
                )
            self._waiting.append(request)
            self._cond.notify()

    def wake(self) -> None:
        """Ask the thread to look at cancellations now (a cancelled request must not hold its slot)."""
        with self._cond:
            self._cond.notify()

    # -- the scheduler thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                self._drop_cancelled()
                self._admit()
            try:
                self._step()
            except Exception as exc:  # an engine failure fails the batch, not the server
                log.exception("scheduler step failed")
                self._send_taken_texts()
                for seq in self._running:
                    self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            self._release_finished()
        self._send_taken_texts()
        for seq in self._running:
            self._fail(seq, "the server is shutting down")
        for request in self._waiting:
            request.emit(Failed("the server is shutting down"))

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self._waiting):
            if self.metrics:
                self.metrics.requests_finished.labels("cancelled").inc(sum(r.cancelled for r in self._waiting))
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for seq in self._running:
            if seq.request.cancelled:
                seq.done = True
        self._release_finished()

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            request = self._waiting.popleft()
            seq = _Sequence(
                request,
                slot=self._free_slots.pop(0),
                sampler=Sampler(request.sampling),
                streaming=StreamingText(self.tokenizer, request.stop),
            )
            self._running.append(seq)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))

    def _step(self) -> None:
        """Queue this iteration's engine work, handle the text of tokens already taken (with ``overlap_output``
        while the device runs that work), then take the step's tokens."""
        collect = self._queue_work()
        if self.overlap_output:
            self._send_texts()
        if collect is not None:
            collect()
        # Sequences that ended wait for the next step's overlap phase too: finishing them here (their slots free a
        # step sooner) made the H200's c16 p99 inter-token latency worse, 9.4-9.5 against 8.5 ms.
        if not self.overlap_output or not self._decode_batch():  # no next step to overlap with
            self._send_texts()

    def _queue_work(self) -> Callable[[], None] | None:
        """Queue the next engine step (a prompt chunk and/or a decode or mixed step); returns what takes its
        tokens once it is done (None when nothing was queued). A prefill on its own is waited for here."""
        engine = self.engine
        prefilling = next((s for s in self._running if s.prefilling and not s.done), None)
        batch = self._decode_batch()
        if prefilling is not None and batch and self.mixed_steps:
            # Only with room for a full mixed chunk (or the prompt's rest): a few tokens per step would starve it.
            room = engine.mixed_prompt_room(len(batch))
            remaining = len(prefilling.request.prompt_ids) - prefilling.prefilled
            if room >= min(self.mixed_chunk, self.prefill_chunk, remaining):
                return self._queue_mixed_step(prefilling, batch, room)
        if prefilling is not None:
            # One chunk per iteration, so sequences already decoding wait at most one chunk for their next token.
            prompt = prefilling.request.prompt_ids
            chunk = prompt[prefilling.prefilled : prefilling.prefilled + self.prefill_chunk]
            self._send_texts()  # the host waits for a prefill on its own anyway: nothing to overlap with
            start = time.perf_counter()
            logits = engine.prefill(chunk, prefilling.slot, prefilling.prefilled)
            if self.metrics:
                self.metrics.engine_seconds.labels("prefill").observe(time.perf_counter() - start)
            prefilling.prefilled += len(chunk)
            if not prefilling.prefilling:
                prefilling.position = len(prompt)
                self._take(prefilling, logits)
                if not self.overlap_output:  # its first token goes out now, not after this iteration's decode
                    self._send_texts()
            batch = self._decode_batch()
        if not batch:
            return None
        picks = self._picks(batch)
        start = time.perf_counter()
        queued = engine.queue_decode(*self._decode_args(batch), **picks)

        def collect() -> None:
            rows = queued.result()
            # (From queueing to the rows: with overlap_output it includes the text handled meanwhile, which is
            # shorter than a GPU step.)
            self._record_step("decode", start, len(batch))
            self._take_rows(batch, rows, bool(picks))

        return collect

    def _queue_mixed_step(self, prefilling: _Sequence, batch: list[_Sequence], room: int) -> Callable[[], None]:
        """One forward pass for the decode rows and the next chunk (at most ``room`` tokens) of a prompt: the
        sequences decoding wait for one pass, not a prefill and then a decode (LlamaModel.decode(prompt=...))."""
        prompt = prefilling.request.prompt_ids
        chunk = prompt[prefilling.prefilled : prefilling.prefilled + min(self.prefill_chunk, room, self.mixed_chunk)]
        if prefilling.prefilled + len(chunk) == len(prompt):  # its row gives the sequence's first token
            picks = self._picks([*batch, prefilling])
        else:  # its row is not used: a stand-in row, so its sampler's stream does not advance
            picks = self._picks(batch)
            if "sampling" in picks:
                picks["sampling"] = np.concatenate([picks["sampling"], picks["sampling"][-1:]])
        start = time.perf_counter()
        queued = self.engine.queue_decode(
            *self._decode_args(batch), prompt=(chunk, prefilling.slot, prefilling.prefilled), **picks
        )

        def collect() -> None:
            rows = queued.result()
            self._record_step("mixed", start, len(batch))
            self._take_rows(batch, rows[:-1], bool(picks))
            prefilling.prefilled += len(chunk)
            if not prefilling.prefilling:  # the chunk's last token gives the sequence its first token
                prefilling.position = len(prompt)
                self._take_rows([prefilling], rows[-1:], bool(picks), advance=False)

        return collect

    @staticmethod
    def _decode_args(batch: list[_Sequence]) -> tuple[list[int], list[int], list[int]]:
        """engine.decode's tokens, slots and positions for ``batch``."""
        return [s.pending for s in batch], [s.slot for s in batch], [s.position for s in batch]

    def _decode_batch(self) -> list[_Sequence]:
        return [s for s in self._running if s.pending is not None and not s.done and not s.request.cancelled]

    @staticmethod
    def _picks(seqs: list[_Sequence]) -> dict:
        """How the engine picks the next tokens: argmax when every sequence is plain greedy, a draw on the
        engine when none has a repetition penalty (greedy, or drawn with any filters: the draws each sequence's
        Sampler would make from the logits, sampling.engine_draw), else the logits come back."""
        if all(s.request.sampling.plain_argmax for s in seqs):
            return {"argmax": True}
        if all(s.request.sampling.engine_sampleable for s in seqs):
            return {"sampling": np.stack([s.sampler.engine_row() for s in seqs])}
        return {}

    def _record_step(self, kind: str, start: float, rows: int) -> None:
        self.max_batch_size = max(self.max_batch_size, rows)
        if self.metrics:
            self.metrics.engine_seconds.labels(kind).observe(time.perf_counter() - start)
            self.metrics.decode_batch_size.observe(rows)

    def _take_rows(self, seqs: list[_Sequence], rows: np.ndarray, picked: bool, advance: bool = True) -> None:
        for seq, row in zip(seqs, rows, strict=True):
            if seq.done:  # a stop string ended it while this step ran: its row is dropped
                continue
            if advance:  # the row fed the pending token at seq.position
                seq.position += 1
            if picked:
                self._take(seq, token=int(row))
            else:
                self._take(seq, row)

    def _take(self, seq: _Sequence, logits: np.ndarray | None = None, token: int | None = None) -> None:
        """Sample the next token of ``seq`` from ``logits`` (or take the engine's ``token``): the part of
        accepting it that the next step needs. Its text waits for _send_texts."""
        request = seq.request
        seq.pending = None
        if token is None:
            history = request.prompt_ids + seq.generated if request.sampling.repetition_penalty != 1.0 else ()
            token = seq.sampler(logits, history)
        before = len(seq.generated)
        seq.ending = take_token(token, seq.generated, self.tokenizer.eos_ids, request.ignore_eos, request.max_tokens)
        seq.unsent += len(seq.generated) - before  # an end-of-sequence token has no text
        if seq.ending is None:
            seq.pending = token

    def _send_taken_texts(self) -> None:
        """Before failing the running sequences: the text of tokens already taken (with overlap_output a
        sequence may have ended, its text not yet sent) still goes out."""
        try:
            self._send_texts()
        except Exception:
            log.exception("sending the last texts failed")

    def _send_texts(self) -> None:
        with self.hold_events():
            for seq in self._running:
                if not seq.done and (seq.unsent or seq.ending):
                    self._send_text(seq)

    def _send_text(self, seq: _Sequence) -> None:
        """Stream the text of ``seq``'s new tokens and finish it on a stop string, or on the ending its tokens
        gave. Tokens after a stop string (taken while its text waited) are not part of the completion."""
        request, metrics = seq.request, self.metrics
        new = seq.generated[len(seq.generated) - seq.unsent :]
        seq.unsent = 0
        now = time.perf_counter()
        for _ in range(len(new) + (seq.ending == "stop")):  # an end-of-sequence token arrives too, without text
            if metrics and seq.last_token_time:
                metrics.inter_token_latency.observe(now - seq.last_token_time)
            elif metrics:
                metrics.time_to_first_token.observe(now - request.arrival)
            seq.last_token_time = now
        for i, token in enumerate(new):
            delta = seq.streaming.push(token)
            if metrics:
                metrics.generation_tokens.inc()
            if delta:
                request.emit(TextDelta(delta))
            if seq.streaming.stopped:
                del seq.generated[len(seq.generated) - len(new) + i + 1 :]
                self._finish(seq, "stop")
                return
        if seq.ending is not None:
            self._finish(seq, seq.ending)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        tail = seq.streaming.flush()
        if tail:
            seq.request.emit(TextDelta(tail))
        seq.done, seq.finish_reason = True, reason
        seq.request.emit(Finished(reason, len(seq.request.prompt_ids), len(seq.generated)))
        if self.metrics:
            self.metrics.requests_finished.labels(reason).inc()

    def _fail(self, seq: _Sequence, message: str) -> None:
        if not seq.done:
            seq.done, seq.finish_reason = True, "error"
            seq.request.emit(Failed(message))
            if self.metrics:
                self.metrics.requests_finished.labels("error").inc()

    def _release_finished(self) -> None:
        if not any(s.done for s in self._running):
            return
        with self._cond:  # submit() reads the free slots
            for seq in self._running:
                if seq.done:
                    self._free_slots.append(seq.slot)
                    if seq.finish_reason is None and seq.request.cancelled and self.metrics:
                        self.metrics.requests_finished.labels("cancelled").inc()
            self._running = [s for s in self._running if not s.done]
