"""Write a Llama-2-7B-shaped GGUF (Q4_0, Q4_K_M or Q5_K_M) with random weights and a real tokenizer, for benchmarks.

    python benchmarks/make_synthetic_gguf.py OUT.gguf --vocab ggml-vocab-llama-spm.gguf [--type q4_k_m] [--layers 32]

Timing does not depend on weight values, so a benchmark machine without the real checkpoint (or without
network) builds this in seconds and runs `perfx bench`, `perfx serve` and the serving load generator on a
real file path, tokenizer included. The vocabulary comes from a vocab-only GGUF (the Llama SPM one has
Llama-2's 32,000 tokens).

`--type q4_0` (the default) stores every matrix as Q4_0. `--type q4_k_m` lays the tensors out as llama.cpp's
`llama-quantize ... Q4_K_M` does for a Llama model (see `k_m_type`), so a benchmark reads the same mix of
Q4_K and Q6_K blocks as a real Q4_K_M file; `--type q5_k_m` the same with Q5_K for Q4_K. Norms are F32 in all.
"""

from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np

from perfx_core.gguf_file import read_gguf
from perfx_core.synthetic import random_q4_0

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # make_shape_clone_gguf, beside this file
from make_shape_clone_gguf import random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
QK_K = 256  # elements per K-quant block: Q4_K_M needs every row length to be a multiple of it


def use_more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose attn_v and ffn_down Q4_K_M keeps at 6 bits: the first and last eighth of the stack, and
    every third layer between them."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def k_m_type(name: str, n_layers: int, default: T = T.Q4_K) -> T:
    """The ggml type llama.cpp's Q4_K_M (Q5_K_M: ``default`` Q5_K) gives a Llama tensor (llama_tensor_get_type in
    src/llama-quant.cpp, for a model that is neither Falcon, 70B-sized nor a mixture of experts, quantized without
    an imatrix or overrides): ``default``; output.weight Q6_K; attn_v and ffn_down Q6_K in the layers use_more_bits
    picks; norms F32."""
    if name.endswith("norm.weight"):
        return T.F32
    if name == "output.weight":
        return T.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), n_layers):
        return T.Q6_K
    return default


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: str) -> int:
    meta = read_gguf(vocab_path, tensors=False).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in meta:
        writer.add_token_scores(np.asarray(meta["tokenizer.ggml.scores"], dtype=np.float32).tolist())
    writer.add_token_types(np.asarray(meta["tokenizer.ggml.token_type"], dtype=np.int32).tolist())
    if "tokenizer.ggml.merges" in meta:
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (
        ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
    ):
        if key in meta:
            add(int(meta[key]))
    if "tokenizer.ggml.pre" in meta:
        writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    return len(meta["tokenizer.ggml.tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--vocab", required=True, help="a vocab-only GGUF whose tokenizer the model gets")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--type", choices=("q4_0", "q4_k_m", "q5_k_m"), default="q4_0", help="the weights' quantization"
    )
    args = parser.parse_args()
    k_quants = args.type != "q4_0"
    if k_quants and (args.dim % QK_K or args.ffn % QK_K):
        parser.error(f"--type {args.type} needs --dim and --ffn to be multiples of {QK_K}")

    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name(f"llama-2-7b-shape (random {args.type.upper()} weights)")
    vocab = copy_tokenizer(writer, args.vocab)
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{args.type.upper()}"))
    default_k_type = T.Q5_K if args.type == "q5_k_m" else T.Q4_K

    d, f = args.dim, args.ffn
    kv = args.dim // args.heads * args.kv_heads

    def add_matrix(name: str, rows: int, cols: int) -> None:
        if not k_quants:
            writer.add_tensor(name, random_q4_0(rows, cols, rng), raw_dtype=T.Q4_0)  # shape in bytes per row
            return
        ggml_type = k_m_type(name, args.layers, default_k_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        blocks = random_blocks(rows * cols // block_size, ggml_type, rng).reshape(rows, cols // block_size * type_size)
        writer.add_tensor(name, blocks, raw_dtype=ggml_type)

    def add_norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    add_matrix("token_embd.weight", vocab, d)
    for i in range(args.layers):
        p = f"blk.{i}."
        add_norm(p + "attn_norm.weight")
        add_matrix(p + "attn_q.weight", d, d)
        add_matrix(p + "attn_k.weight", kv, d)
        add_matrix(p + "attn_v.weight", kv, d)
        add_matrix(p + "attn_output.weight", d, d)
        add_norm(p + "ffn_norm.weight")
        add_matrix(p + "ffn_gate.weight", f, d)
        add_matrix(p + "ffn_up.weight", f, d)
        add_matrix(p + "ffn_down.weight", d, f)
    add_norm("output_norm.weight")
    add_matrix("output.weight", vocab, d)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
