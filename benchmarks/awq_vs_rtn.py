"""AWQ against round-to-nearest on SmolLM2-135M: held-out perplexity of fp32, RTN int4 and AWQ int4.

The bundled GGUF is dequantized to a float32 Hugging Face-style directory (the full-precision reference),
which is quantized with both methods; all three are scored with perfx_core.quant.eval.perplexity on
perfx_core/data/heldout.txt (never used for calibration). Prints a table, or JSON with --json.

    python benchmarks/awq_vs_rtn.py [--group-size 128] [--ctx 512] [--stride 256] [--samples 32] [--seqlen 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import perfx_core
from perfx_core.default_model import bundled_model_path
from perfx_core.formats.hf_export import gguf_to_hf
from perfx_core.quant import quantize
from perfx_core.quant.calibration import HELDOUT_TEXT, read_text, strip_header
from perfx_core.quant.eval import perplexity


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--loss-tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, help="keep only the first N blocks (quick runs)")
    p.add_argument("--eval-tokens", type=int, help="score only about this many tokens of the held-out text")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    text = strip_header(read_text(HELDOUT_TEXT))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        fp32 = gguf_to_hf(bundled_model_path(), work / "fp32", n_layers=args.layers)
        timings = {"export_s": time.perf_counter() - t0}
        for method in ("rtn", "awq"):
            report = quantize(
                fp32,
                work / method,
                method=method,
                group_size=args.group_size,
                n_samples=args.samples,
                seqlen=args.seqlen,
                loss_tokens=args.loss_tokens,
                progress=None if args.json else lambda m: print(m, file=sys.stderr),
            )
            timings[f"{method}_s"] = report.seconds
        for name in ("fp32", "rtn", "awq"):
            model = perfx_core.load(work / name, backend=args.backend, context_length=args.ctx)
            if args.eval_tokens:
                ids = model.tokenizer.encode(text, add_special=True)[: args.eval_tokens]
                text_used = model.tokenizer.decode(ids)
            else:
                text_used = text
            t0 = time.perf_counter()
            r = perplexity(model, text_used, ctx=args.ctx, stride=args.stride)
            results[name] = {"ppl": r.ppl, "tokens": r.tokens, "eval_s": time.perf_counter() - t0}
            model.close()
    gap = results["rtn"]["ppl"] - results["fp32"]["ppl"]
    closed = (results["rtn"]["ppl"] - results["awq"]["ppl"]) / gap if gap > 0 else float("nan")
    summary = {"group_size": args.group_size, "results": results, "gap_closed": closed, **timings}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for name, r in results.items():
            print(f"{name:5s} ppl {r['ppl']:.4f} over {r['tokens']} tokens")
        print(f"AWQ closes {100 * closed:.1f}% of the gap RTN g{args.group_size} opens; timings {timings}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
