"""What the two tokenizer kinds share, read from the `tokenizer.ggml.*` metadata of a GGUF file.

The base class validates the metadata and does what SentencePiece (`tokenizer_spm`) and byte-level BPE
(`tokenizer_bpe`) vocabularies share: special-token splitting, BOS/EOS, and decoding around control tokens.
`perfx_core.tokenizer` picks the kind and builds the tokenizer; import from there.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from .config import show
from .errors import InvalidArgumentError, TokenizerError

# Names of tokens that end a turn in the common chat formats. They count as end-of-generation only when the
# vocabulary marks them as control tokens: a normal token that merely spells "<|endoftext|>" is text.
END_OF_TURN_NAMES = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values; the same numbering as SentencePiece piece types."""

    UNDEFINED = 0  # written by some converters; treated as NORMAL
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class Vocab:
    """The validated, model-independent part of the tokenizer metadata."""

    model: str  # tokenizer.ggml.model
    tokens: list[str]
    token_types: np.ndarray  # (n_tokens,) int32, TokenType values
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    eos_ids: frozenset[int]


class Tokenizer(ABC):
    """Text <-> token ids for one vocabulary.

    Special tokens: control and unknown tokens (e.g. `<|im_start|>`, `<s>`) are recognised in the text only
    with `encode(..., parse_special=True)`; otherwise their text is tokenized like any other text, as in
    llama.cpp. User-defined tokens are always recognised, as SentencePiece and llama.cpp do: they are pieces
    the model's authors added to be matched verbatim. Matching is longest-first.
    """

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self._tokens = vocab.tokens
        types = vocab.token_types
        self._control_ids = frozenset(
            np.flatnonzero((types == TokenType.CONTROL) | (types == TokenType.UNKNOWN)).tolist()
        )
        user_ids = np.flatnonzero(types == TokenType.USER_DEFINED).tolist()
        self._user_defined_ids = frozenset(user_ids)
        self._special_tokens = _first_id_per_text(vocab.tokens, sorted(self._control_ids | self._user_defined_ids))
        user_tokens = {t: i for t, i in _first_id_per_text(vocab.tokens, user_ids).items() if self._split_user_token(t)}
        self._split_all = _alternation(
            t for t, i in self._special_tokens.items() if i in self._control_ids or t in user_tokens
        )
        self._split_user = _alternation(user_tokens)

    # --- what subclasses provide -------------------------------------------------------------------------

    @abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of text that contains no special token (one fragment between special tokens)."""

    @abstractmethod
    def _decode_plain(self, ids: list[int], at_start: bool) -> str:
        """Text of a run of non-control ids; `at_start` is True when nothing was rendered before the run."""

    @abstractmethod
    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (control tokens: their text), for streaming decoders."""

    def _split_user_token(self, text: str) -> bool:
        """Whether the user-defined token `text` is matched here, in the raw text, rather than by the subword model."""
        return True

    # --- public API -------------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_special: bool = False,
        parse_special: bool = False,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids of `text`.

        add_special: prepend BOS / append EOS as the vocabulary asks (`add_bos`, `add_eos`).
        parse_special: turn the text of control tokens (e.g. "<|im_start|>") into their ids...
        literal_spans: ...except inside these sorted, disjoint (start, end) character ranges (a chat prompt's
            user text: a user who types "<|im_start|>" gets those characters, not the control token).
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}; decode bytes first")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self._vocab.bos_id)  # type: ignore[arg-type]  # add_bos implies a BOS id (validated)
        for fragment, special_id in self._split_special(text, parse_special, literal_spans):
            if special_id is not None:
                ids.append(special_id)
            elif fragment:
                ids.extend(self._encode_plain(fragment))
        if add_special and self._vocab.add_eos:
            ids.append(self._vocab.eos_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`. Control and unknown tokens are left out with `skip_special`, else rendered as their text.

        A leading space that the tokenizer itself added (SentencePiece's dummy prefix) is removed only at
        the start of the result, as Hugging Face and llama.cpp do.
        """
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            token_id = self._check_id(token_id)
            if token_id not in self._control_ids:
                run.append(token_id)
            elif not skip_special:
                if run:
                    parts.append(self._decode_plain(run, at_start=not parts))
                    run = []
                parts.append(self._tokens[token_id])
        if run:
            parts.append(self._decode_plain(run, at_start=not parts))
        return "".join(parts)

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token, without removing any prefix space; a partial UTF-8 byte renders as U+FFFD."""
        return self.token_to_bytes(self._check_id(token_id)).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, `eot_token_id`/`eom_token_id`, and control tokens named like
        `<|im_end|>`, `<|eot_id|>`, `<|end_of_text|>`, `<|endoftext|>` (see END_OF_TURN_NAMES)."""
        return self._vocab.eos_ids

    @property
    def pad_id(self) -> int | None:
        return self._vocab.pad_id

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text -> id of every token `encode(..., parse_special=True)` recognises."""
        return dict(self._special_tokens)

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(int(self._vocab.token_types[self._check_id(token_id)]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"

    # --- shared machinery --------------------------------------------------------------------------------

    def find_control_text(self, text: str) -> str | None:
        """The first control token's text spelled in ``text`` (what parse_special would turn into a token)."""
        match = self._split_all.search(text) if self._split_all is not None else None
        while match is not None and self._special_tokens[match.group()] not in self._control_ids:
            match = self._split_all.search(text, match.end())
        return match.group() if match else None

    def _split_special(
        self, text: str, parse_special: bool, literal_spans: Sequence[tuple[int, int]] = ()
    ) -> Iterator[tuple[str, int | None]]:
        """Yield (text, None) for plain fragments and (token text, id) for special tokens, in order. Inside
        ``literal_spans`` only user-defined tokens are recognised, as without parse_special."""
        pattern = self._split_all if parse_special else self._split_user
        if pattern is None:
            yield text, None
            return
        table = self._special_tokens
        spans = iter(literal_spans)
        span = next(spans, None)
        pos = 0
        for match in pattern.finditer(text):
            while span is not None and span[1] <= match.start():
                span = next(spans, None)
            in_span = span is not None and span[0] < match.end() and match.start() < span[1]
            if in_span and table[match.group()] not in self._user_defined_ids:
                continue  # plain text: it stays in the fragment that follows
            if match.start() > pos:
                yield text[pos : match.start()], None
            yield match.group(), table[match.group()]
            pos = match.end()
        if pos < len(text):
            yield text[pos:], None

    def _check_id(self, token_id: Any) -> int:
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise InvalidArgumentError(f"token ids must be integers, got {token_id!r}")
        token_id = int(token_id)
        if not 0 <= token_id < len(self._tokens):
            raise InvalidArgumentError(
                f"token id {token_id} is outside this vocabulary (0..{len(self._tokens) - 1}); "
                "were the ids made with another model's tokenizer?"
            )
        return token_id


def _first_id_per_text(tokens: Sequence[str], ids: Iterable[int]) -> dict[str, int]:
    """Text -> lowest id, skipping empty texts, which could never be matched."""
    table: dict[str, int] = {}
    for i in ids:
        if tokens[i] and tokens[i] not in table:
            table[tokens[i]] = i
    return table


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    # Longest first: regex alternation takes the first alternative that matches, so "<|im_start|>" must be
    # tried before any shorter special token that is a prefix of it.
    ordered = sorted(texts, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


# --- metadata validation ---------------------------------------------------------------------------------


def malformed(key: str, problem: str) -> TokenizerError:
    return TokenizerError(
        f"GGUF metadata '{key}' {problem}; the file's tokenizer is malformed, so re-convert the model "
        "with a current llama.cpp convert_hf_to_gguf.py"
    )


def string_list(metadata: Mapping[str, Any], key: str, *, required: bool = True) -> list[str] | None:
    """`metadata[key]` as a list of str; TokenizerError if absent (when required) or of another kind."""
    value = metadata.get(key)
    if value is None:
        if required:
            raise malformed(key, "is missing")
        return None
    if not isinstance(value, (list, tuple)):
        raise malformed(key, f"must be an array of strings, got {type(value).__name__}")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
    if bad is not None:  # an index: the bad entry itself may be None
        entry = value[bad]
        raise malformed(
            key, f"must be an array of strings, but entry {bad} is a {type(entry).__name__} ({show(entry)})"
        )
    return list(value)


def numeric_array(metadata: Mapping[str, Any], key: str, length: int, dtype: type) -> np.ndarray | None:
    """`metadata[key]` as a 1-D array of `length` numbers, or None if absent."""
    value = metadata.get(key)
    if value is None:
        return None
    integers = np.issubdtype(dtype, np.integer)
    kind = "integers" if integers else "numbers"
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged or mixed lists (JSON metadata)
        raise malformed(key, f"must be an array of {kind}, got {show(value)}") from None
    if array.ndim != 1 or array.dtype.kind not in ("iu" if integers else "iuf"):
        raise malformed(key, f"must be an array of {kind}, got {array.dtype} with shape {array.shape}")
    if len(array) != length:
        raise malformed(key, f"has {len(array)} entries but tokenizer.ggml.tokens has {length}")
    if integers and array.size:
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise malformed(key, f"holds values outside {np.dtype(dtype)} ({int(array.min())}..{int(array.max())})")
    return array.astype(dtype, copy=False)


def token_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    """`metadata[key]` as a token id in range, or None if absent."""
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise malformed(key, f"must be an integer token id, got {show(value)}")
    if not 0 <= int(value) < n_tokens:
        raise malformed(key, f"is {int(value)}, outside the vocabulary of {n_tokens} tokens")
    return int(value)


def flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and int(value) in (0, 1)):
        return bool(value)
    raise malformed(key, f"must be a boolean, got {show(value)}")


def read_vocab(metadata: Mapping[str, Any], add_bos_default: bool) -> Vocab:
    """Validate the metadata every vocabulary kind shares and collect it into a Vocab."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = string_list(metadata, "tokenizer.ggml.tokens")
    assert tokens is not None
    if not tokens:
        raise malformed("tokenizer.ggml.tokens", "is empty")
    n = len(tokens)
    types = numeric_array(metadata, "tokenizer.ggml.token_type", n, np.int32)
    if types is None:
        types = np.full(n, TokenType.NORMAL, dtype=np.int32)
    elif types.size and (types.min() < TokenType.UNDEFINED or types.max() > TokenType.BYTE):
        bad = int(types[(types < TokenType.UNDEFINED) | (types > TokenType.BYTE)][0])
        raise malformed("tokenizer.ggml.token_type", f"holds {bad}, which is not a token type (0..6)")

    ids = {
        name: token_id(metadata, f"tokenizer.ggml.{name}_token_id", n)
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    # A default only applies when there is a BOS to add; an explicit request without one is an error.
    add_bos = flag(metadata, "tokenizer.ggml.add_bos_token", add_bos_default and ids["bos"] is not None)
    add_eos = flag(metadata, "tokenizer.ggml.add_eos_token", False)
    if add_bos and ids["bos"] is None:
        raise malformed("tokenizer.ggml.bos_token_id", "is missing but tokenizer.ggml.add_bos_token asks for a BOS")
    if add_eos and ids["eos"] is None:
        raise malformed("tokenizer.ggml.eos_token_id", "is missing but tokenizer.ggml.add_eos_token asks for an EOS")

    eos_ids = {i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None}
    by_text = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_NAMES}
    eos_ids.update(i for i in by_text.values() if types[i] == TokenType.CONTROL)
    return Vocab(
        model=str(model),
        tokens=tokens,
        token_types=types,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        unk_id=ids["unknown"],
        pad_id=ids["padding"],
        add_bos=add_bos,
        add_eos=add_eos,
        eos_ids=frozenset(eos_ids),
    )
