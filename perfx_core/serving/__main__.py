"""``python -m perfx_core.serving [MODEL] [options]``: the same as ``perfx serve`` (used by tests and the bench)."""

from __future__ import annotations

import argparse
import sys

from ..errors import PerfxError
from .cli_commands import add_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perfx_core.serving")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except PerfxError as exc:
        print(f"perfx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
