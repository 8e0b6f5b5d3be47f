"""Test helper: tiny random checkpoints of the model families next to Llama, in both formats perfx reads.

``build_hf_checkpoint(family, dir)`` makes the checkpoint with transformers itself (``Qwen3ForCausalLM(cfg)`` ...),
gives every weight, norm and bias random values that matter, and saves it as transformers does (float32
safetensors, config.json, tokenizer.json + tokenizer_config.json). ``write_gguf(dir, path)`` then converts that
directory the way llama.cpp's ``convert_hf_to_gguf.py`` does; each convention below names the converter class
(``conversion/<family>.py`` in ggml-org/llama.cpp, formerly one file) or the loader (``src/llama-model.cpp``,
``src/models/<arch>.cpp``) it follows. ``gguf_view`` says what llama.cpp reads back from such a file where the
format cannot carry a setting, and ``reference_model`` builds the transformers model a correct loader must match.

Sizes: dim 64, 2 blocks; Gemma 3 has 6 blocks, so that its fixed 5 local : 1 global pattern has a global layer.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from safetensors.numpy import load_file, save_file
from tiny_gguf import CHAT_TEMPLATE, tiny_vocab

import perfx_core
from perfx_core.errors import ModelFormatError

FAMILIES = ("qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")
GGUF_TYPES = ("F32", "F16", "Q8_0")
VOCAB = 320  # tiny_gguf's byte-level BPE vocabulary (288 tokens) padded with reserved tokens
SLIDING_WINDOW = 8  # shorter than the test prompts, so the window changes the outputs
BOS, EOS, UNK = 1, 2, 0  # tiny_gguf's <|im_start|>, <|im_end|>, <|endoftext|>
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=UNK,
)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # transformers class names
    model_class: str
    arch: gguf.MODEL_ARCH
    settings: Mapping[str, Any]  # config values beyond _COMMON
    # llama.cpp's converter permutes q/k rows for its interleaved RoPE: LlamaModel (llama, Mistral) only;
    # Qwen2/Qwen3, Phi-3 and Gemma run NeoX RoPE and keep Hugging Face's rows.
    permute_qk: bool = False
    # Gemma's RMSNorm computes x * (1 + w); GemmaModel / Gemma2Model / Gemma3Model add 1 to every tensor whose
    # name ends in "norm.weight" (q/k norms included) so llama.cpp can multiply by the stored weight.
    norm_shift: float = 0.0


SPECS = {
    "qwen2": Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", gguf.MODEL_ARCH.QWEN2, {"tie_word_embeddings": True}),
    # head_dim 32 != dim / heads (16): Qwen3's head size is its own setting
    "qwen3": Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", gguf.MODEL_ARCH.QWEN3, {"head_dim": 32}),
    "mistral": Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        gguf.MODEL_ARCH.LLAMA,
        {"sliding_window": SLIDING_WINDOW},
        permute_qk=True,
    ),  # fmt: skip
    # rope_scaling None: no longrope/su factors (the converter would write rope_factors_long/short)
    "phi3": Family(
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        gguf.MODEL_ARCH.PHI3,
        {"sliding_window": SLIDING_WINDOW, "original_max_position_embeddings": 128, "rope_scaling": None},
    ),  # fmt: skip
    # query_pre_attn_scalar 24: neither head_dim (32) nor dim / heads (16). Small caps that bite.
    "gemma2": Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        gguf.MODEL_ARCH.GEMMA2,
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "rope_theta": 10000.0,
        },
        norm_shift=1.0,
    ),  # fmt: skip
    # rope_local_base_freq 2500 on sliding layers, rope_theta 1e6 on the global one (layer 5 of 6)
    "gemma3": Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        gguf.MODEL_ARCH.GEMMA3,
        {
            "num_hidden_layers": 6,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 2500.0,
        },
        norm_shift=1.0,
    ),  # fmt: skip
}
# Phi-3's long-context RoPE at test scale: original context 32 (max_position_embeddings 128, so the attention
# factor is sqrt(1 + ln 4 / ln 32)), factors for dim / heads = 16 that move every rotation speed, and no window
# (so attention reaches the whole prompt and every speed shows): build_hf_checkpoint("phi3", dir, **PHI3_LONGROPE).
LONGROPE_ORIGINAL = 32
PHI3_LONGROPE = {
    "sliding_window": None,
    "original_max_position_embeddings": LONGROPE_ORIGINAL,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.1, 1.25, 1.4, 1.6, 1.9, 2.2, 2.6, 3.0],
        "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 12.0, 16.0],
    },
}
_FAMILY_OF_MODEL_TYPE = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
                         "gemma2": "gemma2", "gemma3_text": "gemma3"}  # fmt: skip


def hf_config(family: str, **overrides: Any) -> Any:
    import transformers

    spec = SPECS[family]
    return getattr(transformers, spec.config_class)(**{**_COMMON, **spec.settings, **overrides})


# -- Hugging Face checkpoint --------------------------------------------------------------------------------


def build_hf_checkpoint(family: str, out: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``family`` model saved by transformers (float32 safetensors) with a tokenizer."""
    import torch
    import transformers

    out = Path(out)
    torch.manual_seed(seed)
    model = getattr(transformers, SPECS[family].model_class)(hf_config(family, **overrides))
    randomize(model, seed, SPECS[family].norm_shift != 0)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    return out


