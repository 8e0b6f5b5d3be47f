"""The Llama forward pass on any backend: device weights, KV cache, and the prefill and decode paths.

The model is stateless about sequences: callers say which KV-cache slot and position each token goes to,
so one model serves one chat (slot 0) or a batch of requests (one slot each).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import row_parts
from .backend import AttentionSpec, KVCacheSpec, RopeTable, Runtime
from .config import LlamaConfig, LlamaWeights
from .errors import BackendError, ContextLengthError, InvalidArgumentError
from .ops import PROMPT_KEYS, prompt_indices
from .rope import rope_cos_sin
from .sampling import ENGINE_ROW, engine_draw, engine_params
from .weights import RowParts, Weight, concat_rows, for_runtime


@dataclass
class DeviceLayer:
    attn_norm: Any  # (dim,)
    w_qkv: Any  # (q_dim + 2 kv_dim, dim)
    wo: Any  # (dim, q_dim)
    ffn_norm: Any  # (dim,)
    w_gate_up: Any  # (2 ffn_dim, dim)
    w_down: Any  # (dim, ffn_dim)
    b_qkv: Any = None  # (q_dim + 2 kv_dim,): Qwen2's q, k, v biases
    q_norm: Any = None  # (head_dim,): Qwen3's and Gemma 3's per-head norms of q and k
    k_norm: Any = None
    post_attn_norm: Any = None  # (dim,): Gemma's norms of the attention and MLP outputs
    post_ffn_norm: Any = None


MAX_GRAPHS = 512  # recorded steps kept (decode batch sizes x picks and prefill lengths, x attention signatures)
# Recorded prefill chunks are padded to a multiple of this many tokens, so prompts of nearby lengths replay
# one graph (a chunk recorded once per length would rarely be replayed). The padding rows are harmless:
# rows never see later positions, and the cache positions they fill are written again before being read.
PREFILL_GRAPH_ROUNDING = 16
# A mixed step's prompt chunk is padded to a multiple of this instead: its rows share the step with the decode
# rows, and batched matmuls take tokens in tiles of 8 (an 8-token chunk padded to 16 would add a tile).
MIXED_GRAPH_ROUNDING = 8
# A mixed step (decode rows plus a prompt chunk, LlamaModel.decode(prompt=...)) takes at most this many prompt
# rows: its logits come out for every prompt row (so the recording does not depend on where the chunk's last
# real token is), into buffers of n_slots + this many rows made on the first mixed step.
MIXED_PROMPT_ROWS = 64


class QueuedRows:
    """A decode step queued on the device (LlamaModel.queue_decode); ``result()`` waits for its rows.

    ``picks``: where the step picks its tokens on the device (argmax, sample), the (B,) int32 device ids, until
    a later step reuses that buffer; ``queue_decode`` takes such a step as its ``tokens`` and feeds them to the
    next step on the device, without a round trip through the host."""

    def __init__(
        self,
        read: Callable[[], np.ndarray],
        read_later: Callable[[], Callable[[], np.ndarray]] | None = None,
        picks: Any = None,
    ):
        self._read: Callable[[], np.ndarray] | None = read
        self._read_later = read_later
        self._rows: np.ndarray | None = None
        self.picks = picks
        self.rows = None if picks is None else int(picks.shape[0])

    def result(self) -> np.ndarray:
        if self._read is not None:  # read once: the buffers are reused by later steps
            read, self._read = self._read, None  # a failed read is not retried by the next step
            self._rows = read()
        return self._rows

    def detach(self) -> None:
        """Before a later step reuses this one's buffers: queue the read of its rows ahead of that step (on an
        in-order device queue, without waiting for it), else read them now."""
        self.picks = None
        if self._read is None:
            return
        if self._read_later is None:
            self.result()
        else:
            self._read = self._read_later()


class LlamaModel:
    """A Llama model placed on a runtime. ``prefill`` and ``decode`` return host float32 logits."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        runtime: Runtime,
        *,
        n_slots: int = 1,
        max_seq_len: int | None = None,
        prefill_chunk: int | None = None,
        kv_dtype: str | None = None,
    ):
        prefill_chunk = prefill_chunk or runtime.default_prefill_chunk  # None: the runtime's choice
        if n_slots < 1 or prefill_chunk < 1:
            raise InvalidArgumentError("n_slots and prefill_chunk must be at least 1")
        kv_dtype = kv_dtype or runtime.default_kv_dtype  # None: the runtime's choice (float16 on OpenCL GPUs)
        if kv_dtype not in ("float32", "float16"):
            raise InvalidArgumentError(f"kv_dtype must be 'float32' or 'float16'; got {kv_dtype!r}")
        self.config = config
        self.rt = runtime
        self.n_slots = n_slots
        self.max_seq_len = min(max_seq_len or config.context_length, config.context_length)
        self.prefill_chunk = prefill_chunk
        self.attention = AttentionSpec(config.n_heads, config.n_kv_heads, config.head_dim)
        self.layer_specs = [self._layer_spec(i) for i in range(config.n_layers)]
        self._check_features()
        self._upload_weights(weights)
        cos, sin = rope_cos_sin(config, self.max_seq_len)
        self.rope = RopeTable(runtime.from_numpy(cos), runtime.from_numpy(sin))
        # Gemma 3's sliding layers rotate with their own base.
        local = config.rope_local_theta
        local_rope = self.rope
        if local is not None and local != config.rope_theta:
            cos, sin = rope_cos_sin(dataclasses.replace(config, rope_theta=local, rope_scaling=None), self.max_seq_len)
            local_rope = RopeTable(runtime.from_numpy(cos), runtime.from_numpy(sin))
        self.layer_ropes = [local_rope if config.is_sliding(i) else self.rope for i in range(config.n_layers)]
        self.cache_spec = KVCacheSpec(
            config.n_layers, n_slots, self.max_seq_len, config.n_kv_heads, config.head_dim, kv_dtype
        )
        self.cache = runtime.new_kv_cache(self.cache_spec)
        self._allocate_buffers(max(prefill_chunk, n_slots))
        # Recorded steps: decode by (batch size, signature, pick on device), mixed steps by (("mixed", batch size,
        # prompt rows), (decode signature, prompt signature), pick), prefill by ("prefill", length, signature).
        self._graphs: dict[Any, Any] = {}
        # Steps that wrote each slot's cache so far: whoever remembers what a slot holds (prefix caching) can
        # tell that another user of the engine has written it since.
        self.slot_writes = [0] * n_slots
        self.recordings = 0  # graphs recorded so far (a recording step runs the ops' Python: slower than a replay)
        self._unread: QueuedRows | None = None  # the last queued decode step, until its rows are read

    def _layer_spec(self, layer: int) -> AttentionSpec:
        """Layer ``layer``'s attention: the family's features, a window only where it can hide a position."""
        c = self.config
        window = c.sliding_window if c.is_sliding(layer) and c.sliding_window < self.max_seq_len else None
        scale = c.attn_scale if c.attn_scale is not None and c.attn_scale != c.head_dim**-0.5 else None
        return AttentionSpec(c.n_heads, c.n_kv_heads, c.head_dim, window=window, softcap=c.attn_softcap, scale=scale)

    def _check_features(self) -> None:
        """A model whose attention needs a feature its backend's attention ops lack is refused now, not run wrong."""
        needed = frozenset().union(*(spec.features for spec in self.layer_specs))
        for op in ("attention_decode", "attention_prefill", "attention_mixed"):
            lacking = needed - self.rt.ops.features(op) if op != "attention_mixed" else frozenset()
            if lacking:
                raise BackendError(
                    f"this {self.config.arch} model needs {', '.join(sorted(lacking))} in its attention, which "
                    f"{self.rt.backend_name}'s {op} ({self.rt.ops.sources[op]}) does not implement; run it on the "
                    "numpy backend, or with a context no longer than its sliding window"
                )

    def _upload_weights(self, weights: LlamaWeights) -> None:
        rt = self.rt

        def matrices(*ws: Weight | RowParts) -> list[Any]:
            # A layer's matrices in one call: a runtime may place them together (OpenCL: fewer, larger buffers).
            return row_parts.prepare(rt, [for_runtime(w, rt.block_formats, rt.weight_formats) for w in ws])

        tied = weights.output is weights.token_embedding
        if tied:
            (self.embedding,) = matrices(weights.token_embedding)
            self.output = self.embedding
        else:
            self.embedding, self.output = matrices(weights.token_embedding, weights.output)
        self.norm = rt.from_numpy(weights.norm.astype(np.float32))

        def vector(v: np.ndarray | None) -> Any:
            return None if v is None else rt.from_numpy(np.asarray(v, dtype=np.float32))

        self.layers = []
        for layer in weights.layers:
            w_qkv, wo, w_gate_up, w_down = matrices(
                concat_rows([layer.wq, layer.wk, layer.wv]),
                layer.wo,
                concat_rows([layer.w_gate, layer.w_up]),
                layer.w_down,
            )
            self.layers.append(
                DeviceLayer(
                    attn_norm=vector(layer.attn_norm),
                    w_qkv=w_qkv,
                    wo=wo,
                    ffn_norm=vector(layer.ffn_norm),
                    w_gate_up=w_gate_up,
                    w_down=w_down,
                    b_qkv=vector(np.concatenate([layer.bq, layer.bk, layer.bv]) if layer.bq is not None else None),
                    q_norm=vector(layer.q_norm),
                    k_norm=vector(layer.k_norm),
                    post_attn_norm=vector(layer.post_attn_norm),
                    post_ffn_norm=vector(layer.post_ffn_norm),
                )
            )

    def _allocate_buffers(self, max_tokens: int) -> None:
        c, rt = self.config, self.rt
        self.max_tokens = max_tokens
        # qkv is read last by the attention and ffn first written by the gated MLP after it, so the two share
        # one buffer (a 7B's 512-token prefill chunk: 24 MiB instead of 45.5).
        qkv_dim = self.attention.qkv_dim
        shared = rt.empty((max_tokens * max(qkv_dim, c.ffn_dim),))
        self._buffers = {
            "x": rt.empty((max_tokens, c.dim)),  # residual stream
            "h": rt.empty((max_tokens, c.dim)),  # normed input of the next matmul
            "qkv": rt.view(shared, 0, (max_tokens, qkv_dim)),
            "attn": rt.empty((max_tokens, c.q_dim)),
            "ffn": rt.view(shared, 0, (max_tokens, c.ffn_dim)),
            "logits": rt.empty((self.n_slots, c.vocab_size)),
            "argmax": rt.empty((self.n_slots,), np.int32),  # ids picked on the device (argmax, sample)
        }
        # Only the families whose blocks have these steps hold their buffers (Llama has none of them).
        if any(layer.b_qkv is not None or layer.q_norm is not None for layer in self.layers):
            self._buffers["qkv_in"] = rt.empty((max_tokens, self.attention.qkv_dim))  # before bias / q-k norm

    def _rows(self, name: str, start: int, n: int) -> Any:
        buf = self._buffers[name]
        cols = buf.shape[1]
        return self.rt.view(buf, start * cols, (n, cols))

    # -- forward ---------------------------------------------------------------------------------------
    def _forward(self, ids: np.ndarray, attend: Callable[[Any, int, Any], None]) -> Any:
        """Run every block on ``ids``; returns the final-normed hidden rows (n, dim) on the device."""
        ops, c, n = self.rt.ops, self.config, len(ids)
        eps = c.norm_eps
        x, h, qkv = self._rows("x", 0, n), self._rows("h", 0, n), self._rows("qkv", 0, n)
        attn, ffn = self._rows("attn", 0, n), self._rows("ffn", 0, n)
        if c.embed_scale != 1.0:
            ops.embedding(self.embedding, ids, h)
            ops.scale(h, c.embed_scale, x)
        else:
            ops.embedding(self.embedding, ids, x)
        ops.rmsnorm(x, self.layers[0].attn_norm, eps, h)
        for i, layer in enumerate(self.layers):
            self._qkv(h, layer, self.layer_specs[i], qkv)
            attend(qkv, i, attn)
            self._residual_add(attn, layer.wo, layer.post_attn_norm, x, layer.ffn_norm, h)
            if isinstance(layer.w_gate_up, row_parts.PreparedRowParts):
                row_parts.gate_up(self.rt, h, layer.w_gate_up, ffn, gelu=c.activation == "gelu_tanh")
            elif c.activation == "gelu_tanh":
                ops.gate_up_gelu(h, layer.w_gate_up, ffn)
            else:
                ops.gate_up_silu(h, layer.w_gate_up, ffn)
            # The block's output joins the residual stream, normed for the next block (or the final norm).
            next_norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            self._residual_add(ffn, layer.w_down, layer.post_ffn_norm, x, next_norm, h)
        return h

    def _qkv(self, h: Any, layer: DeviceLayer, spec: AttentionSpec, qkv: Any) -> None:
        """The q, k, v rows of the normed input ``h``, with the family's bias and q/k norm."""
        ops = self.rt.ops
        if layer.b_qkv is None and layer.q_norm is None:  # Llama: one op
            self._qkv_proj(h, layer.w_qkv, qkv)
            return
        n = h.shape[0]
        steps = [s for s in ("bias", "norm") if (layer.b_qkv if s == "bias" else layer.q_norm) is not None]
        # Each step writes the other buffer (an op's output never overlaps its input); the last writes qkv.
        buffers = [self._rows("qkv_in", 0, n), qkv] if len(steps) % 2 else [qkv, self._rows("qkv_in", 0, n)]
        self._qkv_proj(h, layer.w_qkv, buffers[0])
        for step, src, dst in zip(steps, buffers, (buffers[1], buffers[0]), strict=False):
            if step == "bias":
                ops.add_bias(src, layer.b_qkv, dst)
            else:
                ops.head_rmsnorm(src, layer.q_norm, layer.k_norm, self.config.norm_eps, spec, dst)

    def _qkv_proj(self, h: Any, w_qkv: Any, out: Any) -> None:
        if isinstance(w_qkv, row_parts.PreparedRowParts):
            row_parts.linear(self.rt, h, w_qkv, out)
        else:
            self.rt.ops.qkv_proj(h, w_qkv, out)

    def _residual_add(self, x: Any, w: Any, post_norm: Any, residual: Any, next_norm: Any, h: Any) -> None:
        """residual += x @ w.T (normed by ``post_norm`` first, where the family has one); h = the normed residual."""
        ops, eps = self.rt.ops, self.config.norm_eps
        if post_norm is None:
            ops.linear_add_rmsnorm(x, w, residual, next_norm, eps, h)
        else:
            ops.linear_post_norm_add_rmsnorm(x, w, post_norm, residual, next_norm, eps, h)

    def _project(self, h: Any, out: Any) -> None:
        """The output logits of hidden rows ``h`` into ``out``, soft-capped where the family caps them."""
        ops, cap = self.rt.ops, self.config.final_softcap
        if cap is None:
            ops.logits(h, self.output, out)
            return
        raw = self.rt.scratch("uncapped_logits", out.shape)
        ops.logits(h, self.output, raw)
        ops.softcap(raw, cap, out)

    def _logits(self, hidden_rows: Any, n: int) -> np.ndarray:
        out = self._rows("logits", 0, n)
        self._project(hidden_rows, out)
        return self.rt.to_numpy(out)

    def prefill(self, tokens: Sequence[int], slot: int = 0, start: int = 0, all_logits: bool = False) -> np.ndarray:
        """Process a prompt (chunked) into ``slot`` from position ``start``.

        Returns logits (vocab,) of the last token, or (len(tokens), vocab) when ``all_logits``.
        """
        ids = self._check_prefill(tokens, slot, start)
        rows = []
        for offset in range(0, len(ids), self.prefill_chunk):
            chunk = ids[offset : offset + self.prefill_chunk]
            h = self._queue_prefill_chunk(chunk, slot, start + offset, recorded=not all_logits)
            if all_logits:
                rows.append(self._all_logits(h, len(chunk)))
        if all_logits:
            return np.concatenate(rows)
        return self._logits(self._rows("h", len(chunk) - 1, 1), 1)[0]

    def prefill_hidden(self, tokens: Sequence[int], slot: int = 0, start: int = 0) -> np.ndarray:
        """Like ``prefill``, but returns the final-normed hidden states (len(tokens), dim) float32, the rows the
        output projection would read: what embeddings pool. The keys and values go into ``slot`` as usual
        (a chunk attends to the earlier ones through the cache), so the caller must own that slot."""
        ids = self._check_prefill(tokens, slot, start)
        rows = []
        for offset in range(0, len(ids), self.prefill_chunk):
            chunk = ids[offset : offset + self.prefill_chunk]
            h = self._queue_prefill_chunk(chunk, slot, start + offset, recorded=False)
            rows.append(self.rt.to_numpy(h))
        return np.concatenate(rows)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the keys and values of positions 0..length-1 from ``src_slot`` into ``dst_slot``: a sequence
        sharing a prompt with another (the n choices of one request) starts from its cache instead of computing
        the prompt again. Queued in order with the steps before and after it."""
        self._check_slot(src_slot)
        self._check_slot(dst_slot)
        if src_slot == dst_slot or not 0 < length <= self.max_seq_len:
            raise InvalidArgumentError(
                f"copy_prefix wants two different slots and 1..{self.max_seq_len} positions; "
                f"got slots {src_slot} -> {dst_slot}, {length} positions"
            )
        self.slot_writes[dst_slot] += 1
        self.rt.copy_kv_prefix(self.cache, src_slot, dst_slot, length)

    def _check_prefill(self, tokens: Sequence[int], slot: int, start: int) -> np.ndarray:
        """The prompt chunk's ids, once its slot and positions are known good (the slot counts as written)."""
        ids = self._check_ids(tokens)
        self._check_slot(slot)
        self.slot_writes[slot] += 1
        if len(ids) == 0:
            raise InvalidArgumentError("prefill needs at least one token")
        if start < 0 or start + len(ids) > self.max_seq_len:
            raise ContextLengthError(start + len(ids), 0, self.max_seq_len)
        return ids

    def _prompt_rows(
        self, chunk: np.ndarray, pos: int, room: int, recorded: bool, rounding: int = PREFILL_GRAPH_ROUNDING
    ) -> tuple[np.ndarray, Any]:
        """The rows a prompt chunk at positions pos.. takes in a step, and the step's graph signature (None: not
        recorded). On a runtime that captures graphs (and with ``recorded``) the chunk is padded to a multiple
        of ``rounding`` tokens (at most ``room`` rows and the context), so prompts of nearby lengths replay one
        recording."""
        if not recorded or self.rt.ops.profile is not None:  # profiling needs the ops' calls
            return chunk, None
        n = len(chunk)
        padded = min(-(-n // rounding) * rounding, room, self.max_seq_len - pos)
        signature = self.rt.graph_signature(np.array([pos + padded - 1], dtype=np.int32))
        if signature is not None and padded > n:
            chunk = np.concatenate([chunk, np.zeros(padded - n, dtype=chunk.dtype)])  # token 0: any valid id
        return chunk, signature

    def _prompt_inputs(self, chunk: np.ndarray, slot: int, pos: int) -> dict[str, np.ndarray]:
        """The index uploads of a prompt chunk's attention (ops.PROMPT_KEYS, as the backends upload them)."""
        return dict(zip(PROMPT_KEYS, prompt_indices(slot, pos, len(chunk)), strict=True))

    def _queue_prefill_chunk(self, chunk: np.ndarray, slot: int, pos: int, recorded: bool) -> Any:
        """Queue the forward of one prompt chunk at positions pos.. of ``slot``; returns its hidden rows. Where
        graphs are captured it is replayed from a recording, as decode steps are: a prompt then costs one
        enqueue per kernel instead of the ops' Python work, which is most of a short prompt's time on a GPU."""
        n = len(chunk)
        rows, signature = self._prompt_rows(chunk, pos, self.max_tokens, recorded)
        ops = self.rt.ops

        def queue_step() -> None:
            def attend(qkv: Any, layer: int, out: Any) -> None:
                rope, spec = self.layer_ropes[layer], self.layer_specs[layer]
                ops.attention_prefill(qkv, self.cache, layer, slot, pos, rope, spec, out)

            self._forward(rows, attend)

        key = None if signature is None else ("prefill", len(rows), signature)
        self._queue_recorded(key, {"ids": rows, **self._prompt_inputs(rows, slot, pos)}, queue_step)
        return self._rows("h", 0, n)

    def _all_logits(self, h: Any, n: int) -> np.ndarray:
        out = self.rt.scratch("all_logits", (n, self.config.vocab_size))
        self._project(h, out)
        return self.rt.to_numpy(out)

    @property
    def samples_on_device(self) -> bool:
        """Whether the backend implements the ``sample`` op itself, so decode(sampling=...) sends back B ids
        instead of B x vocab logits (else the draw happens on the host, from the logits)."""
        return not self.rt.ops.sources["sample"].startswith("perfx_core:")

    def decode(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
        *,
        argmax: bool = False,
        sampling: np.ndarray | None = None,
        prompt: tuple[Sequence[int], int, int] | None = None,
    ) -> np.ndarray:
        """One new token per sequence (``queue_decode``, then waiting for its rows)."""
        return self.queue_decode(tokens, slots, positions, argmax=argmax, sampling=sampling, prompt=prompt).result()

    def queue_decode(
        self,
        tokens: Sequence[int] | QueuedRows,
        slots: Sequence[int],
        positions: Sequence[int],
        *,
        argmax: bool = False,
        sampling: np.ndarray | None = None,
        prompt: tuple[Sequence[int], int, int] | None = None,
    ) -> QueuedRows:
        """Queue one decode step without waiting for it: on a device with its own queue (a GPU) the host is free
        until ``.result()``, which waits and returns what ``decode`` does. The next step reuses this one's
        buffers, so queueing it (or a prefill) first reads this step's rows.

        One new token per sequence: token b goes to ``slots[b]`` at ``positions[b]``. The rows are the (B, vocab)
        logits; with ``argmax`` the (B,) int32 index of each row's largest logit (first on ties); with
        ``sampling`` ((B, ENGINE_ROW) int32 rows of Sampler.engine_row) the (B,) ids the ``sample`` op draws. Both are
        picked on the device when the backend implements that op, else on the host from the logits.

        ``prompt`` = (ids, slot, start) also runs that chunk of a prompt into another slot in the same forward
        pass (a mixed step: the sequences decoding wait for one pass instead of a prefill and then a decode,
        and the weights are read once for both). One more row then comes back, last: the chunk's last token,
        picked like the others (``sampling`` has B + 1 rows).

        ``tokens`` may be the previous step's QueuedRows (one pick per sequence): its ids then go to this step
        on the device where the runtime can (a replayed step, ``Runtime.device_index_inputs``), so the device
        never waits for the host to read a token; else they are read first."""
        fed = tokens if isinstance(tokens, QueuedRows) else None
        if fed is not None and (fed.picks is None or prompt is not None):
            tokens, fed = fed.result(), None
        ids = self._check_ids(tokens) if fed is None else np.zeros(fed.rows, np.int32)  # fed: set below
        slots_arr = np.asarray(slots, dtype=np.int32)
        pos_arr = np.asarray(positions, dtype=np.int32)
        if not (len(ids) == len(slots_arr) == len(pos_arr)) or not 1 <= len(ids) <= self.n_slots:
            raise InvalidArgumentError(
                f"decode wants 1..{self.n_slots} tokens with one slot and position each; "
                f"got {len(ids)} tokens, {len(slots_arr)} slots, {len(pos_arr)} positions"
            )
        if len(set(slots_arr.tolist())) != len(slots_arr):
            raise InvalidArgumentError("decode got the same slot twice in one batch")
        for slot in slots_arr.tolist():
            self._check_slot(slot)
            self.slot_writes[slot] += 1
        if pos_arr.min() < 0 or pos_arr.max() >= self.max_seq_len:
            raise ContextLengthError(int(pos_arr.max()) + 1, 0, self.max_seq_len)
        n = len(ids)
        if prompt is not None:
            prompt_ids, prompt_slot, prompt_start = self._check_ids(prompt[0]), int(prompt[1]), int(prompt[2])
            self._check_slot(prompt_slot)
            self.slot_writes[prompt_slot] += 1
            if prompt_slot in slots_arr.tolist():
                raise InvalidArgumentError(f"decode: the prompt's slot {prompt_slot} is also decoding in this step")
            room = self.mixed_prompt_room(n)
            if not 1 <= len(prompt_ids) <= room:
                raise InvalidArgumentError(f"decode: a prompt chunk next to {n} decode rows takes 1..{room} tokens")
            if prompt_start < 0 or prompt_start + len(prompt_ids) > self.max_seq_len:
                raise ContextLengthError(prompt_start + len(prompt_ids), 0, self.max_seq_len)
        rows_out = n + (prompt is not None)
        if sampling is not None:
            sampling = np.ascontiguousarray(sampling, dtype=np.int32)
            if argmax or sampling.shape != (rows_out, ENGINE_ROW):
                raise InvalidArgumentError(
                    f"decode: sampling must be ({rows_out}, {ENGINE_ROW}) int32 rows, without argmax"
                )
        ops, rt = self.rt.ops, self.rt
        # Not while the ops are being profiled: that needs the calls.
        signature = rt.graph_signature(pos_arr) if ops.profile is None else None
        inputs = {"ids": ids, "slots": slots_arr, "positions": pos_arr}
        prompt_rows, rows, last = None, n, n - 1  # rows of the step; the last row picked
        if prompt is not None:
            prompt_rows, prompt_signature = self._prompt_rows(
                prompt_ids, prompt_start, room, signature is not None, MIXED_GRAPH_ROUNDING
            )
            rows, last = n + len(prompt_rows), n + len(prompt_ids) - 1
            # Each part's launches follow its own positions (the decode rows' attention partitions, the prompt's).
            signature = None if prompt_signature is None else (signature, prompt_signature)
            inputs["ids"] = np.concatenate([ids, prompt_rows])
            inputs.update(self._prompt_inputs(prompt_rows, prompt_slot, prompt_start))
            if sampling is not None:  # the prompt's row for each of its rows; the chunk's last real one is used
                sampling = np.concatenate([sampling[:n], np.repeat(sampling[n:], len(prompt_rows), axis=0)])
        if prompt is not None and "mixed_logits" not in self._buffers:
            self._buffers["mixed_logits"] = rt.empty((self.n_slots + MIXED_PROMPT_ROWS, self.config.vocab_size))
            self._buffers["mixed_argmax"] = rt.empty((self.n_slots + MIXED_PROMPT_ROWS,), np.int32)
        prefix = "" if prompt is None else "mixed_"
        logits = self._rows(prefix + "logits", 0, rows)
        pick = "argmax" if argmax else "sample" if sampling is not None else None
        on_device = pick is not None and not ops.sources[pick].startswith("perfx_core:")  # else from the logits
        result = rt.view(self._buffers[prefix + "argmax"], 0, (rows,)) if on_device else logits

        def queue_step() -> None:
            def attend(qkv: Any, layer: int, out: Any) -> None:
                if prompt_rows is None:
                    rope, spec = self.layer_ropes[layer], self.layer_specs[layer]
                    ops.attention_decode(qkv, self.cache, layer, slots_arr, pos_arr, rope, spec, out)
                else:  # rows n.. are the prompt chunk's
                    cache, rope, spec = self.cache, self.layer_ropes[layer], self.layer_specs[layer]
                    ops.attention_mixed(
                        qkv, cache, layer, slots_arr, pos_arr, prompt_slot, prompt_start, rope, spec, out
                    )

            self._project(self._forward(inputs["ids"], attend), logits)
            if on_device and pick == "argmax":
                ops.argmax(logits, result)
            elif on_device:
                ops.sample(logits, sampling, result)

        shape = n if prompt is None else ("mixed", n, len(prompt_rows))
        key = None if signature is None else (shape, signature, pick if on_device else None)
        if on_device and pick == "sample":
            inputs["sampling"] = sampling
        if fed is not None:
            if fed is self._unread and rt.device_index_inputs and key in self._graphs:
                inputs["ids"] = fed.picks  # copied on the device, after the previous step's kernels
            else:  # a step that records (or runs) its ops needs the ids on the host
                inputs["ids"] = self._check_ids(fed.result())
        self._queue_recorded(key, inputs, queue_step)
        # Rows 0..n-1, then the prompt chunk's last real token (only those cross to the host).
        picked = [rt.view(result, 0, (n, *result.shape[1:]))]
        if prompt is not None:
            picked.append(rt.view(result, last * math.prod(result.shape[1:]), (1, *result.shape[1:])))

        def finish(parts: list[np.ndarray]) -> np.ndarray:
            values = np.concatenate(parts)
            if pick is None or on_device:
                return values
            chosen = np.concatenate([np.arange(n), [last]]) if prompt is not None else np.arange(n)
            if pick == "argmax":
                return np.argmax(values, axis=1).astype(np.int32)
            return np.array([engine_draw(values[i], sampling[row]) for i, row in enumerate(chosen)], dtype=np.int32)

        def read_later() -> Callable[[], np.ndarray]:
            waits = [rt.read_later(part) for part in picked]
            return lambda: finish([wait() for wait in waits])

        self._unread = QueuedRows(
            lambda: finish([rt.to_numpy(part) for part in picked]),
            read_later,
            picked[0] if on_device and prompt is None else None,
        )
        return self._unread

    def mixed_prompt_room(self, decode_rows: int) -> int:
        """Prompt tokens a mixed step (``decode(..., prompt=...)``) takes next to ``decode_rows`` decode rows."""
        return max(0, min(MIXED_PROMPT_ROWS, self.max_tokens - decode_rows))

    def _queue_recorded(self, key: Any, inputs: dict[str, np.ndarray], queue_step: Callable[[], None]) -> None:
        """Queue a step: a runtime that captures graphs replays the step recorded under ``key`` with new index
        ``inputs`` (its ops' Python skipped), else the step runs and is recorded; ``key`` None just runs it."""
        rt = self.rt
        if self._unread is not None:  # its rows live in buffers this step overwrites
            unread, self._unread = self._unread, None
            unread.detach()
        graph = self._graphs.get(key) if key is not None else None
        if graph is not None:
            rt.replay(graph, inputs)
            return
        if key is None:
            queue_step()
            return
        rt.begin_capture(tuple(inputs))
        try:
            queue_step()
        finally:
            graph = rt.end_capture()
        if graph is not None:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))  # the oldest
            self._graphs[key] = graph
            self.recordings += 1

    def warm_up(self, mixed_steps: bool = False, mixed_chunk: int = 2 * MIXED_GRAPH_ROUNDING) -> None:
        """All of ``warm_up_steps`` at once."""
        for _ in self.warm_up_steps(mixed_steps, mixed_chunk):
            pass

    def warm_up_steps(self, mixed_steps: bool = False, mixed_chunk: int = 2 * MIXED_GRAPH_ROUNDING) -> Iterator[str]:
        """Run the kernel variants a server uses once, so compiling them (an OpenCL build takes ~0.3 s) and
        recording their graphs happen now, not in the middle of serving requests: prefills of a full chunk and
        of 2, 3, 5, 9 and 17 tokens (one per token-count class of the matmul kernels), then decode at every
        batch size up to 32 and at powers of two beyond, up to n_slots, at a position of each graph signature
        the context can reach, each picking its tokens the three ways a server asks for (logits back, argmax,
        sampling): every such triple is its own recorded step; with ``mixed_steps``, where steps are recorded,
        also mixed steps (decode rows + a prompt chunk of up to ``mixed_chunk`` tokens, at each padded size such
        a chunk can take) at each batch size and signature. The slots' cache contents are garbage afterwards,
        which is harmless: a sequence writes every position before it attends to it (and slot_writes tells the
        prefix cache). Yields after each step: "kernels" for the prefills and the decode steps at the first
        position (which build every kernel variant), then "record" for the rest, so that a server can answer
        once the kernels exist and record the rest while it is idle."""
        chunk = min(self.prefill_chunk, self.max_seq_len)
        for length in sorted({chunk, *(n for n in (2, 3, 5, 9, 17) if n <= chunk)}):  # each token-count class
            self.prefill([0] * length, slot=0)
            yield "kernels"
        batches = {*range(1, min(self.n_slots, 32) + 1), *(1 << p for p in range(self.n_slots.bit_length()))}
        batches = sorted(b for b in batches | {self.n_slots} if b <= self.n_slots)
        # One position per signature (backends round attention partition counts to powers of two or 1.5 times
        # them, so the bounds of those buckets meet every signature), as many as fit the step's share of the graph
        # store: half for decode steps, then what is left but an eighth for mixed steps. The prefills above stay
        # (the store drops its oldest recordings first), and an eighth is left for what the warm-up cannot foresee.
        positions: dict = {}
        bounds = {(1 << i) - 1 for i in range(self.max_seq_len.bit_length())}  # last positions of power-of-two
        bounds |= {3 * (1 << i) - 1 for i in range(self.max_seq_len.bit_length())}  # and 1.5x power-of-two buckets
        for p in sorted({0, self.max_seq_len - 1, *(b for b in bounds if b < self.max_seq_len)}):
            positions.setdefault(self.rt.graph_signature(np.array([p], dtype=np.int32)), p)
        sample_row = engine_params(1.0, 0.0, 0, 0)[None, :]

        def each_step(batches: list[int], graphs: int, prompt_rows: int = 0) -> Iterator[str]:
            """Decode at each batch size and pick, position by position, while the three picks' recordings fit
            within ``graphs``; with ``prompt_rows``, next to a new prompt's chunk in slot ``batch``."""
            first = min(positions.values())
            for position in sorted(positions.values()):
                for batch in batches:
                    if graphs < 3:
                        return
                    graphs -= 3
                    prompt = ([0] * prompt_rows, batch, 0) if prompt_rows else None
                    sampling = np.repeat(sample_row, batch + bool(prompt_rows), axis=0)
                    for pick in ({}, {"argmax": True}, {"sampling": sampling}):
                        self.decode([0] * batch, list(range(batch)), [position] * batch, prompt=prompt, **pick)
                    yield "kernels" if position == first and not prompt_rows else "record"

        yield from each_step(batches, max(3 * len(batches), MAX_GRAPHS // 2))  # at least one position
        if mixed_steps and None not in positions:  # (None: nothing is recorded here)
            # Mixed steps: a new prompt's chunk next to each batch size at each decode signature, at each padded size
            # (multiples of MIXED_GRAPH_ROUNDING) a chunk the scheduler cuts (at most mixed_chunk, prefill_chunk and
            # MIXED_PROMPT_ROWS tokens) can take, the sizes sharing the store's room equally.
            most = min(mixed_chunk, self.prefill_chunk, MIXED_PROMPT_ROWS, self.max_seq_len)
            sizes = range(MIXED_GRAPH_ROUNDING, most + MIXED_GRAPH_ROUNDING, MIXED_GRAPH_ROUNDING)
            room = MAX_GRAPHS - len(self._graphs) - MAX_GRAPHS // 8
            for rows in sizes:
                rows = min(rows, self.max_seq_len)
                fits = [b for b in batches if b < self.n_slots and self.mixed_prompt_room(b) >= rows]
                yield from each_step(fits, room // len(sizes), rows)

    def _check_ids(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1:
            raise InvalidArgumentError("token ids must be a flat sequence of integers")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise InvalidArgumentError(
                f"token ids must be in [0, {self.config.vocab_size}); got {ids.min()}..{ids.max()}"
            )
        return ids.astype(np.int32)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise InvalidArgumentError(f"slot {slot} is outside 0..{self.n_slots - 1}")

    def close(self) -> None:
        """Drop the device weights, cache and buffers, then close the runtime (its memory is freed now)."""
        self.layers = []
        self.cache = None
        self._buffers = {}
        self._graphs = {}
        self.embedding = self.output = self.norm = None
        self.rt.close()
