"""Write a Hugging Face-style Llama directory (config.json, sharded safetensors, tokenizer) from perfx weights.

Used to turn a GGUF into a float reference checkpoint (``gguf_to_hf``) and by the quantization benchmark to
build synthetic models. Layers are written shard by shard, so only one shard's tensors are held at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import LlamaConfig
from .hf import expected_shapes, hf_name

TORCH_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def hf_config(config: LlamaConfig, dtype: np.dtype) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.context_length,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": TORCH_DTYPES[np.dtype(dtype)],
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_context_length,
        }
    if config.long_rope is not None:
        r = config.long_rope
        raw["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": list(r.short_factors),
            "long_factor": list(r.long_factors),
            "original_max_position_embeddings": r.original_context_length,
            "attention_factor": r.attn_factor,
        }
    return raw


def write_hf_checkpoint(
    out: str | os.PathLike[str],
    config: LlamaConfig,
    layer: Callable[[int], dict[str, np.ndarray]],
    top: Callable[[], dict[str, np.ndarray]],
    dtype: type = np.float32,
    layers_per_shard: int | None = None,
) -> Path:
    """``layer(i)``: perfx-named block tensors; ``top()``: token_embedding, norm and (untied) output."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config, np.dtype(dtype)), indent=2), encoding="utf-8")
    per = layers_per_shard or config.n_layers
    groups = [list(range(i, min(i + per, config.n_layers))) for i in range(0, config.n_layers, per)]
    n_shards = len(groups) + 1
    sharded = n_shards > 1 and layers_per_shard is not None
    weight_map: dict[str, str] = {}
    total = 0
    shapes = expected_shapes(config)

    def save(tensors: dict[str, np.ndarray], index: int) -> None:
        nonlocal total
        name = f"model-{index + 1:05d}-of-{n_shards:05d}.safetensors" if sharded else "model.safetensors"
        if not sharded and (out / name).exists():
            from safetensors.numpy import load_file

            tensors = {**load_file(str(out / name)), **tensors}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.nbytes

    for index, group in enumerate(groups):
        tensors = {}
        for i in group:
            for n, array in layer(i).items():
                assert array.shape == shapes[n], (n, array.shape)
                keep = np.float32 if n.endswith("norm") and np.dtype(dtype) == np.float32 else dtype
                tensors[hf_name(n, i)] = np.ascontiguousarray(array, dtype=keep)
        save(tensors, index)
        del tensors
    save({hf_name(n): np.ascontiguousarray(a, dtype=dtype) for n, a in top().items()}, len(groups))
    if sharded:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return out


def write_bpe_tokenizer(metadata: dict[str, Any], out: Path) -> None:
    """tokenizer.json + tokenizer_config.json for a byte-level BPE vocabulary given as GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = np.asarray(metadata.get("tokenizer.ggml.token_type", np.ones(len(tokens))), dtype=np.int32)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in np.flatnonzero(types == 3)])
    tk.save(str(out / "tokenizer.json"))

    def tok(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "bos_token": tok("bos"),
        "eos_token": tok("eos"),
        "unk_token": tok("unknown"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
    }
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: type = np.float32,
    layers_per_shard: int | None = None,
    n_layers: int | None = None,
) -> Path:
    """Dequantize a Llama GGUF into a Hugging Face-style float directory (q/k rows in HF order, tied head kept tied).

    ``n_layers`` keeps only the first blocks (a cheaper stand-in model for tests).
    """
    from dataclasses import replace

    from ..quant.sources import GGUFSource
    from .hf_tokenizer import GGUF_TOKENIZER_FILE, save_gguf_tokenizer

    src = GGUFSource(Path(gguf_path))

    vocab = (src.config.vocab_size, src.config.dim)

    def top() -> dict[str, np.ndarray]:
        tensors = {"token_embedding": src._matrix("token_embd.weight", vocab), "norm": src.norm()}
        if "output.weight" in src.gf.tensors:
            tensors["output"] = src._matrix("output.weight", vocab)
        return tensors

    config = src.config if n_layers is None else replace(src.config, n_layers=min(n_layers, src.config.n_layers))
    path = write_hf_checkpoint(out, config, src.layer, top, dtype, layers_per_shard)
    if src.gf.metadata.get("tokenizer.ggml.model") == "gpt2":
        write_bpe_tokenizer(src.gf.metadata, path)
    else:  # SentencePiece vocabularies: keep GGUF's form, which perfx reads from any model directory
        save_gguf_tokenizer(src.gf.metadata, path / GGUF_TOKENIZER_FILE)
    return path