def randomize(model: Any, seed: int, offset_norms: bool) -> None:
    """Random values that matter: norms far from their identity (so a dropped norm or a missing 1 + w shows),
    biases as large as the projections' outputs, q/k large enough that attention soft-capping bites, and an
    embedding whose tied logits reach a few units (so the final soft-cap bites without saturating)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                # Gemma stores w and applies 1 + w; the others apply w
                value = 0.4 * r + (0.0 if offset_norms else 1.0)
            elif name.endswith(".bias"):
                value = 0.5 * r
            elif "embed_tokens" in name or name == "lm_head.weight":
                value = 0.4 * r
            else:
                gain = 2.0 if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")) else 1.0
                value = gain * r / math.sqrt(p.shape[1])
            p.copy_(value)


def save_tokenizer(out: Path) -> None:
    """tokenizer.json + tokenizer_config.json written by transformers' fast tokenizer, from tiny_gguf's
    byte-level BPE vocabulary (its <|...|> tokens special), so the vocabulary has the embedding's rows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, types, merges = tiny_vocab(VOCAB)
    pairs = [tuple(m.split(" ")) for m in merges]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    control = int(gguf.TokenType.CONTROL)
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == control]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=tokens[BOS], eos_token=tokens[EOS], unk_token=tokens[UNK],
        pad_token=tokens[UNK], chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    fast.save_pretrained(out)


