"""Model hyper-parameters and host-side weights of a Llama-family model, independent of the file format, and
``config_from_values``: the one validation of hyper-parameters that every loader's values go through."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from .errors import ModelFormatError
from .weights import Weight


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's long-context RoPE (rope_type "longrope", formerly "su"): per-frequency divisors of the rotation
    speeds, one set for contexts up to the original training length and one beyond it, and a multiplier of cos
    and sin (which scales every q.k by its square). perfx_core.rope says which set a model runs."""

    short_factors: tuple[float, ...]  # (head_dim // 2)
    long_factors: tuple[float, ...]
    original_context_length: int
    attn_factor: float


def longrope_attn_factor(scale: float, original_context_length: int) -> float:
    """The cos/sin multiplier LongRoPE suggests for a context ``scale`` times the original (transformers' and
    llama.cpp's converter's default when the file gives none)."""
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original_context_length))


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    context_length: int  # what the model was trained for
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the rotation speeds (llama.cpp's rope_freqs.weight), when a file gives them
    # instead of scaling parameters; (head_dim // 2) values. Takes precedence over rope_scaling.
    rope_freq_divisors: tuple[float, ...] | None = None
    long_rope: LongRope | None = None  # Phi-3's long-context RoPE; excludes the two above
    tied_embeddings: bool = False
    name: str = ""
    # -- what the families beyond Llama add (perfx_core.architectures says which family uses what) --
    arch: str = "llama"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before the residual add (Gemma 2/3)
    embed_scale: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(dim))
    attn_scale: float | None = None  # multiplier of q.k; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # likewise the output logits (Gemma 2)
    sliding_window: int | None = None  # a query sees at most this many positions, itself included
    sliding_layers: tuple[bool, ...] | None = None  # which layers use the window; None with a window: all
    rope_local_theta: float | None = None  # the RoPE base of the sliding layers when it differs (Gemma 3)

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or self.sliding_layers[layer]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    """One transformer block, q/k rows in Hugging Face order (rotate-half RoPE), all (out, in)."""

    attn_norm: np.ndarray  # float32 (dim,)
    wq: Weight  # (q_dim, dim)
    wk: Weight  # (kv_dim, dim)
    wv: Weight  # (kv_dim, dim)
    wo: Weight  # (dim, q_dim)
    ffn_norm: np.ndarray  # float32 (dim,)
    w_gate: Weight  # (ffn_dim, dim)
    w_up: Weight  # (ffn_dim, dim)
    w_down: Weight  # (dim, ffn_dim)
    # Present exactly when the config asks for them (qkv_bias, qk_norm, post_norms); float32.
    bq: np.ndarray | None = None  # (q_dim,)
    bk: np.ndarray | None = None  # (kv_dim,)
    bv: np.ndarray | None = None  # (kv_dim,)
    q_norm: np.ndarray | None = None  # (head_dim,), the same for every head
    k_norm: np.ndarray | None = None  # (head_dim,)
    post_attn_norm: np.ndarray | None = None  # (dim,)
    post_ffn_norm: np.ndarray | None = None  # (dim,)


@dataclass
class LlamaWeights:
    token_embedding: Weight  # (vocab, dim)
    layers: list[LayerWeights]
    norm: np.ndarray  # float32 (dim,)
    output: Weight  # (vocab, dim); the same object as token_embedding when tied
    notes: list[str] = field(default_factory=list)  # conversions made at load (e.g. K-quant re-quantized)


# -- validation ---------------------------------------------------------------------------------------------

MAX_SIZE = 2**31 - 1  # the kernels index with int32; no real model comes near it
_FIX = "fix the file or re-create the model"
_INT_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "context_length")
_SCALING_FIELDS = tuple(f.name for f in fields(RopeScaling))


