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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..generation import StreamingText, take_token
from ..grammar import prefetch_masks
from ..logprobs import TokenLogprob, token_logprobs
from ..pooling import MeanPool
from ..prefix_cache import SlotPrefixes
from ..sampling import Sampler, SamplingParams, TokenConstraint
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
    logprob: TokenLogprob | None = None  # of the token that gave this text, when the request asked for them


@dataclass(frozen=True)
class PromptLogprobs:
    """Before any text, for a request with ``prompt_logprobs``: one entry per prompt token (the first one's
    logprob is None: nothing predicts it)."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Embedding:
    """For a request with ``embed``, before Finished: the prompt's pooled hidden state (perfx_core.pooling)."""

    vector: np.ndarray


Event = TextDelta | PromptLogprobs | Finished | Failed | Embedding


@dataclass
class GenerationRequest:
    """What one HTTP request asks the scheduler for. ``emit`` is called from the scheduler thread."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # end the sequence like end-of-sequence tokens
    include_stop: bool = False  # the text keeps the stop string that ended it
    logprobs: int | None = None  # report each generated token's logprob and this many alternatives
    prompt_logprobs: bool = False  # also the prompt's (PromptLogprobs); max_tokens may then be 0: scoring only
    embed: bool = False  # the prompt's embedding (Embedding) instead of tokens; max_tokens must be 0
    # A request submitted before this one with the same prompt (the first choice of an n > 1 request): once
    # it has prefilled the prompt, this one copies that cache into its own slot instead of computing it again.
    prefill_from: GenerationRequest | None = None
    # Structured output: this request's place in its grammar (perfx_core.grammar), masking each draw. Its rows
    # bring the logits back (no engine-side picks).
    constraint: TokenConstraint | None = None
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
    generated_logprobs: list[TokenLogprob] = field(default_factory=list)  # with request.logprobs: one per token
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent: int = 0  # the last tokens of ``generated`` whose text is not handled yet (_send_text)
    ending: str | None = None  # a finish reason the tokens gave (EOS, max_tokens), applied once the text is sent
    last_token_time: float = 0.0  # 0 until the first token
    finish_reason: str | None = None
    done: bool = False
    pool: MeanPool | None = None  # an embedding request's hidden rows so far
    source: _Sequence | None = None  # the sequence prefilling this one's prompt, whose cache it will copy

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt_ids)


def _cached_tokens(seq: _Sequence) -> list[int]:
    """The tokens whose keys and values ``seq`` left in its slot, from position 0."""
    prompt = seq.request.prompt_ids
    if seq.prefilling:
        return prompt[: seq.prefilled]
    return (prompt + seq.generated)[: seq.position]


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
        prefix_cache: bool = True,
        hold_events: Callable[[], AbstractContextManager[None]] = nullcontext,
        idle_work: Iterator[object] | None = None,
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
        # Steps run one at a time while no request is waiting or running (the rest of the engine's warm-up).
        self._idle_work = idle_work
        self.n_slots = engine.n_slots
        self.max_batch_size = 0  # largest decode batch so far: shows batching really happened
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(self.n_slots))
        # Prompts start where a free slot's cache already agrees with them (perfx_core.prefix_cache).
        self.prefix_cache = prefix_cache
        self._prefixes = SlotPrefixes(self.n_slots, getattr(engine, "slot_writes", None))
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
    def idle_work_left(self) -> bool:
        """Whether idle work (the rest of the warm-up) is still to run."""
        return self._idle_work is not None

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
                while not self._stopping and not self._waiting and not self._running and self._idle_work is None:
                    self._cond.wait()
                if self._stopping:
                    break
                idle = not self._waiting and not self._running
                if not idle:
                    self._drop_cancelled()
                    self._admit()
            if idle:
                self._idle_step()
                continue
            try:
                self._step()
            except Exception:  # a failed step fails the sequences that cause it, not the batch or the server
                log.exception("scheduler step failed; retrying each sequence alone")
                self._send_taken_texts()
                self._step_each_alone()
            self._release_finished()
        self._send_taken_texts()
        for seq in self._running:
            self._fail(seq, "the server is shutting down")
        for request in self._waiting:
            request.emit(Failed("the server is shutting down"))

    def _idle_step(self) -> None:
        """One step of the idle work; a request that arrives meanwhile waits for this one step only."""
        try:
            next(self._idle_work)  # type: ignore[arg-type]
        except StopIteration:
            self._idle_work = None
            log.info("warm-up finished: every step a request can take is recorded")
        except Exception:  # warm-up is an optimisation: serving goes on without the rest of it
            self._idle_work = None
            log.exception("warming up while idle failed; the remaining steps are recorded when first used")

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
            slot, cached = self._prefixes.choose(self._free_slots, request.prompt_ids)
            # A scored prompt needs every row's logits, an embedded one every row's hidden state.
            if not self.prefix_cache or request.prompt_logprobs or request.embed:
                cached = 0
            self._free_slots.remove(slot)
            self._prefixes.take(slot)
            seq = _Sequence(
                request,
                slot=slot,
                sampler=Sampler(request.sampling, self.tokenizer.eos_ids | request.stop_token_ids, request.constraint),
                streaming=StreamingText(self.tokenizer, request.stop, include_stop=request.include_stop),
                prefilled=cached,
                source=self._prefill_source(request),
            )
            self._running.append(seq)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
                self.metrics.prompt_tokens_cached.inc(cached)

    def _prefill_source(self, request: GenerationRequest) -> _Sequence | None:
        source = request.prefill_from
        if source is None or request.prompt_logprobs or request.embed or source.prompt_ids != request.prompt_ids:
            return None
        return next((s for s in self._running if s.request is source and not s.done), None)

    def _copy_shared_prefills(self) -> None:
        """Sequences whose prompt another one is prefilling (the choices of an n > 1 request) copy its cache once
        it is there, all but the last token: each computes that one itself for logits of its own. One whose
        source ended before its prompt was in (cancelled, failed) prefills on its own."""
        for seq in self._running:
            source = seq.source
            if source is None or seq.done or (source.prefilling and not source.done):
                continue
            seq.source = None
            if source.prefilling or source.finish_reason == "error" or all(s is not source for s in self._running):
                continue
            shared = len(seq.request.prompt_ids) - 1
            if shared > seq.prefilled:
                self.engine.copy_prefix(source.slot, seq.slot, shared)
                if self.metrics:
                    self.metrics.prompt_tokens_cached.inc(shared - seq.prefilled)
                seq.prefilled = shared

    def _step(self) -> None:
        """Queue this iteration's engine work, handle the text of tokens already taken (with ``overlap_output``
        while the device runs that work), then take the step's tokens."""
        collect = self._queue_work()
        self._prefetch_masks()  # (while the device runs the step, where it runs apart from the host)
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
        self._copy_shared_prefills()
        prefilling = next((s for s in self._running if s.prefilling and not s.done and s.source is None), None)
        batch = self._decode_batch()
        # A prompt whose every row is scored (or pooled) prefills on its own: a mixed step returns only its last row.
        scored = prefilling is not None and (prefilling.request.prompt_logprobs or prefilling.request.embed)
        if prefilling is not None and batch and self.mixed_steps and not scored:
            # Only with room for a full mixed chunk (or the prompt's rest): a few tokens per step would starve it.
            room = engine.mixed_prompt_room(len(batch))
            remaining = len(prefilling.request.prompt_ids) - prefilling.prefilled
            if room >= min(self.mixed_chunk, self.prefill_chunk, remaining):
                return self._queue_mixed_step(prefilling, batch, room)
        if prefilling is not None:
            # One chunk per iteration, so sequences already decoding wait at most one chunk for their next token.
            self._send_texts()  # the host waits for a prefill on its own anyway: nothing to overlap with
            self._prefill_chunk(prefilling)
            if not prefilling.prefilling and not self.overlap_output:
                self._send_texts()  # its first token goes out now, not after this iteration's decode
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

    def _prefill_chunk(self, seq: _Sequence) -> None:
        """Prefill the next chunk of ``seq``'s prompt; after the last one, take its first token."""
        request = seq.request
        prompt = request.prompt_ids
        first = seq.prefilled
        chunk = prompt[first : first + self.prefill_chunk]
        start = time.perf_counter()
        if request.embed:
            hidden = self.engine.prefill_hidden(chunk, seq.slot, first)
            seq.pool = seq.pool or MeanPool(hidden.shape[1])
            seq.pool.add(hidden)
        else:
            logits = self.engine.prefill(chunk, seq.slot, first, all_logits=request.prompt_logprobs)
        if self.metrics:
            self.metrics.engine_seconds.labels("prefill").observe(time.perf_counter() - start)
        seq.prefilled += len(chunk)
        if request.prompt_logprobs:  # row i predicts the prompt's token first + i + 1
            if first == 0:
                seq.prompt_logprobs.append(TokenLogprob(prompt[0], None))
            scored = prompt[first + 1 : first + 1 + len(chunk)]
            seq.prompt_logprobs.extend(token_logprobs(logits[: len(scored)], scored, request.logprobs or 0))
            logits = logits[-1]
        if not seq.prefilling:
            seq.position = len(prompt)
            self._copy_shared_prefills()  # now: a short generation may end (and free its slot) this iteration
            if request.prompt_logprobs:
                request.emit(PromptLogprobs(tuple(seq.prompt_logprobs)))
            if seq.pool is not None:
                request.emit(Embedding(seq.pool.vector()))
            if request.max_tokens == 0:  # scoring only: no token is generated
                seq.ending = "length"
            else:
                self._take(seq, logits)

    def _step_each_alone(self) -> None:
        """After a failed step: each running sequence's part of it (its next prompt chunk, or its decode row),
        one sequence at a time. Those that fail alone are failed; the rest have made their step. No sequence
        advanced in the failed step (tokens are taken only from its finished rows), and a repeated step
        rewrites the same cache positions."""
        for seq in list(self._running):
            if seq.done or seq.request.cancelled:
                continue
            try:
                if seq.prefilling:
                    self._prefill_chunk(seq)
                elif seq.pending is not None:
                    picks = self._picks([seq])
                    rows = self.engine.decode(*self._decode_args([seq]), **picks)
                    self._take_rows([seq], rows, bool(picks))
            except Exception as exc:
                log.exception("sequence in slot %d failed on its own", seq.slot)
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
        self._send_taken_texts()

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
                self._copy_shared_prefills()
                self._take_rows([prefilling], rows[-1:], bool(picks), advance=False)

        return collect

    @staticmethod
    def _decode_args(batch: list[_Sequence]) -> tuple[list[int], list[int], list[int]]:
        """engine.decode's tokens, slots and positions for ``batch``."""
        return [s.pending for s in batch], [s.slot for s in batch], [s.position for s in batch]

    def _decode_batch(self) -> list[_Sequence]:
        return [s for s in self._running if s.pending is not None and not s.done and not s.request.cancelled]

    def _prefetch_masks(self) -> None:
        """The grammar masks of the constrained sequences' next tokens, computed together in the grammar
        engine's threads rather than one after another as each row is taken."""
        constraints = [s.sampler.constraint for s in self._running if s.sampler.constrained and not s.done]
        if len(constraints) > 1:
            try:
                prefetch_masks(constraints)
            except Exception:  # each mask is then computed (and any error met) as its sequence's row is taken
                log.exception("computing grammar masks together failed")

    @staticmethod
    def _picks(seqs: list[_Sequence]) -> dict:
        """How the engine picks the next tokens: argmax when every sequence is plain greedy, a draw on the
        engine when none has a repetition penalty (greedy, or drawn with any filters: the draws each sequence's
        Sampler would make from the logits, sampling.engine_draw), else the logits come back."""
        if any(s.request.logprobs is not None or s.sampler.constrained for s in seqs):
            return {}  # their logprobs, or their grammar's mask, need the logits
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
            try:
                if picked:
                    self._take(seq, token=int(row))
                else:
                    self._take(seq, row)
            except Exception as exc:  # this sequence's own host work (its sampler, its history)
                log.exception("taking the token of the sequence in slot %d failed", seq.slot)
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")

    def _take(self, seq: _Sequence, logits: np.ndarray | None = None, token: int | None = None) -> None:
        """Sample the next token of ``seq`` from ``logits`` (or take the engine's ``token``): the part of
        accepting it that the next step needs. Its text waits for _send_texts."""
        request = seq.request
        seq.pending = None
        if token is None:
            history = request.prompt_ids + seq.generated if request.sampling.needs_history else ()
            token = seq.sampler(logits, history, seq.generated)
        before = len(seq.generated)
        end_ids = seq.sampler.end_ids_set
        seq.ending = take_token(
            token, seq.generated, end_ids, request.ignore_eos, request.max_tokens, seq.sampler.complete
        )
        seq.unsent += len(seq.generated) - before  # an end-of-sequence token has no text
        if request.logprobs is not None and len(seq.generated) > before:
            seq.generated_logprobs.extend(token_logprobs(logits, [token], request.logprobs))
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
                    try:
                        self._send_text(seq)
                    except Exception as exc:  # its detokenizing or stop strings: the others still get theirs
                        log.exception("sending the text of the sequence in slot %d failed", seq.slot)
                        self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")

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
        first = len(seq.generated) - len(new)
        for i, token in enumerate(new):
            delta = seq.streaming.push(token)
            if metrics:
                metrics.generation_tokens.inc()
            logprob = seq.generated_logprobs[first + i] if request.logprobs is not None else None
            if delta or logprob is not None:
                request.emit(TextDelta(delta, logprob))
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
                    if seq.finish_reason != "error":  # a failed step may have left its cache half written
                        self._prefixes.remember(seq.slot, _cached_tokens(seq))
                    if seq.finish_reason is None and seq.request.cancelled and self.metrics:
                        self.metrics.requests_finished.labels("cancelled").inc()
            self._running = [s for s in self._running if not s.done]