def edit_checkpoint(
    src: Path,
    dst: Path,
    *,
    drop: tuple[str, ...] = (),
    add: Mapping[str, np.ndarray] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """A copy of checkpoint ``src`` with tensors dropped/added/replaced (``add``) or config.json keys changed."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in (add or {}).items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}, indent=2))
    return dst


# -- GGUF, as llama.cpp's converter writes it ---------------------------------------------------------------


def _rope_theta(cfg: Mapping[str, Any], layer_type: str = "full_attention") -> float | None:
    """rope_theta of a config.json: transformers >= 5 keeps it in rope_parameters (per layer type for Gemma 3)."""
    if cfg.get("rope_theta") is not None:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    params = params.get(layer_type, params)
    return params.get("rope_theta")


def _base_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """TextModel.set_gguf_parameters (conversion/base.py): the keys every text model gets from config.json."""
    keys: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "head_count": cfg["num_attention_heads"],
        "head_count_kv": cfg["num_key_value_heads"],
        "layer_norm_rms_eps": cfg["rms_norm_eps"],
    }
    if _rope_theta(cfg) is not None:
        keys["rope_freq_base"] = _rope_theta(cfg)
    if cfg.get("head_dim") is not None:  # written only where config.json has one (Qwen3, Mistral, Gemma)
        keys["key_length"] = keys["value_length"] = cfg["head_dim"]
    return keys


def _parameters(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GGUFWriter.add_<key> -> value, per converter class (the last value wins, as the writer overwrites)."""
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if family in ("qwen2", "qwen3"):  # Qwen2Model / Qwen3Model(Qwen2Model): the base keys (no yarn here)
        return _base_parameters(cfg)
    if family == "mistral":  # LlamaModel (MistralForCausalLM is registered to it): arch 'llama', no window key
        head = cfg.get("head_dim") or dim // heads
        return {**_base_parameters(cfg), "vocab_size": cfg["vocab_size"], "rope_dimension_count": head}
    if family == "phi3":  # Phi3MiniModel: its own list; sliding_window 0 when the config has none
        rope_dims = int((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) * dim) // heads
        return {
            "context_length": cfg["max_position_embeddings"],
            "rope_scaling_orig_ctx_len": cfg["original_max_position_embeddings"],
            "embedding_length": dim,
            "feed_forward_length": cfg["intermediate_size"],
            "block_count": cfg["num_hidden_layers"],
            "head_count": heads,
            "head_count_kv": cfg["num_key_value_heads"],
            "layer_norm_rms_eps": cfg["rms_norm_eps"],
            "rope_dimension_count": rope_dims,
            "rope_freq_base": _rope_theta(cfg),
            "sliding_window": cfg.get("sliding_window") or 0,
            **_phi3_longrope_keys(cfg),
        }
    if family == "gemma2":  # Gemma2Model: no rope.freq_base (llama.cpp's default 10000 is Gemma 2's)
        return {
            "context_length": cfg["max_position_embeddings"],
            "embedding_length": dim,
            "block_count": cfg["num_hidden_layers"],
            "feed_forward_length": cfg["intermediate_size"],
            "head_count": heads,
            "head_count_kv": cfg["num_key_value_heads"],
            "layer_norm_rms_eps": cfg["rms_norm_eps"],
            "key_length": cfg["head_dim"],
            "value_length": cfg["head_dim"],
            "attn_logit_softcapping": cfg["attn_logit_softcapping"],
            "final_logit_softcapping": cfg["final_logit_softcapping"],
            "sliding_window": cfg["sliding_window"],
        }
    if family == "gemma3":  # Gemma3Model: base keys, the global layers' theta, no local theta or pattern key
        keys = {**_base_parameters(cfg), "key_length": cfg["head_dim"], "value_length": cfg["head_dim"]}
        keys["rope_freq_base"] = _rope_theta(cfg, "full_attention")
        if cfg.get("final_logit_softcapping"):
            keys["final_logit_softcapping"] = cfg["final_logit_softcapping"]
        if cfg.get("sliding_window_pattern") != 1:
            keys["sliding_window"] = cfg["sliding_window"]
        return keys
    raise ValueError(family)


def _phi3_rope_scaling(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The longrope object of a Phi-3 config.json (transformers >= 5 saves rope_parameters), or {}."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params if params.get("long_factor") else {}


def _phi3_longrope_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Phi3MiniModel.generate_extra_tensors' key: the attention factor, from max / original context (su and
    longrope's formula; the converter reads no attention_factor or factor key)."""
    if not _phi3_rope_scaling(cfg):
        return {}
    original = cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    return {"rope_scaling_attn_factors": math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0}


def _phi3_longrope_tensors(cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Phi3MiniModel.generate_extra_tensors' tensors: the two factor lists as float32 vectors."""
    scaling = _phi3_rope_scaling(cfg)
    sets = {gguf.MODEL_TENSOR.ROPE_FACTORS_LONG: "long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT: "short_factor"}
    return {f"{gguf.TENSOR_NAMES[t]}.weight": np.asarray(scaling[k], np.float32) for t, k in sets.items() if scaling}


def _tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    """_set_vocab_gpt2 + SpecialVocab: the byte-level BPE vocabulary save_tokenizer wrote (Gemma 3's converter
    takes this path too when there is no tokenizer.model)."""
    tokens, types, merges = tiny_vocab(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(UNK)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """LlamaModel.permute: rotate-half rows -> llama.cpp's interleaved RoPE order, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _storage(name: str, data: np.ndarray, tensor_type: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """ModelBase.prepare_tensors: 1-D tensors, *_norm.weight and non-.weight tensors stay F32; the others
    (token_embd and output included) take the file type, falling back to F16 where a row cannot be quantized."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or tensor_type == "F32":
        return data.astype(np.float32), None
    if tensor_type == "F16":
        return data.astype(np.float16), None
    try:
        return gguf.quants.quantize(data, GGMLQuantizationType[tensor_type]), GGMLQuantizationType[tensor_type]
    except gguf.QuantError:
        return data.astype(np.float16), None


def stored_values(data: np.ndarray, tensor_type: str, name: str = "x.weight") -> np.ndarray:
    """The float32 values a tensor decodes to once stored as ``tensor_type`` (what a lossless loader yields)."""
    raw, qtype = _storage(name, np.asarray(data, np.float32), tensor_type)
    return np.asarray(raw, np.float32) if qtype is None else gguf.quants.dequantize(raw, qtype).astype(np.float32)


_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0}


def write_gguf(
    hf_dir: str | Path,
    path: str | Path,
    tensor_type: str = "F32",
    *,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Convert checkpoint ``hf_dir`` to a GGUF at ``path`` as convert_hf_to_gguf.py would (``--outtype``
    ``tensor_type``). ``edit`` may change the float32 tensors (GGUF names) before they are stored; ``metadata``
    adds or replaces keys (full names). Returns the values a lossless loader must produce, by Hugging Face name
    and in Hugging Face order (before any permutation or norm shift): the reference model's weights."""
    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    family = _FAMILY_OF_MODEL_TYPE[cfg["model_type"]]
    spec = SPECS[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[spec.arch])
    # general.name from the directory (the converter's fallback); transformers' GGUF loader reads a 'llama' file
    # named ...mistral... as Mistral, so the Mistral directory's name says so.
    writer.add_name(f"tiny-{family}")
    for key, value in _parameters(family, cfg).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_file_type(_FILE_TYPES[tensor_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(writer)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, _value_type(value))

    names = gguf.get_tensor_name_map(spec.arch, cfg["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}
    for hf_name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if family == "gemma2" and hf_name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors: llama.cpp reuses token_embd
        data = np.asarray(w, np.float32)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no llama.cpp name for {hf_name} ({family})")
        expected[hf_name] = stored_values(data, tensor_type, gguf_name)  # rows move whole: permuting commutes
        if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_qk(data, cfg["num_attention_heads"])
        if spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_qk(data, cfg["num_key_value_heads"])
        if spec.norm_shift and hf_name.endswith("norm.weight"):
            data = data + np.float32(spec.norm_shift)
        tensors[gguf_name] = data
    if family == "phi3":
        tensors.update(_phi3_longrope_tensors(cfg))
    if edit is not None:
        edit(tensors)
    for name, data in tensors.items():
        raw, qtype = _storage(name, data, tensor_type)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise TypeError(f"no GGUF type for {value!r}")


# -- what llama.cpp runs, and the reference ------------------------------------------------------------------


def gguf_view(family: str, config: Any) -> Any:
    """``config`` as llama.cpp reads it back from the converted GGUF, where the file cannot carry a setting.

    - Mistral: LlamaModel writes no sliding-window key, so llama.cpp runs the 'llama' file with full attention.
    - Gemma 2 / 3: no query_pre_attn_scalar key; llama.cpp scales q.k by 1/sqrt(key_length) (1/sqrt(dim/heads)
      only for the 27B layer counts, 46 and 62) (llama-model.cpp, LLM_ARCH_GEMMA2/GEMMA3 hparams).
    - Gemma 3: no local RoPE base or pattern key; llama.cpp fixes rope_freq_base_train_swa = 10000 and
      set_swa_pattern(6) (layer i slides when i % 6 < 5), which for 6 blocks is transformers' own pattern.
    - Gemma 2: pattern 2 (set_swa_pattern(2)) and theta 10000 are the fixture's own values: nothing lost.
    - Phi-3: the converter writes sliding_window and the test keeps it. (llama.cpp's loader currently turns Phi
      SWA off with a warning, PR 13676, as a stopgap; the file itself says the window.) LongRoPE's factors and
      original context round-trip; its attention factor is written from max / original context, which is
      transformers' default where config.json gives no attention_factor or factor (PHI3_LONGROPE gives none).
    Everything else round-trips: the returned config is ``config`` itself for those families.
    """
    cfg = copy.deepcopy(config)
    if family == "mistral":
        cfg.sliding_window = None
    if family in ("gemma2", "gemma3"):
        cfg.query_pre_attn_scalar = cfg.head_dim
    if family == "gemma3":
        cfg.rope_parameters["sliding_attention"]["rope_theta"] = 10000.0
        if hasattr(cfg, "rope_local_base_freq"):
            cfg.rope_local_base_freq = 10000.0
        cfg.layer_types = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(cfg.num_hidden_layers)]
    return cfg


def reference_model(
    hf_dir: str | Path,
    *,
    view_as_gguf: bool = False,
    weights: Mapping[str, np.ndarray] | None = None,
    **config_overrides: Any,
) -> Any:
    """The checkpoint in transformers (float32, eager attention), optionally as llama.cpp reads its GGUF
    (``gguf_view``) and with ``weights`` (Hugging Face names, e.g. write_gguf's decoded values) put in."""
    import torch
    import transformers

    hf_dir = Path(hf_dir)
    family = _FAMILY_OF_MODEL_TYPE[json.loads((hf_dir / "config.json").read_text())["model_type"]]
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if view_as_gguf:
        config = gguf_view(family, config)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model_class = getattr(transformers, SPECS[family].model_class)
    model = model_class.from_pretrained(hf_dir, config=config, dtype=torch.float32, attn_implementation="eager")
    if weights is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(torch.from_numpy(np.asarray(value, np.float32)))
    return model.eval()


# -- what the family tests share ------------------------------------------------------------------------------


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits (T, vocab) of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@contextmanager
def loaded(path: Path, context_length: int = 64, backend: str = "numpy") -> Iterator[perfx_core.Model]:
    model = perfx_core.load(path, backend=backend, context_length=context_length)
    try:
        yield model
    finally:
        model.close()


def refused(path: Path, *facts: str) -> None:
    """Loading ``path`` raises a ModelFormatError naming each of ``facts`` (case aside)."""
    with pytest.raises(ModelFormatError) as info:
        with loaded(path):
            pass
    # the path would name the family by itself (pytest's directories carry the test id)
    message = str(info.value).replace(str(path), "<model>")
    for fact in facts:
        assert fact.lower() in message.lower(), f"{fact!r} is not named in: {message}"


class Checkpoints:
    """Builds each checkpoint once per test module: the Hugging Face directory, then its GGUF conversions.
    A checkpoint is named by its family, or by a name in ``variants``: name -> (family, config overrides)."""

    def __init__(self, root: Path, variants: Mapping[str, tuple[str, Mapping[str, Any]]] | None = None):
        self.root = root
        self.variants = dict(variants or {})
        self._gguf: dict[tuple[str, str], tuple[Path, dict[str, np.ndarray]]] = {}

    def hf(self, name: str) -> Path:
        family, overrides = self.variants.get(name, (name, {}))
        path = self.root / name
        return path if path.is_dir() else build_hf_checkpoint(family, path, **overrides)

    def gguf(self, name: str, tensor_type: str) -> tuple[Path, dict[str, np.ndarray]]:
        """(GGUF path, the decoded weights by Hugging Face name)."""
        key = (name, tensor_type)
        if key not in self._gguf:
            path = self.root / f"{name}-{tensor_type}.gguf"
            self._gguf[key] = path, write_gguf(self.hf(name), path, tensor_type)
        return self._gguf[key]

    def source(self, name: str, fmt: str) -> tuple[Path, object]:
        """(what perfx loads, the transformers model it must match) for format 'hf' or 'gguf-<type>'."""
        if fmt == "hf":
            return self.hf(name), reference_model(self.hf(name))
        path, decoded = self.gguf(name, fmt.split("-", 1)[1])
        return path, reference_model(self.hf(name), view_as_gguf=True, weights=decoded)
