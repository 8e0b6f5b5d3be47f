"""The ``perfx gui`` subcommand, added to perfx's CLI parser by ``add_commands``."""

from __future__ import annotations

import argparse


def add_commands(subparsers) -> None:
    """Add ``gui`` to the CLI's subparsers (the object ``ArgumentParser.add_subparsers`` returned)."""
    gui = subparsers.add_parser("gui", help="open the desktop app: chat, backend picker, live profiler, benchmarks")
    add_arguments(gui)
    gui.set_defaults(func=cmd_gui)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", "-m", default=None, help="GGUF file to open (default: $PERFX_MODEL or the bundled model)"
    )
    parser.add_argument("--backend", "-b", default="numpy", help="backend to load the model on (default: numpy)")
    parser.add_argument("--device", "-d", default=None, help="device index or name of the backend")
    parser.add_argument("--context-length", type=int, default=2048, help="KV cache length in tokens (default: 2048)")


def cmd_gui(args: argparse.Namespace) -> int:
    from . import require_qt

    require_qt()  # raises a PerfxError subclass, which the CLI prints as a one-line error
    from .app import run_app

    return run_app(args)
