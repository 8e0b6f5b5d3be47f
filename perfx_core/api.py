"""The Python API: ``load`` a model onto a backend, then score, generate or chat with it."""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import defaults, progress
from .architectures import family_named
from .chat_template import message_spans, render_chat, template_takes_tools
from .config import LlamaConfig, LlamaWeights
from .default_model import resolve_model_path
from .errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from .generation import Generation, GenerationStats
from .grammar import Grammar, closed_objects, json_schema_grammar, response_format_grammar, response_format_schema
from .model import LlamaModel
from .plugins import get_registry
from .pooling import embedding_of
from .sampling import SamplingParams
from .slots import SlotPool
from .tokenizer import Tokenizer, tokenizer_from_metadata
from .tools import ToolChoice, conversation_for_template
from .tools import tool_choice as tool_choice_of
from .weights import take_rows

DEFAULT_CONTEXT = 4096  # KV cache length when the caller does not ask: bounded memory for long-context models
GGUF_MAGIC = b"GGUF"


class Model:
    """A loaded model: tokenizer, config, the backend runtime it lives on, and the generation entry points."""

    def __init__(self, path: Path, config: LlamaConfig, model: LlamaModel, tokenizer: Tokenizer, metadata: dict):
        self.path = path
        self.config = config
        self.engine = model
        self.tokenizer = tokenizer
        self.metadata = metadata
        # The file's template, else its family's format (None: ChatML, with a warning, in render_chat).
        self.chat_template: str | None = (
            metadata.get("tokenizer.chat_template") or family_named(config.arch).chat_template
        )
        self.last_stats: GenerationStats | None = None
        # Each generation holds a KV slot of its own and steps under one lock (perfx_core.slots): with n_slots > 1
        # that many generations can run from different threads; a new one from the same thread when every slot
        # is held ends that thread's previous one ("cancelled").
        self._slots = SlotPool(model.n_slots, model.slot_writes)

    @property
    def runtime(self):
        return self.engine.rt

    @property
    def backend(self) -> str:
        return self.engine.rt.backend_name

    @property
    def context_length(self) -> int:
        return self.engine.max_seq_len

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits, float32 (len(token_ids), vocab): row i predicts token i + 1."""
        ids = _token_ids(token_ids)
        with self._slots.lock:
            slot, _ = self._slots.take(ids, reuse=False)  # every row's logits are wanted: nothing is skipped
            logits = self.engine.prefill(ids, slot=slot, start=0, all_logits=True)
            self._slots.prefixes.remember(slot, ids)
            return logits

    def embed(self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]]) -> np.ndarray:
        """Embeddings (perfx_core.pooling: the unit-length mean of the final-normed hidden states): a string or
        a list of token ids gives one (dim,) float32 vector, a list of those a (len(inputs), dim) array. Strings
        are tokenized with the model's BOS convention, as ``generate`` does."""
        single = isinstance(inputs, str) or (
            isinstance(inputs, Sequence) and bool(inputs) and not isinstance(inputs[0], (str, Sequence))
        )
        items = [inputs] if single else list(inputs)
        if not items:
            raise InvalidArgumentError("embed needs at least one input")
        ids = [self._input_ids(item) for item in items]
        vectors = []
        for item_ids in ids:
            with self._slots.lock:  # one input at a time: other threads' generations step in between
                slot, _ = self._slots.take(item_ids, reuse=False)  # every row is pooled: nothing is skipped
                hidden = self.engine.prefill_hidden(item_ids, slot=slot, start=0)
                self._slots.prefixes.remember(slot, item_ids)
            vectors.append(embedding_of(hidden))
        return vectors[0] if single else np.stack(vectors)

    def _input_ids(self, item: str | Sequence[int]) -> list[int]:
        ids = self.tokenizer.encode(item, add_special=True) if isinstance(item, str) else _token_ids(item)
        if not ids:
            raise InvalidArgumentError("cannot embed an empty input: give it at least one token")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = defaults.MAX_TOKENS,
        temperature: float = defaults.TEMPERATURE,
        top_k: int = defaults.TOP_K,
        top_p: float = defaults.TOP_P,
        min_p: float = defaults.MIN_P,
        repetition_penalty: float = defaults.REPETITION_PENALTY,
        seed: int | None = None,
        stop: Sequence[str] = (),
        profile: bool = False,
        ignore_eos: bool = False,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
        response_format: Mapping[str, Any] | None = None,
        json_schema: Mapping[str, Any] | type | None = None,
        grammar: Grammar | None = None,
    ) -> Generation:
        """Stream a completion: iterate the result for TokenEvent(id, text); ``.stats`` when done.

        A string prompt is tokenized with the model's BOS convention; a list of ids is used as is.
        ``stop_token_ids`` end the generation like end-of-sequence tokens (which ``min_tokens`` holds off);
        ``include_stop`` keeps the stop string that ended it in the text.
        Structured output (one of): ``response_format`` in OpenAI's shapes (``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"schema": {...}}}``), ``json_schema`` (a JSON schema, or a class
        with ``model_json_schema()`` such as a pydantic model), or a ``grammar`` from perfx_core.grammar (e.g.
        ``lark_grammar``). The text then matches it, at any temperature (unless max_tokens cuts it short).
        """
        ids = self.tokenizer.encode(prompt, add_special=True) if isinstance(prompt, str) else _token_ids(prompt)
        grammar = self._output_grammar(response_format, json_schema, grammar)
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            logit_bias=_logit_bias(logit_bias, self.config.vocab_size),
            min_tokens=min_tokens,
        )
        stops = [stop] if isinstance(stop, str) else list(stop)
        with self._slots.lock:
            generation = Generation(
                self.engine,
                self.tokenizer,
                ids,
                max_tokens=max_tokens,
                sampling=sampling,
                stop=stops,
                profile=profile,
                ignore_eos=ignore_eos,
                stop_token_ids=_token_ids(stop_token_ids),
                include_stop=include_stop,
                lock=self._slots.lock,
                on_end=self._slots.release,
                constraint=grammar.constraint() if grammar is not None else None,
            )
            # Only once the arguments are known good: taking a slot may end this thread's previous generation.
            generation.slot, generation.cached = self._slots.take(generation.prompt_ids)
            self._slots.hold(generation.slot, generation)
        self.last_stats = generation.stats
        return generation

    def _output_grammar(
        self, response_format: Mapping[str, Any] | None, json_schema: Mapping[str, Any] | type | None, grammar: Any
    ) -> Grammar | None:
        if sum(x is not None for x in (response_format, json_schema, grammar)) > 1:
            raise InvalidArgumentError("give one of response_format, json_schema and grammar")
        if grammar is not None and not isinstance(grammar, Grammar):
            raise InvalidArgumentError("grammar must be a perfx_core.grammar.Grammar (e.g. from lark_grammar)")
        if response_format is not None:
            return response_format_grammar(response_format, self.tokenizer)
        if json_schema is not None:
            return json_schema_grammar(_schema_of(json_schema), self.tokenizer)
        return grammar

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Generation:
        """Like generate, for a list of {'role', 'content'} messages rendered with the model's chat template.

        ``tools`` (OpenAI's function tools), ``tool_choice`` ("auto" by default, "none", "required" or
        {"type": "function", "function": {"name": ...}}) and ``parallel_tool_calls`` offer functions to call
        (perfx_core.tools); ``perfx_core.tools.parse_tool_calls(generation.text, tools)`` reads the calls back.
        Messages may hold earlier calls (an assistant's ``tool_calls``) and their results (role ``tool``).
        """
        choice = tool_choice_of(tools, tool_choice, parallel_tool_calls)
        if choice is not None:
            content = kwargs.pop("response_format", None), kwargs.pop("json_schema", None)
            if kwargs.get("grammar") is not None:
                raise InvalidArgumentError("grammar cannot be combined with tools")
            schema = response_format_schema(content[0]) if content[0] is not None else None
            schema = _schema_of(content[1]) if content[1] is not None else schema
            kwargs["grammar"] = choice.grammar(self.tokenizer, schema)
        return self.generate(self.chat_prompt_ids(messages, tools=choice), **kwargs)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        cancelled: Callable[[], bool] | None = None,
        tools: ToolChoice | None = None,
    ) -> str:
        """The conversation as the chat template renders it; with ``tools`` offered (perfx_core.tools) they go
        to the template's ``tools`` variable when it has one, else into a system message."""
        messages, template_tools = conversation_for_template(
            messages, tools, native=template_takes_tools(self.chat_template)
        )
        return self._render(messages, add_generation_prompt, cancelled, template_tools)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        cancelled: Callable[[], bool] | None,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        tok = self.tokenizer
        return render_chat(
            self.chat_template,
            messages,
            bos_token=tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else "",
            add_generation_prompt=add_generation_prompt,
            cancelled=cancelled,
            tools=tools,
        )

    def chat_prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        cancelled: Callable[[], bool] | None = None,
        tools: ToolChoice | None = None,
    ) -> list[int]:
        """The token ids of the rendered conversation. Control tokens are parsed in the template's own text
        only: a message that spells one ("<|im_start|>") keeps it as plain text, so no message can open a turn."""
        tok = self.tokenizer
        messages, template_tools = conversation_for_template(
            messages, tools, native=template_takes_tools(self.chat_template)
        )
        text = self._render(messages, True, cancelled, template_tools)
        spans = message_spans(text, [m.get("content") for m in messages], tok.find_control_text)
        ids = tok.encode(text, add_special=False, parse_special=True, literal_spans=spans)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    def close(self) -> None:
        with self._slots.lock:
            self._slots.close_all()
            self.engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(
    path: str | os.PathLike[str] | None = None,
    backend: str = "numpy",
    device: int | str | None = None,
    *,
    context_length: int | None = None,
    n_slots: int = 1,
    prefill_chunk: int | None = None,
    quantize: str | None = None,
    kv_dtype: str | None = None,
) -> Model:
    """Load a model onto ``backend``/``device``. ``path=None`` uses $PERFX_MODEL or the bundled default.

    ``path`` is a GGUF file or a model directory (perfx format, Hugging Face float or AutoAWQ checkpoint).
    ``context_length`` bounds the KV cache (default: the model's, at most 4096 tokens).
    ``quantize="rtn"`` quantizes a Hugging Face float checkpoint to int4 while loading.
    ``kv_dtype`` ("float32" or "float16") is the KV cache's; None lets the backend choose (float16 on OpenCL GPUs).
    ``prefill_chunk``: prompt tokens per forward pass; None lets the backend choose (512 on desktop GPUs, else 256).
    """
    model_path = resolve_model_path(path)
    if context_length is not None and (not isinstance(context_length, int) or context_length < 1):
        raise InvalidArgumentError(f"context_length must be a positive integer; got {context_length!r}")
    if n_slots < 1:
        raise InvalidArgumentError(f"n_slots must be at least 1; got {n_slots!r}")
    if not model_path.is_dir():
        if _magic(model_path) != GGUF_MAGIC:
            raise ModelFormatError(
                f"{model_path} is not a GGUF file (no 'GGUF' magic); perfx reads GGUF model files and model directories"
            )
        if quantize is not None:
            raise InvalidArgumentError("quantize= applies to Hugging Face directories; a GGUF file loads as stored")
    # Open the device first: a wrong backend or device fails before the slow part.
    runtime = get_registry().open_runtime(backend, device)
    started = progress.begin(f"loading {model_path.name} on {backend} / {runtime.device.name}")
    try:
        config, weights, tokenizer, metadata = _read_model(
            model_path, quantize, runtime.block_formats, runtime.weight_formats
        )
        if context_length is not None and context_length > config.context_length:
            raise InvalidArgumentError(
                f"context_length {context_length} exceeds the {config.context_length} tokens this model was trained for"
            )
        engine = LlamaModel(
            config,
            weights,
            runtime,
            n_slots=n_slots,
            max_seq_len=min(context_length or DEFAULT_CONTEXT, config.context_length),
            prefill_chunk=prefill_chunk,
            kv_dtype=kv_dtype,
        )
    except BaseException:
        runtime.close()
        raise
    progress.end(f"loaded {model_path.name}", started)
    return Model(model_path, config, engine, tokenizer, metadata)


