"""Argument types and shared options of the ``perfx`` commands: bad values fail while parsing, before any model
loads, with argparse naming the flag (``argument --max-tokens/-n: must be an integer >= 1; got -5``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .errors import InvalidArgumentError
from .sampling import SamplingParams

# Other names of --context: commands written with them (llama.cpp's --ctx-size among them) keep working, and
# --help lists the one name.
CONTEXT_ALIASES = ("--context-length", "--ctx", "--ctx-size")


class Parser(argparse.ArgumentParser):
    """Errors as one line in perfx's own form (subcommand parsers inherit the class)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"perfx: error: {message} (`{self.prog} --help` lists the options)\n")


def integer_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {value}")
        return value

    parse.__name__ = "integer"  # what argparse names in its own messages
    return parse


positive_int = integer_at_least(1)
non_negative_int = integer_at_least(0)


def sampling_value(name: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A value of SamplingParams field ``name``, checked by SamplingParams's own rules (written once, there)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if convert is int else 'a number'}; got {text!r}"
            ) from None
        try:
            SamplingParams(**{name: value})
        except InvalidArgumentError as exc:
            message = str(exc)
            raise argparse.ArgumentTypeError(message.removeprefix(f"{name} ")) from None
        return value

    parse.__name__ = convert.__name__
    return parse


def add_context_option(parser: argparse.ArgumentParser, help: str, default: int | None = None) -> None:
    """``--context N``, the one name of the KV-cache length in every command; CONTEXT_ALIASES are hidden aliases."""
    parser.add_argument("--context", "-c", metavar="N", type=positive_int, default=default, help=help)
    parser.add_argument(
        *CONTEXT_ALIASES, dest="context", type=positive_int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def read_prompt(prompt: str) -> str:
    """``-`` reads the prompt from stdin (all of it, less the newline that ends its last line), as other tools
    take ``-`` for a file."""
    if prompt != "-":
        return prompt
    if sys.stdin.isatty():
        print("perfx: reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    return sys.stdin.read().removesuffix("\n")