def show(value: Any) -> str:
    """A short description of a value read from a file, for error messages."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} with {value.size} entries"
    if isinstance(value, np.generic):
        value = value.item()
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ConfigCheck:
    """Type and range checks of values read from one file; each failure names the file, the key and the value."""

    def __init__(self, where: str, names: Mapping[str, str] | None = None):
        self.where = where
        self.names = dict(names or {})

    def name(self, field: str) -> str:
        return repr(self.names.get(field, field))

    def error(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: {message}; {_FIX}")

    def bad(self, field: str, value: Any, expected: str, wrong_type: bool) -> ModelFormatError:
        kind = f" ({type(value).__name__})" if wrong_type and value is not None and not _is_array(value) else ""
        return self.error(f"{self.name(field)} is {show(value)}{kind}, expected {expected}")

    def required(self, values: Mapping[str, Any], field: str) -> Any:
        if field not in values:
            raise ModelFormatError(f"{self.where} lacks the required key {self.name(field)}; {_FIX}")
        return values[field]

    def integer(self, field: str, value: Any, lo: int = 1, hi: int = MAX_SIZE) -> int:
        expected = f"an integer in {lo}..{hi}"
        if not _is_int(value):
            raise self.bad(field, value, expected, True)
        if not lo <= int(value) <= hi:
            raise self.bad(field, value, expected, False)
        return int(value)

    def number(self, field: str, value: Any, below: float = math.inf) -> float:
        """A finite number in (0, below)."""
        expected = "a positive number" if below == math.inf else f"a number in (0, {below:g})"
        if not _is_number(value):
            raise self.bad(field, value, expected, True)
        x = _finite(value)
        if x is None or not 0 < x < below:
            raise self.bad(field, value, expected, False)
        return x

    def flag(self, field: str, value: Any) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise self.bad(field, value, "true or false", True)
        return bool(value)

    def text(self, field: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.bad(field, value, "a string", True)
        return value


def config_from_values(values: Mapping[str, Any], where: str, names: Mapping[str, str] | None = None) -> LlamaConfig:
    """The one validation of a model's hyper-parameters, whichever file they come from (GGUF, config.json,
    perfx.json): every field's type and range, then the constraints between fields.

    ``values`` maps LlamaConfig fields to the values as read; a required field that is absent is an error.
    ``n_kv_heads`` and ``head_dim`` may be None (or absent), meaning Llama's defaults: as many KV heads as heads,
    and ``dim // n_heads``. ``rope_scaling`` and ``long_rope`` are None or mappings of RopeScaling / LongRope
    fields (LongRope's attn_factor may be absent: the default for context_length). ``names`` maps a field
    ("rope_scaling.factor" for a nested one) to the key the file uses, so errors name what the user can find.
    """
    check = ConfigCheck(where, names)
    out: dict[str, Any] = {f: check.integer(f, check.required(values, f)) for f in _INT_FIELDS}
    out["norm_eps"] = check.number("norm_eps", check.required(values, "norm_eps"), below=1.0)
    out["rope_theta"] = check.number("rope_theta", check.required(values, "rope_theta"))
    n_heads = out["n_heads"]
    kv = values.get("n_kv_heads")
    out["n_kv_heads"] = n_heads if kv is None else check.integer("n_kv_heads", kv)
    if n_heads % out["n_kv_heads"]:
        raise check.error(
            f"{check.name('n_heads')} {n_heads} is not a multiple of {check.name('n_kv_heads')} {out['n_kv_heads']}"
        )
    head_dim = values.get("head_dim")
    if head_dim is None:
        if out["dim"] % n_heads:
            raise check.error(
                f"{check.name('dim')} {out['dim']} is not a multiple of {check.name('n_heads')} {n_heads} "
                "and no head size is given"
            )
        head_dim = out["dim"] // n_heads
    else:
        head_dim = check.integer("head_dim", head_dim)
    if head_dim % 2:
        raise check.error(f"{check.name('head_dim')} {head_dim} is odd; RoPE needs an even head size")
    out["head_dim"] = head_dim
    out["rope_scaling"] = _rope_scaling(check, values.get("rope_scaling"))
    out["rope_freq_divisors"] = _divisors(check, values.get("rope_freq_divisors"), head_dim // 2)
    out["long_rope"] = _long_rope(check, values.get("long_rope"), head_dim // 2, out["context_length"])
    if out["long_rope"] is not None and (out["rope_scaling"] or out["rope_freq_divisors"]):
        other = "rope_scaling" if out["rope_scaling"] else "rope_freq_divisors"
        raise check.error(f"{check.name('long_rope')} and {check.name(other)} are both given; a model has one RoPE")
    out["tied_embeddings"] = check.flag("tied_embeddings", values.get("tied_embeddings", False))
    out["name"] = check.text("name", values.get("name", ""))
    _family_fields(check, values, out)
    return LlamaConfig(**out)


ACTIVATIONS = ("silu", "gelu_tanh")


def _family_fields(check: ConfigCheck, values: Mapping[str, Any], out: dict[str, Any]) -> None:
    """The fields beyond Llama's, each optional with Llama's behaviour as its default."""
    out["arch"] = check.text("arch", values.get("arch", "llama"))
    for flag in ("qkv_bias", "qk_norm", "post_norms"):
        out[flag] = check.flag(flag, values.get(flag, False))
    activation = values.get("activation", "silu")
    if activation not in ACTIVATIONS:
        raise check.bad("activation", activation, f"one of {', '.join(ACTIVATIONS)}", not isinstance(activation, str))
    out["activation"] = activation
    out["embed_scale"] = check.number("embed_scale", values.get("embed_scale", 1.0))
    for name in ("attn_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
        raw = values.get(name)
        out[name] = None if raw is None else check.number(name, raw)
    window = values.get("sliding_window")
    out["sliding_window"] = None if window is None else check.integer("sliding_window", window)
    layers = values.get("sliding_layers")
    if layers is not None:
        if (
            not isinstance(layers, (list, tuple))
            or len(layers) != out["n_layers"]
            or not all(isinstance(v, (bool, np.bool_)) for v in layers)
        ):
            raise check.error(f"{check.name('sliding_layers')} must be {out['n_layers']} true/false values")
        layers = tuple(bool(v) for v in layers)
    out["sliding_layers"] = layers


def _rope_scaling(check: ConfigCheck, raw: Any) -> RopeScaling | None:
    if raw is None:
        return None
    if isinstance(raw, RopeScaling):
        raw = asdict(raw)
    if not isinstance(raw, Mapping):
        raise check.bad("rope_scaling", raw, "an object with the Llama-3 scaling parameters", True)
    unknown = next((k for k in raw if k not in _SCALING_FIELDS), None)
    if unknown is not None:
        raise check.error(f"{check.name('rope_scaling')} has unknown key {show(unknown)}")
    sub = {f"rope_scaling.{k}": v for k, v in raw.items()}
    factor = check.number("rope_scaling.factor", check.required(sub, "rope_scaling.factor"))
    low = check.number("rope_scaling.low_freq_factor", sub.get("rope_scaling.low_freq_factor", 1.0))
    high = check.number("rope_scaling.high_freq_factor", sub.get("rope_scaling.high_freq_factor", 4.0))
    if high <= low:
        raise check.error(
            f"{check.name('rope_scaling.high_freq_factor')} {high:g} must exceed "
            f"{check.name('rope_scaling.low_freq_factor')} {low:g}"
        )
    ctx = "rope_scaling.original_context_length"
    return RopeScaling(factor, low, high, check.integer(ctx, check.required(sub, ctx)))


def _divisors(check: ConfigCheck, raw: Any, n: int) -> tuple[float, ...] | None:
    return None if raw is None else _factors(check, "rope_freq_divisors", raw, n)


def _long_rope(check: ConfigCheck, raw: Any, n: int, context_length: int) -> LongRope | None:
    if raw is None:
        return None
    if isinstance(raw, LongRope):
        raw = asdict(raw)
    if not isinstance(raw, Mapping):
        raise check.bad("long_rope", raw, "an object with the LongRoPE factors", True)
    unknown = next((k for k in raw if k not in _LONG_ROPE_FIELDS), None)
    if unknown is not None:
        raise check.error(f"{check.name('long_rope')} has unknown key {show(unknown)}")
    sub = {f"long_rope.{k}": v for k, v in raw.items()}
    short, long = (_factors(check, f"long_rope.{f}", check.required(sub, f"long_rope.{f}"), n) for f in _FACTOR_SETS)
    original = check.integer(_ORIGINAL_CONTEXT, check.required(sub, _ORIGINAL_CONTEXT), lo=2)
    attn = sub.get("long_rope.attn_factor")
    attn = longrope_attn_factor(context_length / original, original) if attn is None else attn
    return LongRope(short, long, original, check.number("long_rope.attn_factor", attn))


_LONG_ROPE_FIELDS = tuple(f.name for f in fields(LongRope))
_FACTOR_SETS = ("short_factors", "long_factors")
_ORIGINAL_CONTEXT = "long_rope.original_context_length"


def _factors(check: ConfigCheck, field: str, raw: Any, n: int) -> tuple[float, ...]:
    """``n`` positive finite numbers (per-frequency divisors of the rotation speeds)."""
    items = raw.tolist() if isinstance(raw, np.ndarray) and raw.ndim == 1 else raw
    if (
        not isinstance(items, (list, tuple))
        or len(items) != n
        or not all(_is_number(v) and (_finite(v) or 0) > 0 for v in items)
    ):
        got = f"{len(items)} values" if isinstance(items, (list, tuple)) and len(items) != n else show(raw)
        raise check.error(f"{check.name(field)} must be {n} positive numbers (head size / 2), got {got}")
    return tuple(float(v) for v in items)


def _finite(value: Any) -> float | None:
    """A number as a finite float, or None (NaN, infinities, integers past float range)."""
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
