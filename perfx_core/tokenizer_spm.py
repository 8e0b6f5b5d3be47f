"""SentencePiece tokenizers (`tokenizer.ggml.model = llama`), run by the `sentencepiece` library.

GGUF keeps a SentencePiece model's pieces, scores and piece types but not the model file itself, so we
rebuild its ModelProto: the BPE algorithm, an identity normalizer (Llama's original model has no NFKC
rules), spaces escaped as "▁", a dummy-prefix space when `tokenizer.ggml.add_space_prefix` says so, and byte
fallback when the vocabulary has byte pieces. llama.cpp's converter writes user-defined pieces with real spaces
(Gemma's runs of spaces are "  ", not "▁▁"); the ModelProto gets them back in SentencePiece's spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from .errors import TokenizerError
from .tokenizer_base import Tokenizer, TokenType, Vocab, flag, numeric_array, read_vocab

SPACE = "\u2581"  # "▁": SentencePiece's escaped space


class SentencePieceTokenizer(Tokenizer):
    """A Llama/Llama-2-style SentencePiece BPE vocabulary."""

    def __init__(self, vocab: Vocab, scores: np.ndarray, add_space_prefix: bool):
        super().__init__(vocab)
        from sentencepiece import SentencePieceProcessor  # deferred: keeps `import perfx_core` light

        self._add_space_prefix = add_space_prefix
        proto = build_model_proto(vocab, scores, add_space_prefix)
        try:
            self._sp = SentencePieceProcessor(model_proto=proto.SerializeToString())
        except (RuntimeError, OSError) as exc:
            raise TokenizerError(
                f"sentencepiece rejected the vocabulary rebuilt from GGUF metadata ({exc}); "
                "the file's tokenizer.ggml.tokens / token_type are inconsistent, so re-convert the model"
            ) from exc
        self._byte_values = {
            i: int(vocab.tokens[i][3:5], 16) for i in np.flatnonzero(vocab.token_types == TokenType.BYTE).tolist()
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> SentencePieceTokenizer:
        vocab = read_vocab(metadata, add_bos_default=True)  # Llama SPM models were trained with BOS
        scores = numeric_array(metadata, "tokenizer.ggml.scores", len(vocab.tokens), np.float32)
        if scores is None:
            raise TokenizerError(
                "GGUF metadata 'tokenizer.ggml.scores' is missing; a SentencePiece vocabulary needs the piece "
                "scores to choose merges, so re-convert the model with its tokenizer.model"
            )
        vocab = _with_unknown_piece(vocab)
        return cls(vocab, scores, flag(metadata, "tokenizer.ggml.add_space_prefix", True))

    def _split_user_token(self, text: str) -> bool:
        # SentencePiece matches user-defined pieces in the escaped text, where a typed "▁" is a space too
        # ("▁ " is the piece "  "): pieces with a space are left to it, which a raw-text match would miss.
        return " " not in text

    def _encode_plain(self, text: str) -> list[int]:
        # Each fragment gets its own dummy prefix, so text after a special token starts with "▁" as in
        # llama.cpp (and as when each chat turn is encoded on its own).
        return self._sp.encode(text)

    def _decode_plain(self, ids: list[int], at_start: bool) -> str:
        text = self._sp.decode(ids)
        # sentencepiece drops the dummy-prefix space at the start of every call; it belongs only at the
        # start of the whole text, so put it back when this run follows rendered text.
        if not at_start and self._add_space_prefix and self._sp.id_to_piece(ids[0]).startswith(SPACE):
            text = " " + text
        return text

    def token_to_bytes(self, token_id: int) -> bytes:
        byte = self._byte_values.get(token_id)
        if byte is not None:
            return bytes([byte])
        return self._tokens[token_id].replace(SPACE, " ").encode("utf-8")


def build_model_proto(vocab: Vocab, scores: np.ndarray, add_space_prefix: bool):
    """A SentencePiece ModelProto equivalent to the one the GGUF vocabulary was converted from."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    types = vocab.token_types
    pieces = sentencepiece_pieces(vocab)
    proto = spm.ModelProto()
    for piece, score, kind in zip(pieces, scores.tolist(), types.tolist(), strict=True):
        proto.pieces.add(piece=piece, score=score, type=kind or TokenType.NORMAL)

    trainer = proto.trainer_spec
    trainer.model_type = spm.TrainerSpec.BPE
    trainer.vocab_size = len(vocab.tokens)
    trainer.byte_fallback = bool((types == TokenType.BYTE).any())
    # sentencepiece reads these only for its own BOS/EOS helpers, which we do not use; set them so the
    # proto describes the vocabulary truthfully.
    unk_id = int(np.flatnonzero(types == TokenType.UNKNOWN)[0])
    for name, token_id in (("unk", unk_id), ("bos", vocab.bos_id), ("eos", vocab.eos_id), ("pad", vocab.pad_id)):
        setattr(trainer, f"{name}_id", -1 if token_id is None else token_id)
        if token_id is not None:
            setattr(trainer, f"{name}_piece", vocab.tokens[token_id])

    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = add_space_prefix
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return proto


def _with_unknown_piece(vocab: Vocab) -> Vocab:
    """The vocabulary with exactly one piece of type unknown, which sentencepiece requires."""
    unknown = np.flatnonzero(vocab.token_types == TokenType.UNKNOWN)
    if len(unknown) == 1:
        return vocab
    if len(unknown) > 1:
        raise TokenizerError(
            f"GGUF metadata 'tokenizer.ggml.token_type' marks {len(unknown)} tokens as unknown "
            f"(ids {unknown[:5].tolist()}); a SentencePiece vocabulary has exactly one, so re-convert the model"
        )
    if vocab.unk_id is None:
        raise TokenizerError(
            "the SentencePiece vocabulary has no unknown token (no token of type 2 and no "
            "'tokenizer.ggml.unknown_token_id'); re-convert the model with its tokenizer.model"
        )
    # Some converters give only the id: mark that piece as the unknown one (on a copy: the array may be
    # the caller's metadata).
    types = vocab.token_types.copy()
    types[vocab.unk_id] = TokenType.UNKNOWN
    return replace(vocab, token_types=types)


def sentencepiece_pieces(vocab: Vocab) -> list[str]:
    """The pieces as SentencePiece spells them: user-defined ones with their spaces escaped again. Raises
    TokenizerError for what sentencepiece would reject with a less helpful message."""
    pieces = list(vocab.tokens)
    for i in np.flatnonzero(vocab.token_types == TokenType.USER_DEFINED).tolist():
        pieces[i] = pieces[i].replace(" ", SPACE)
    seen: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if not piece:
            raise TokenizerError(f"GGUF token {i} is an empty string; a SentencePiece piece cannot be empty")
        if piece in seen:
            raise TokenizerError(
                f"GGUF tokens {seen[piece]} and {i} are both {piece!r}; SentencePiece pieces must be unique, "
                "so re-convert the model"
            )
        seen[piece] = i
    for i in np.flatnonzero(vocab.token_types == TokenType.BYTE).tolist():
        piece = vocab.tokens[i]
        if len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
            raise TokenizerError(f"GGUF token {i} has type byte but is {piece!r}, not of the form '<0xAB>'")
        try:
            int(piece[3:5], 16)
        except ValueError:
            raise TokenizerError(f"GGUF token {i} has type byte but is {piece!r}, not of the form '<0xAB>'") from None
    return pieces