def _read_model(
    path: Path,
    quantize: str | None,
    block_formats: frozenset[str] = frozenset(),
    weight_formats: frozenset[str] | None = None,
):
    """(config, host weights, tokenizer, metadata) of a GGUF file or a model directory; a GGUF's matrices in
    ``block_formats`` stay as the file's blocks, and its Q5/Q6_K ones take ``weight_formats`` into account."""
    if path.is_dir():
        from .formats import load_directory

        loaded = load_directory(path, quantize=quantize)
        config, weights = _drop_padded_vocab(loaded.config, loaded.weights, loaded.tokenizer.vocab_size)
        return config, weights, loaded.tokenizer, loaded.metadata
    from .gguf_loader import load_llama_gguf  # deferred: the gguf library is slow to import

    config, weights, gguf = load_llama_gguf(path, keep_blocks=block_formats, weight_formats=weight_formats)
    return config, weights, tokenizer_from_metadata(gguf.metadata), gguf.metadata


def _drop_padded_vocab(config: LlamaConfig, weights: LlamaWeights, n_tokens: int) -> tuple[LlamaConfig, LlamaWeights]:
    """Hugging Face checkpoints often pad the embedding beyond the tokenizer (to a multiple of 64, say). Ids past
    the tokenizer can never be input, and must never be sampled: the model keeps the tokenizer's rows only."""
    if n_tokens > config.vocab_size:
        raise ModelFormatError(
            f"the tokenizer has {n_tokens} tokens but the embedding has only {config.vocab_size} rows; the tokenizer "
            "and the model disagree, so check that both files come from the same checkpoint"
        )
    if n_tokens == config.vocab_size:
        return config, weights
    rows = np.arange(n_tokens)
    embedding = take_rows(weights.token_embedding, rows)
    output = embedding if weights.output is weights.token_embedding else take_rows(weights.output, rows)
    weights.token_embedding, weights.output = embedding, output
    weights.notes.append(f"the embedding's {config.vocab_size - n_tokens} padding rows past the tokenizer are dropped")
    return dataclasses.replace(config, vocab_size=n_tokens), weights


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror or exc}") from exc


def _logit_bias(bias: Mapping[int, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if not isinstance(bias, Mapping):
        raise InvalidArgumentError("logit_bias must be a mapping of token id to bias")
    ids = _token_ids(list(bias))
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidArgumentError(f"logit_bias token ids must be in [0, {vocab_size})")
    return tuple(zip(ids, bias.values(), strict=True))


def _schema_of(schema: Mapping[str, Any] | type) -> Mapping[str, Any]:
    """A JSON schema, given as one or as a class that makes one (pydantic's ``model_json_schema``, with its objects
    closed to other keys, as the openai SDK's ``parse()`` sends them)."""
    make = getattr(schema, "model_json_schema", None)
    if callable(make):
        return closed_objects(make())
    if not isinstance(schema, Mapping):
        raise InvalidArgumentError("json_schema must be a JSON schema (a dict) or a pydantic model class")
    return schema


def _token_ids(tokens: Sequence[int]) -> list[int]:
    """Token ids as Python ints; anything else is the caller's mistake, said plainly."""
    try:
        return [operator.index(t) for t in tokens]
    except TypeError:
        raise InvalidArgumentError("token ids must be integers (or pass the prompt as a string)") from None
