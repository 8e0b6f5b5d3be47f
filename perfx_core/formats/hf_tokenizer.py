"""Tokenizers of model directories: Hugging Face ``tokenizer.json`` / ``tokenizer.model``, and GGUF metadata as JSON.

``HFJsonTokenizer`` adapts the ``tokenizers`` library to perfx's Tokenizer interface (special tokens, BOS/EOS
and control-token handling stay in perfx's base class). A lone ``tokenizer.model`` becomes GGUF-style
metadata, so perfx's own SentencePiece tokenizer runs it. perfx-format directories converted from a GGUF keep
that GGUF's ``tokenizer.*`` metadata in ``tokenizer.gguf.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..config import show
from ..errors import TokenizerError
from ..tokenizer import END_OF_TURN_NAMES, Tokenizer, TokenType, Vocab, tokenizer_from_metadata
from .hf import read_json

GGUF_TOKENIZER_FILE = "tokenizer.gguf.json"
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
SPACE = "\u2581"
_ARRAY_KINDS = "biuf"  # the element types of GGUF metadata arrays


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it encodes (byte-level BPE vocabularies)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFJsonTokenizer(Tokenizer):
    """A ``tokenizer.json`` (byte-level BPE or SentencePiece-style BPE/Unigram) behind perfx's interface."""

    def __init__(self, directory: Path, config: Mapping[str, Any] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = directory / "tokenizer.json"
        try:
            self._tk = HFTokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise TokenizerError(f"cannot read {path}: {e}; re-download the tokenizer") from None
        if not isinstance(spec, dict):
            raise TokenizerError(f"{path} must hold a JSON object; re-download the tokenizer")
        config = read_tokenizer_config(directory) if config is None else config
        n = self._tk.get_vocab_size(with_added_tokens=True)
        tokens = [""] * n
        for text, i in self._tk.get_vocab(with_added_tokens=True).items():
            if 0 <= i < n:
                tokens[i] = text
        types = np.full(n, TokenType.NORMAL, dtype=np.int32)
        for added in spec.get("added_tokens") or []:
            i = added.get("id")
            if isinstance(i, int) and 0 <= i < n:
                types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or spec.get("pre_tokenizer") or {})
        self._byte_values: dict[int, int] = {}
        if not self._byte_level:
            for i, t in enumerate(tokens):
                if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                    self._byte_values[i] = int(t[3:5], 16)
                    types[i] = TokenType.BYTE
        ids = {t: i for i, t in enumerate(tokens) if t}

        def special(key: str) -> int | None:
            text = _token_text(config.get(key))
            return ids.get(text) if text is not None else None

        bos, eos = special("bos_token"), special("eos_token")
        probe = self._tk.encode("a", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token", bos is not None and bool(probe) and probe[0] == bos)
        add_eos = config.get("add_eos_token", False)
        eos_ids = {i for i in (eos,) if i is not None}
        eos_ids.update(i for t, i in ids.items() if t in END_OF_TURN_NAMES and types[i] == TokenType.CONTROL)
        self._prefix_space = (
            not self._byte_level
            and "Prepend" in json.dumps(spec.get("normalizer") or {})
            or ("Metaspace" in json.dumps(spec.get("pre_tokenizer") or {}))
        )
        super().__init__(
            Vocab(
                model="hf-tokenizer.json",
                tokens=tokens,
                token_types=types,
                bos_id=bos,
                eos_id=eos,
                unk_id=special("unk_token"),
                pad_id=special("pad_token"),
                add_bos=add_bos and bos is not None,
                add_eos=add_eos and eos is not None,
                eos_ids=frozenset(eos_ids),
            )
        )

    def _encode_plain(self, text: str) -> list[int]:
        # Normalizer, pre-tokenizer and model, but not the library's added-token matching: the base class
        # decides which special tokens are recognised (parse_special), as for GGUF vocabularies.
        tk = self._tk
        if tk.normalizer is not None:
            text = tk.normalizer.normalize_str(text)
        pieces = tk.pre_tokenizer.pre_tokenize_str(text) if tk.pre_tokenizer is not None else [(text, (0, len(text)))]
        return [t.id for piece, _ in pieces for t in tk.model.tokenize(piece)]

    def _decode_plain(self, ids: list[int], at_start: bool) -> str:
        text = b"".join(self.token_to_bytes(i) for i in ids).decode("utf-8", errors="replace")
        if at_start and self._prefix_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_to_bytes(self, token_id: int) -> bytes:
        token = self._tokens[token_id]
        if token_id in self._control_ids:
            return token.encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")
        if token_id in self._byte_values:
            return bytes([self._byte_values[token_id]])
        return token.replace(SPACE, " ").encode("utf-8")


def metadata_from_sentencepiece(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF-style ``tokenizer.ggml.*`` metadata of a SentencePiece ``tokenizer.model``, in the form llama.cpp's
    converter writes, with every piece type the model has (user-defined ones too) and its dummy-prefix setting."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot read {path}: {e}; re-download the tokenizer") from None
    # The proto has what the processor's API does not expose: user-defined pieces, which SentencePiece emits
    # whole, and whether it adds a dummy-prefix space (Gemma's does not).
    proto = sentencepiece_model_pb2.ModelProto.FromString(sp.serialized_model_proto())
    n = sp.GetPieceSize()
    types = np.array([p.type for p in proto.pieces], np.int32)  # the same numbering as TokenType
    # User-defined pieces as llama.cpp's converter writes them: with real spaces, not "▁".
    tokens = [p.piece.replace(SPACE, " ") if p.type == TokenType.USER_DEFINED else p.piece for p in proto.pieces]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array([p.score for p in proto.pieces], np.float32),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": bool(proto.normalizer_spec.add_dummy_prefix),
    }
    for key, value in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unknown", sp.unk_id()), ("padding", sp.pad_id())):
        if 0 <= value < n:
            meta[f"tokenizer.ggml.{key}_token_id"] = value
    if "add_bos_token" in config:
        meta["tokenizer.ggml.add_bos_token"] = bool(config["add_bos_token"])
    return meta


