"""The Python API: ``load`` a model onto a backend, then score, generate or chat with it."""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .chat_template import render_chat
from .config import LlamaConfig
from .default_model import resolve_model_path
from .errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from .generation import Generation, GenerationStats
from .model import LlamaModel
from .plugins import get_registry
from .sampling import SamplingParams
from .tokenizer import Tokenizer, tokenizer_from_metadata

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
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.last_stats: GenerationStats | None = None
        self._active: weakref.ref[Generation] | None = None

    def _end_active_generation(self) -> None:
        """KV slot 0 and the work buffers serve one request at a time: a new one ends the previous generation
        (it finishes as "cancelled") instead of silently corrupting it."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

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
        self._end_active_generation()
        return self.engine.prefill(_token_ids(token_ids), slot=0, start=0, all_logits=True)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        profile: bool = False,
        ignore_eos: bool = False,
    ) -> Generation:
        """Stream a completion: iterate the result for TokenEvent(id, text); ``.stats`` when done.

        A string prompt is tokenized with the model's BOS convention; a list of ids is used as is.
        """
        self._end_active_generation()
        ids = self.tokenizer.encode(prompt, add_special=True) if isinstance(prompt, str) else _token_ids(prompt)
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        generation = Generation(
            self.engine,
            self.tokenizer,
            ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=[stop] if isinstance(stop, str) else list(stop),
            profile=profile,
            ignore_eos=ignore_eos,
        )
        self.last_stats = generation.stats
        self._active = weakref.ref(generation)
        return generation

    def chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Generation:
        """Like generate, for a list of {'role', 'content'} messages rendered with the model's chat template."""
        return self.generate(self.chat_prompt_ids(messages), **kwargs)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        tok = self.tokenizer
        return render_chat(
            self.chat_template,
            messages,
            bos_token=tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else "",
            add_generation_prompt=add_generation_prompt,
        )

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode(self.render_chat(messages), add_special=False, parse_special=True)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    def close(self) -> None:
        self._end_active_generation()
        self.engine.close()


def load(
    path: str | os.PathLike[str] | None = None,
    backend: str = "numpy",
    device: int | str | None = None,
    *,
    context_length: int | None = None,
    n_slots: int = 1,
    prefill_chunk: int = 256,
    quantize: str | None = None,
) -> Model:
    """Load a model onto ``backend``/``device``. ``path=None`` uses $PERFX_MODEL or the bundled default.

    ``path`` is a GGUF file or a model directory (perfx format, Hugging Face float or AutoAWQ checkpoint).
    ``context_length`` bounds the KV cache (default: the model's, at most 4096 tokens).
    ``quantize="rtn"`` quantizes a Hugging Face float checkpoint to int4 while loading.
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
    try:
        config, weights, tokenizer, metadata = _read_model(model_path, quantize)
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
        )
    except BaseException:
        runtime.close()
        raise
    return Model(model_path, config, engine, tokenizer, metadata)


def _read_model(path: Path, quantize: str | None):
    """(config, host weights, tokenizer, metadata) of a GGUF file or a model directory."""
    if path.is_dir():
        from .formats import load_directory

        loaded = load_directory(path, quantize=quantize)
        return loaded.config, loaded.weights, loaded.tokenizer, loaded.metadata
    from .gguf_loader import load_llama_gguf  # deferred: the gguf library is slow to import

    config, weights, gguf = load_llama_gguf(path)
    return config, weights, tokenizer_from_metadata(gguf.metadata), gguf.metadata


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror or exc}") from exc


def _token_ids(tokens: Sequence[int]) -> list[int]:
    """Token ids as Python ints; anything else is the caller's mistake, said plainly."""
    try:
        return [operator.index(t) for t in tokens]
    except TypeError:
        raise InvalidArgumentError("token ids must be integers (or pass the prompt as a string)") from None
