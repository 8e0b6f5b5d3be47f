"""AutoAWQ checkpoints (GEMM layout) loaded as perfx int4 weights, without re-quantizing.

Per linear layer AutoAWQ stores ``qweight`` int32 (in, out/8), ``qzeros`` int32 (in/g, out/8) and ``scales``
fp16 (in/g, out), dequantized as ``(q - zero) * scale``. Eight 4-bit codes share one int32, packed along the
output dimension in AutoAWQ's interleaved order: nibble i (bits 4i..4i+3) holds output column
``8c + AWQ_PACK_ORDER[i]`` of pack c. (AutoAWQ's ``pack`` walks ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``;
its unpacking helpers undo it with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``.) perfx's format is
(out, in) with two codes per byte, so loading transposes and repacks; the values are exact.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..config import LayerWeights, LlamaConfig, LlamaWeights, show
from ..errors import ModelFormatError
from ..weights import SUPPORTED_GROUP_SIZES, Int4Weight, int4_from_scale_zero
from .hf import LAYER_TENSORS, LINEARS, HFCheckpoint, config_from_hf, expected_shapes, hf_name

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i -> column offset within a pack of 8


def is_awq_config(raw_config: dict[str, Any]) -> bool:
    q = raw_config.get("quantization_config")
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "awq"


def unpack_awq_int32(packed: np.ndarray) -> np.ndarray:
    """int32 (rows, cols/8) in AutoAWQ's order -> uint8 codes (rows, cols)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    rows, packs = words.shape
    codes = np.empty((rows, packs, 8), np.uint8)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        codes[:, :, column] = (words >> np.uint32(4 * nibble)) & np.uint32(0xF)
    return codes.reshape(rows, packs * 8)


def pack_awq_int32(codes: np.ndarray) -> np.ndarray:
    """Inverse of unpack_awq_int32: uint8 codes (rows, cols) -> int32 (rows, cols/8) in AutoAWQ's order."""
    rows, cols = codes.shape
    c = np.asarray(codes, np.uint32).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), np.uint32)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        words |= c[:, :, column] << np.uint32(4 * nibble)
    return words.view(np.int32)


def awq_linear(ckpt: HFCheckpoint, prefix: str, shape: tuple[int, int], group_size: int) -> Int4Weight:
    """One AutoAWQ GEMM linear layer (module path ``prefix``) as an Int4Weight of (out, in) = ``shape``."""
    out_f, in_f = shape
    if out_f % 8 or in_f % group_size:
        raise ModelFormatError(f"{ckpt.dir}: {prefix} has shape {shape}, which AutoAWQ's GEMM layout cannot hold")
    qweight, _ = ckpt.array(prefix + ".qweight", (in_f, out_f // 8), ("I32",))
    qzeros, _ = ckpt.array(prefix + ".qzeros", (in_f // group_size, out_f // 8), ("I32",))
    scales, dtype = ckpt.array(prefix + ".scales", (in_f // group_size, out_f), ("F16", "F32", "BF16"))
    if dtype == "BF16":
        raise ModelFormatError(f"{ckpt.dir}: {prefix}.scales are bfloat16; perfx needs fp16 AWQ scales")
    q = unpack_awq_int32(qweight).T  # (out, in)
    zero = unpack_awq_int32(qzeros).T  # (out, groups)
    return int4_from_scale_zero(q, np.ascontiguousarray(scales.T), zero, group_size)


def load_awq_directory(directory: str | os.PathLike[str]) -> tuple[LlamaConfig, LlamaWeights]:
    ckpt = HFCheckpoint(directory)
    raw = ckpt.raw_config
    qc = raw["quantization_config"]
    where = str(ckpt.dir)
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    # type() and not ==: 4.0 or True must not pass for an integer size
    if type(bits) is not int or bits != 4 or type(group) is not int or group not in SUPPORTED_GROUP_SIZES:
        raise ModelFormatError(
            f"{where}: AWQ with {show(bits)} bits and group {show(group)} is not supported "
            f"(4 bits, group {SUPPORTED_GROUP_SIZES})"
        )
    if version != "gemm":
        raise ModelFormatError(f"{where}: AWQ version {version!r} is not supported; perfx reads the GEMM layout")
    if qc.get("zero_point", True) is not True:
        raise ModelFormatError(f"{where}: AWQ without zero points is not supported")
    config = config_from_hf(raw, where)
    shapes = expected_shapes(config)
    layers = []
    for i in range(config.n_layers):
        parts: dict[str, Any] = {n: ckpt.float32(hf_name(n, i), shapes[n]) for n in ("attn_norm", "ffn_norm")}
        for n in LINEARS:
            parts[n] = awq_linear(ckpt, f"model.layers.{i}.{LAYER_TENSORS[n]}", shapes[n], group)  # type: ignore[arg-type]
        layers.append(LayerWeights(**parts))
    vocab = (config.vocab_size, config.dim)
    embedding = ckpt.weight(hf_name("token_embedding"), vocab)
    tied = config.tied_embeddings or hf_name("output") not in ckpt
    output = embedding if tied else ckpt.weight(hf_name("output"), vocab)
    return config, LlamaWeights(embedding, layers, ckpt.float32(hf_name("norm"), (config.dim,)), output)
