"""Byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`), run by the Hugging Face `tokenizers` library.

GGUF keeps the vocabulary and merges but only a name for the pre-tokenizer (`tokenizer.ggml.pre`), so the
regular expressions that split text into words before BPE, and the normalizer some vocabularies apply first,
are looked up here by that name. They are the ones the original tokenizer.json files use (the `tokenizers`
library runs Oniguruma, which understands them as written, e.g. `(?i:...)`), listed in the same order as
llama.cpp applies them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .errors import TokenizerError
from .tokenizer_base import Tokenizer, TokenType, Vocab, read_vocab, string_list

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> regexes applied one after the other, each splitting the pieces the previous left.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # "default" marks a file whose converter did not recognise the pre-tokenizer, so the right split is
    # unknown; GPT-2's is the common ancestor of all of these.
    "default": (GPT2,),
    "gpt2": (GPT2,),
    "gpt-2": (GPT2,),
    "phi-2": (GPT2,),
    "mpt": (GPT2,),
    "olmo": (GPT2,),
    "llama3": (LLAMA3,),
    "llama-v3": (LLAMA3,),
    "llama-bpe": (LLAMA3,),
    "falcon3": (LLAMA3,),
    "dbrx": (LLAMA3,),
    "smaug-bpe": (LLAMA3,),
    "chatglm-bpe": (LLAMA3,),
    # StarCoder-family tokenizers put every digit in a word of its own, then use GPT-2's regex.
    "smollm": (r"\p{N}", GPT2),
    "starcoder": (r"\p{N}", GPT2),
    "refact": (r"\p{N}", GPT2),
    "command-r": (r"\p{N}", GPT2),
    "qwen2": (QWEN2,),
    "stablelm2": (QWEN2,),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
    "gpt-4o": (GPT4O,),
}

LLAMA3_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})

# Llama 3's tokenizer.json sets `ignore_merges`: a word that is itself in the vocabulary becomes that token
# even when the merges would not build it (tiktoken's rule, which llama.cpp follows for these names too).
IGNORE_MERGES = LLAMA3_NAMES

# Qwen2's tokenizer.json (Qwen2, 2.5 and 3) composes the text to NFC before splitting it, so "e" + U+0301 is
# encoded as "é" is; llama.cpp skips this, the original tokenizer does not.
NFC_NORMALIZED = frozenset({"qwen2"})

# Llama 3 expects a BOS when the file does not say (`tokenizer.ggml.add_bos_token` absent), as in llama.cpp;
# other byte-level BPE vocabularies do not.
ADD_BOS_BY_DEFAULT = LLAMA3_NAMES


class ByteLevelBPETokenizer(Tokenizer):
    """A GPT-2-style byte-level BPE vocabulary (Llama 3, SmolLM, Qwen2, ...)."""

    def __init__(self, vocab: Vocab, merges: list[tuple[str, str]], pre: str):
        super().__init__(vocab)
        from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        regexes = PRE_TOKENIZERS.get(pre)
        if regexes is None:
            warnings.warn(
                f"unknown pre-tokenizer {pre!r} (metadata 'tokenizer.ggml.pre'); using GPT-2's, so some texts may "
                f"tokenize differently from the original model. Known: {', '.join(sorted(PRE_TOKENIZERS))}",
                stacklevel=3,
            )
            regexes = PRE_TOKENIZERS["gpt2"]
        # On duplicate token texts the lowest id wins in the BPE model; decode maps every id itself.
        ids_by_text: dict[str, int] = {}
        for i, text in enumerate(vocab.tokens):
            ids_by_text.setdefault(text, i)
        try:
            model = models.BPE(vocab=ids_by_text, merges=merges, ignore_merges=pre in IGNORE_MERGES)
        except Exception as exc:  # tokenizers raises a bare Exception for merges that name unknown tokens
            raise TokenizerError(
                f"GGUF metadata 'tokenizer.ggml.merges' does not fit the vocabulary ({exc}); re-convert the model"
            ) from exc
        self._bpe = HFTokenizer(model)
        if pre in NFC_NORMALIZED:
            self._bpe.normalizer = normalizers.NFC()
        split = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        self._bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [*split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._bpe.decoder = decoders.ByteLevel()
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ByteLevelBPETokenizer:
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str):
            raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.pre' must be a string, got {pre!r}")
        vocab = read_vocab(metadata, add_bos_default=pre in ADD_BOS_BY_DEFAULT)
        raw_merges = string_list(metadata, "tokenizer.ggml.merges")
        assert raw_merges is not None
        return cls(vocab, parse_merges(raw_merges), pre)

    def _encode_plain(self, text: str) -> list[int]:
        return self._bpe.encode(text, add_special_tokens=False).ids

    def _decode_plain(self, ids: list[int], at_start: bool) -> str:
        # User-defined tokens are stored as plain text, not in the byte-to-character alphabet of the others.
        parts: list[str] = []
        run: list[str] = []
        for token_id in ids:
            if token_id in self._user_defined_ids:
                if run:
                    parts.append(self._bpe.decoder.decode(run))
                    run = []
                parts.append(self._tokens[token_id])
            else:
                run.append(self._tokens[token_id])
        if run:
            parts.append(self._bpe.decoder.decode(run))
        return "".join(parts)

    def token_to_bytes(self, token_id: int) -> bytes:
        text = self._tokens[token_id]
        if self._vocab.token_types[token_id] in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.BYTE):
            try:
                return bytes(self._byte_decoder[c] for c in text)
            except KeyError:
                pass  # not in the byte alphabet: some converters store such tokens as plain text
        return text.encode("utf-8")


def parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    """GGUF merges ("left right") as pairs. The split is at the first space after the first character, as in
    llama.cpp, so a left part may itself start with a space."""
    pairs = []
    for i, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        if cut < 0 or cut == len(merge) - 1:
            raise TokenizerError(
                f"GGUF metadata 'tokenizer.ggml.merges' entry {i} is {merge!r}, not two tokens separated by a "
                "space; the file's tokenizer is malformed, so re-convert the model"
            )
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the others
    (controls, space, ...) are moved to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
