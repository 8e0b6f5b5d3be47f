"""Test helper: small real tokenizers of the model families perfx runs, trained here with the `tokenizers` library.

``train_qwen2_tokenizer(dir)`` trains a byte-level BPE with Qwen2's own pipeline (NFC, the split regex of
transformers' Qwen2 tokenizer, byte-level) on a few KB of text and saves it as Qwen2/2.5/3 checkpoints ship it:
tokenizer.json + tokenizer_config.json with a ChatML chat template, the special tokens <|endoftext|>,
<|im_start|>, <|im_end|> after the learned vocabulary, and Qwen3's <think>/</think> as plain added tokens.
``write_qwen2_gguf(dir, path)`` writes its vocabulary-only GGUF as llama.cpp's convert_hf_to_gguf.py does
(_set_vocab_gpt2 and gguf.SpecialVocab). ``train_gemma_sentencepiece(path)`` trains a SentencePiece BPE model
with the options of Gemma's tokenizer.model (byte fallback, no dummy prefix, user-defined runs of spaces and
newlines, HTML tags, turn markers as control pieces).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from golden_text import GOLDEN_TEXT

import perfx_core

DATA = Path(perfx_core.__file__).parent / "data"
QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_PLAIN = ("<think>", "</think>")  # added tokens with special=false in Qwen3's tokenizer.json
# Lines in other scripts, so that merges inside multi-byte characters are learned too.
MULTILINGUAL = """\
Le café est très bon, n'est-ce pas ? Ça dépend du barista.
Der Bäcker öffnet um sechs Uhr; die Straße ist noch ruhig.
Привет! Как дела? Сегодня хорошая погода, и мы идём гулять.
今天天气很好，我们去公园散步吧。你好，世界！
こんにちは、世界。東京は今日も晴れです。
안녕하세요, 오늘 날씨가 좋네요.
مرحبا بالعالم، كيف حالك اليوم؟
नमस्ते, आप कैसे हैं? आज मौसम अच्छा है।
Emoji: 🦙🚀👍🏽 ✨ 🎉 — and code: def f(x): return x ** 2  # 3.14159, 1,000,000
"""
# Qwen-style ChatML: a default system turn when the conversation has none.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_text() -> list[str]:
    texts = [GOLDEN_TEXT, MULTILINGUAL, *(p.read_text(encoding="utf-8") for p in sorted(DATA.glob("*.txt")))]
    return [line for text in texts for line in text.splitlines(keepends=True)]


def train_gemma_sentencepiece(path: str | Path, vocab_size: int = 1000) -> Path:
    """A Gemma-style SentencePiece ``tokenizer.model`` at ``path``."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line.rstrip("\n") for line in training_text() if line.strip()]),
        model_writer=model, vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        control_symbols=["<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=["\n", "\n\n", *("\u2581" * n for n in range(2, 9)), "<b>", "</b>", "<td>"],
        minloglevel=2,
    )  # fmt: skip
    path = Path(path)
    path.write_bytes(model.getvalue())
    return path


def qwen2_split_regex() -> str:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


def train_qwen2_tokenizer(out: str | Path, vocab_size: int = 1024, instruct: bool = True) -> Path:
    """Train and save a Qwen2-style tokenizer in ``out``; returns ``out``. ``instruct`` makes <|im_end|> the EOS
    (Qwen's -Instruct checkpoints), else <|endoftext|> (base checkpoints)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen2_split_regex()), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(training_text(), trainer)
    # Added after training, so they follow the learned vocabulary as in Qwen's files.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_PLAIN])
    tk.save(str(out / "tokenizer.json"))

    added = {
        str(tk.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": t in QWEN2_SPECIAL,
        }
        for t in (*QWEN2_SPECIAL, *QWEN3_PLAIN)
    }  # fmt: skip
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": QWEN_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>" if instruct else "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return out


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's does_token_look_special, for the tokens these vocabularies hold
    return token.startswith("<|") and token.endswith("|>")


def write_qwen2_gguf(tokenizer_dir: str | Path, path: str | Path, arch: str = "qwen2", pad_to: int = 64) -> Path:
    """A vocabulary-only GGUF of the tokenizer in ``tokenizer_dir``, as llama.cpp's converter writes it: the
    vocabulary padded with [PAD<i>] tokens to a multiple of ``pad_to`` (the embedding's rows), added tokens as
    control (special, or spelled <|...|>) or user-defined, BOS from config.json's <|endoftext|>, EOS and padding
    from tokenizer_config.json, and no BOS added."""
    tokenizer_dir, path = Path(tokenizer_dir), Path(path)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec["added_tokens"]}
    by_id.update((i, a["content"]) for i, a in added.items())
    n = -(-len(by_id) // pad_to) * pad_to
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            special = added[i]["special"] or _looks_special(by_id[i])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-qwen2-vocab")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids["<|endoftext|>"])  # config.json's bos_token_id in Qwen checkpoints
    writer.add_eos_token_id(ids[config["eos_token"]])
    writer.add_pad_token_id(ids[config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(config["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def chat_prompt_ids(tok, template: str, messages: list[dict]) -> list[int]:
    """What Model.chat_prompt_ids does, for a tokenizer and a template without a model: render, keep the
    messages' text literal, parse the template's control tokens, add a BOS the vocabulary asks for."""
    from perfx_core.chat_template import message_spans, render_chat

    def piece(token_id: int | None) -> str:
        return tok.token_to_piece(token_id) if token_id is not None else ""

    text = render_chat(template, messages, bos_token=piece(tok.bos_id), eos_token=piece(tok.eos_id))
    spans = message_spans(text, [m["content"] for m in messages], tok.find_control_text)
    ids = tok.encode(text, parse_special=True, literal_spans=spans)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids
