"""Write a Llama-2-7B-shaped Q4_0 GGUF with random weights and a real tokenizer, for benchmarks.

    python benchmarks/make_synthetic_gguf.py OUT.gguf --vocab ggml-vocab-llama-spm.gguf [--layers 32] [--dim 4096]

Timing does not depend on weight values, so a benchmark machine without the real checkpoint (or without
network) builds this in seconds and runs `perfx bench`, `perfx serve` and the serving load generator on a
real file path, tokenizer included. The vocabulary comes from a vocab-only GGUF (the Llama SPM one has
Llama-2's 32,000 tokens).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from perfx_core.gguf_file import read_gguf
from perfx_core.synthetic import random_q4_0


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
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name("llama-2-7b-shape (random Q4_0 weights)")
    vocab = copy_tokenizer(writer, args.vocab)
    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)

    d, f = args.dim, args.ffn
    kv = args.dim // args.heads * args.kv_heads
    q4 = gguf.GGMLQuantizationType.Q4_0

    def add_q4_0(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_q4_0(rows, cols, rng), raw_dtype=q4)  # shape in bytes per row

    def add_norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    add_q4_0("token_embd.weight", vocab, d)
    for i in range(args.layers):
        p = f"blk.{i}."
        add_norm(p + "attn_norm.weight")
        add_q4_0(p + "attn_q.weight", d, d)
        add_q4_0(p + "attn_k.weight", kv, d)
        add_q4_0(p + "attn_v.weight", kv, d)
        add_q4_0(p + "attn_output.weight", d, d)
        add_norm(p + "ffn_norm.weight")
        add_q4_0(p + "ffn_gate.weight", f, d)
        add_q4_0(p + "ffn_up.weight", f, d)
        add_q4_0(p + "ffn_down.weight", d, f)
    add_norm("output_norm.weight")
    add_q4_0("output.weight", vocab, d)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
