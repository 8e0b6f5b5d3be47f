"""The RoPE scaling of a Hugging Face ``config.json``, read as transformers reads it: ``rope_scaling`` (or, from
transformers 5, ``rope_parameters``) with rope_type 'llama3', or 'longrope' (Phi-3; 'su' is its old name) with
its 'short_factor' and 'long_factor' lists. perfx_core.rope says how each is applied."""

from __future__ import annotations

import math
from typing import Any

from ..config import ConfigCheck, longrope_attn_factor, show

# RopeScaling field -> key inside rope_scaling
LLAMA3_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_context_length": "original_max_position_embeddings",
}
_ORIGINAL = "original_max_position_embeddings"


def rope_values(raw: dict[str, Any], params: Any, file: str, names: dict[str, str]) -> dict[str, Any]:
    """``rope_scaling`` or ``long_rope`` as read, for config_from_values; ``names`` gains the keys they came from.
    ``params``: the rope_parameters object that applies to the full-attention layers, if any."""
    key, scaling = "rope_scaling", raw.get("rope_scaling")
    if scaling is None and isinstance(params, dict) and params.get("rope_type") not in (None, "default"):
        key, scaling = "rope_parameters", params
    names["rope_scaling"] = key
    names.update({f"rope_scaling.{f}": f"{key}.{k}" for f, k in LLAMA3_KEYS.items()})
    check = ConfigCheck(file, names)
    _check_full_rotary(raw, params, check)
    kind = _scaling_kind(scaling, key, check)
    if kind != "longrope":
        # not an object: config_from_values names the wrong type
        llama3 = {f: scaling[k] for f, k in LLAMA3_KEYS.items() if k in scaling} if kind else None
        return {"rope_scaling": scaling if not isinstance(scaling, dict) else llama3}
    original = _ORIGINAL if _ORIGINAL in raw else f"{key}.{_ORIGINAL}"
    for field, name in (
        ("short_factors", "short_factor"),
        ("long_factors", "long_factor"),
        ("attn_factor", "attention_factor"),
    ):
        names[f"long_rope.{field}"] = f"{key}.{name}"
    names.update({"long_rope": key, "long_rope.original_context_length": original})
    return {"long_rope": _longrope(raw, scaling, key, ConfigCheck(file, names))}


def _scaling_kind(scaling: Any, key: str, check: ConfigCheck) -> str | None:
    """'llama3', 'longrope' or None (no scaling, or not an object); ModelFormatError for the ones perfx lacks."""
    if not isinstance(scaling, dict):
        return None
    kind_key = "rope_type" if "rope_type" in scaling else "type"
    kind = scaling.get(kind_key)
    if kind in (None, "default"):
        return None
    if kind in ("llama3", "longrope", "su"):
        return "longrope" if kind == "su" else kind
    if not isinstance(kind, str):
        raise check.bad(f"{key}.{kind_key}", kind, "a RoPE scaling name such as 'llama3'", True)
    raise check.error(f"RoPE scaling {kind!r} ({key}.{kind_key}) is not supported (only 'llama3' and 'longrope')")


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], key: str, check: ConfigCheck) -> dict[str, Any]:
    """LongRope's fields as read. The original context: the top-level key where there is one (Phi-3 keeps it
    there, and transformers prefers it), else the scaling object's. The attention factor: attention_factor if
    given, else the default for ``factor`` if given, else (config_from_values) for max_position_embeddings."""
    out = {
        f: scaling[k] for f, k in (("short_factors", "short_factor"), ("long_factors", "long_factor")) if k in scaling
    }
    original = raw.get(_ORIGINAL, scaling.get(_ORIGINAL))
    if original is None:
        return out  # config_from_values names the missing key
    out["original_context_length"] = original
    if scaling.get("attention_factor") is not None:
        out["attn_factor"] = scaling["attention_factor"]
    elif scaling.get("factor") is not None:
        factor = check.number(f"{key}.factor", scaling["factor"])
        out["attn_factor"] = longrope_attn_factor(factor, check.integer(_ORIGINAL, original, lo=2))
    return out


def _check_full_rotary(raw: dict[str, Any], params: Any, check: ConfigCheck) -> None:
    """perfx rotates whole heads; a model rotating part of each (partial_rotary_factor, Phi-4-mini) is refused."""
    key, value = "partial_rotary_factor", raw.get("partial_rotary_factor")
    if value is None and isinstance(params, dict):
        key, value = "rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor")
    if value is not None and (not isinstance(value, (int, float)) or not math.isclose(value, 1.0)):
        raise check.error(f"{key!r} is {show(value)}; perfx runs RoPE over whole heads only (a factor of 1)")
