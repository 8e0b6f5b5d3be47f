"""Entry points: ``perfx-gui`` (``main``) and ``perfx gui`` (``run_app``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from perfx_core.cli_options import add_context_option
from perfx_core.errors import PerfxError

from . import require_qt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The app's options, shared by ``perfx-gui`` and ``perfx gui`` (cli_commands)."""
    parser.add_argument(
        "--model", "-m", default=None, help="GGUF file to open (default: $PERFX_MODEL or the bundled model)"
    )
    parser.add_argument("--backend", "-b", default="numpy", help="backend to load the model on (default: numpy)")
    parser.add_argument("--device", "-d", default=None, help="device index or name of the backend")
    add_context_option(parser, help="KV-cache length in tokens (default: 2048)", default=2048)


def run_app(args: argparse.Namespace) -> int:
    """Open the main window and run the Qt event loop until it closes; returns the exit status."""
    require_qt()
    from PySide6.QtWidgets import QApplication

    from .display import require_display
    from .main_window import MainWindow

    app = QApplication.instance()
    if app is None:
        require_display()  # Qt aborts the process when it cannot open its platform: say why first
        app = QApplication(sys.argv[:1])
    app.setApplicationName("perfx")
    window = MainWindow(model_path=args.model, backend=args.backend, device=args.device, context_length=args.context)
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