def save_gguf_tokenizer(metadata: Mapping[str, Any], path: Path) -> None:
    """Write a GGUF's ``tokenizer.*`` metadata as JSON (arrays tagged with their dtype, so they come back exact)."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, np.ndarray):
            out[key] = {"__ndarray__": value.dtype.str, "data": value.tolist()}
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    path.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")


def load_gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    raw = read_json(path, TokenizerError)
    return {k: _tagged_array(path, k, v) if isinstance(v, dict) and "__ndarray__" in v else v for k, v in raw.items()}


def _tagged_array(path: Path, key: str, value: dict[str, Any]) -> np.ndarray:
    """An array saved by save_gguf_tokenizer: numbers only, one dimension, as GGUF metadata arrays are."""
    tag, data = value["__ndarray__"], value.get("data")
    try:
        dtype = np.dtype(tag) if isinstance(tag, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in _ARRAY_KINDS:
        raise TokenizerError(f"{path}: {key!r} has array type {show(tag)}, not a numeric dtype; re-create the model")
    if not isinstance(data, list) or not all(isinstance(x, (int, float)) for x in data):
        raise TokenizerError(f"{path}: {key!r} must hold a flat list of numbers, got {show(data)}; re-create the model")
    try:
        return np.array(data, dtype=dtype)
    except (OverflowError, ValueError):
        raise TokenizerError(f"{path}: {key!r} holds numbers outside {dtype}; re-create the model") from None


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` ({} without one), with the keys perfx reads checked."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config = read_json(path, TokenizerError)
    for key in ("add_bos_token", "add_eos_token"):
        if config.get(key) is None:
            config.pop(key, None)
        elif not isinstance(config[key], bool):
            raise TokenizerError(
                f"{path}: {key!r} is {show(config[key])} ({type(config[key]).__name__}), expected true or false; "
                "fix the file or re-download the tokenizer"
            )
    template = config.get("chat_template")
    if template is not None and not isinstance(template, (str, list)):
        raise TokenizerError(
            f"{path}: 'chat_template' is {show(template)}, expected a Jinja template string; fix the file"
        )
    return config


def tokenizer_for_directory(directory: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of a model directory and metadata for the Model (chat template), whichever form it has."""
    config = read_tokenizer_config(directory)
    if (directory / GGUF_TOKENIZER_FILE).is_file():
        path = directory / GGUF_TOKENIZER_FILE
        meta = load_gguf_tokenizer_metadata(path)
        try:
            return tokenizer_from_metadata(meta), meta
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None  # the metadata checks name the key, not the file
    template = config.get("chat_template")
    extra = {"tokenizer.chat_template": template} if isinstance(template, str) else {}
    if (directory / "tokenizer.json").is_file():
        return HFJsonTokenizer(directory, config), extra
    if (directory / "tokenizer.model").is_file():
        meta = metadata_from_sentencepiece(directory / "tokenizer.model", config)
        return tokenizer_from_metadata(meta), {**meta, **extra}
    raise TokenizerError(
        f"{directory} has no tokenizer.json, tokenizer.model or {GGUF_TOKENIZER_FILE}; add the tokenizer files"
    )
