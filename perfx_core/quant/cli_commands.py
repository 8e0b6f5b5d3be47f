"""``perfx quantize`` and ``perfx eval ppl``: wired into perfx's CLI by ``add_commands(subparsers)``.

Each subcommand sets ``func`` (a function of the parsed arguments returning an exit code), as the other
commands do; PerfxError and KeyboardInterrupt are reported by the CLI's main().
"""

from __future__ import annotations

import argparse
import json
import sys

from ..cli_options import add_context_option, positive_int


def cmd_quantize(args: argparse.Namespace) -> int:
    from . import quantize

    def progress(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr)

    report = quantize(
        args.src,
        args.out,
        method=args.method,
        group_size=args.group_size,
        calib=args.calib,
        n_samples=args.calib_samples,
        seqlen=args.calib_seqlen,
        overwrite=args.force,
        progress=progress,
    )
    sizes = sorted(set(report.group_sizes.values()), reverse=True)
    print(f"wrote {report.out} ({report.method}, group {'/'.join(map(str, sizes))}) in {report.seconds:.1f} s")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from ..api import load
    from .calibration import read_text
    from .eval import perplexity

    text = read_text(args.text)
    device = int(args.device) if args.device is not None and args.device.isdigit() else args.device
    model = load(args.model, backend=args.backend, device=device, context_length=args.context)
    try:
        result = perplexity(model, text, ctx=args.context, stride=args.stride)
    finally:
        model.close()
    if args.json:
        print(json.dumps({"ppl": result.ppl, "tokens": result.tokens}))
    else:
        stride = args.stride or args.context // 2
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens (context {args.context}, stride {stride})")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``quantize`` and ``eval`` (with ``eval ppl``) to perfx's subcommands."""
    q = subparsers.add_parser("quantize", help="quantize a Hugging Face directory or GGUF to perfx's int4 format")
    q.add_argument("src", help="Hugging Face directory (fp32/fp16/bf16 safetensors) or GGUF, of any family perfx runs")
    q.add_argument("-o", "--out", required=True, help="output directory (must not exist unless --force)")
    q.add_argument("--method", choices=("rtn", "awq"), default="awq", help="quantization method (default awq)")
    q.add_argument(
        "--group-size", type=int, choices=(32, 64, 128), default=128, help="weights per int4 scale (default 128)"
    )
    q.add_argument("--calib", help="calibration text file, UTF-8 (default: perfx's own calibration set)")
    q.add_argument("--calib-samples", type=positive_int, default=32, help="calibration windows (default 32)")
    q.add_argument("--calib-seqlen", type=positive_int, default=256, help="tokens per calibration window (default 256)")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists")
    q.add_argument("--quiet", "-q", action="store_true", help="no progress messages")
    q.set_defaults(func=cmd_quantize)

    ev = subparsers.add_parser("eval", help="evaluate a model")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("ppl", help="perplexity of MODEL on a text file (sliding windows)")
    ppl.add_argument("model", help="GGUF file or model directory")
    ppl.add_argument("--text", required=True, help="UTF-8 text file to score")
    add_context_option(ppl, help="window length in tokens (default 512)", default=512)
    ppl.add_argument(
        "--stride", type=positive_int, help="window step in tokens (default ctx/2); only new tokens are scored"
    )
    ppl.add_argument("--backend", "-b", default="numpy", help="backend name (default numpy; see `perfx backends`)")
    ppl.add_argument("--device", "-d", help="device index or name (default: the backend's best)")
    ppl.add_argument("--json", action="store_true", help='print {"ppl": ..., "tokens": ...}')
    ppl.set_defaults(func=cmd_eval_ppl)
