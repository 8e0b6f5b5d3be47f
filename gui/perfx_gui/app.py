"""Entry points: ``perfx-gui`` (``main``) and ``perfx gui`` (``run_app``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from perfx_core.errors import PerfxError

from . import require_qt
from .cli_commands import add_arguments


def run_app(args: argparse.Namespace) -> int:
    """Open the main window and run the Qt event loop until it closes; returns the exit status."""
    require_qt()
    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("perfx")
    window = MainWindow(
        model_path=args.model, backend=args.backend, device=args.device, context_length=args.context_length
    )
    window.show()
    window.load_initial_model()
    return app.exec()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perfx-gui", description="perfx desktop app")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_app(args)
    except PerfxError as exc:
        print(f"perfx-gui: error: {exc}", file=sys.stderr)
        return 2
