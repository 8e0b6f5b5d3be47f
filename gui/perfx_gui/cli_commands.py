"""The ``perfx gui`` subcommand, added to perfx's CLI parser by ``add_commands``."""

from __future__ import annotations

import argparse

from . import require_qt
from .app import add_arguments, run_app


def add_commands(subparsers) -> None:
    """Add ``gui`` to the CLI's subparsers (the object ``ArgumentParser.add_subparsers`` returned)."""
    gui = subparsers.add_parser("gui", help="open the desktop app: chat, backend picker, live profiler, benchmarks")
    add_arguments(gui)
    gui.set_defaults(func=cmd_gui)


def cmd_gui(args: argparse.Namespace) -> int:
    require_qt()  # raises a PerfxError subclass, which the CLI prints as a one-line error
    return run_app(args)
