"""The ``perfx`` command line: run, chat, models, backends, check-backend, bench, tune, and the commands of
COMMAND_MODULES. Arguments are checked while parsing (perfx_core.cli_options), before any model loads."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from . import __version__, defaults, progress
from .cli_options import (
    Parser,
    add_context_option,
    positive_int,
    read_prompt,
    sampling_value,
)
from .errors import BackendUnavailableError, InvalidArgumentError, PerfxError

# Modules with more subcommands, each with add_commands(subparsers); they import their heavy parts lazily.
COMMAND_MODULES = ("perfx_core.quant.cli_commands", "perfx_core.serving.cli_commands", "perfx_gui.cli_commands")


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "-m",
        metavar="MODEL",
        help="GGUF file, model directory, or a name `perfx models` lists (default: $PERFX_MODEL or the bundled "
        "SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--backend", "-b", metavar="NAME", default="numpy", help="backend name (default numpy; see `perfx backends`)"
    )
    parser.add_argument("--device", "-d", metavar="D", help="device index or name (default: the backend's best)")
    add_context_option(parser, help="KV-cache length in tokens (default: the model's, at most 4096)")
    parser.add_argument("--kv-dtype", choices=("float16", "float32"), help="KV-cache dtype (default: the backend's)")


def _quiet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress or speed lines on stderr")
    parser.add_argument("--quiet-stats", dest="quiet", action="store_true", help=argparse.SUPPRESS)  # older name


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-tokens",
        "-n",
        metavar="N",
        type=positive_int,
        help=f"tokens to generate at most (default {defaults.MAX_TOKENS}, or what the context has left)",
    )
    parser.add_argument(
        "--temperature",
        "-t",
        metavar="T",
        type=sampling_value("temperature", float),
        default=defaults.TEMPERATURE,
        help=f"0 is greedy (default {defaults.TEMPERATURE})",
    )
    parser.add_argument(
        "--top-k",
        metavar="K",
        type=sampling_value("top_k", int),
        default=defaults.TOP_K,
        help=f"0 disables (default {defaults.TOP_K})",
    )
    parser.add_argument(
        "--top-p",
        metavar="P",
        type=sampling_value("top_p", float),
        default=defaults.TOP_P,
        help=f"1 disables (default {defaults.TOP_P})",
    )
    parser.add_argument(
        "--min-p",
        metavar="P",
        type=sampling_value("min_p", float),
        default=defaults.MIN_P,
        help=f"0 disables (default {defaults.MIN_P})",
    )
    parser.add_argument(
        "--repetition-penalty",
        metavar="R",
        type=sampling_value("repetition_penalty", float),
        default=defaults.REPETITION_PENALTY,
        help="1 disables (default 1)",
    )
    parser.add_argument(
        "--seed", metavar="S", type=sampling_value("seed", int), help="seed of the draws, to repeat a run exactly"
    )
    parser.add_argument("--stop", metavar="STR", action="append", default=[], help="stop string (repeatable)")
    _quiet_option(parser)


def _device_arg(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


def _load(args: argparse.Namespace):
    from .api import load
    from .settings import remember_model

    model = load(
        args.model,
        backend=args.backend,
        device=_device_arg(args.device),
        context_length=args.context,
        kv_dtype=args.kv_dtype,
    )
    try:
        remember_model(model.path)
    except OSError:  # a read-only config directory must not stop a run: the recent list is a convenience
        pass
    return model


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop": args.stop,
    }


def _check_generation_args(args: argparse.Namespace) -> None:
    """What can be checked without the model, so that a mistake does not wait for it to load."""
    from .stop_strings import check_stop_strings

    try:
        check_stop_strings(args.stop)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--stop: {exc}") from None
    if args.context is not None and args.max_tokens is not None and args.max_tokens >= args.context:
        raise InvalidArgumentError(
            f"--max-tokens {args.max_tokens} leaves no room for the prompt in --context {args.context}"
        )


def _stream(generation, quiet: bool) -> None:
    for event in generation:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        print(_stats_line(generation), file=sys.stderr)


def _stats_line(generation) -> str:
    s = generation.stats
    prefilled = s.prompt_tokens - s.cached_prompt_tokens
    cached = f" ({s.cached_prompt_tokens} already in the KV cache)" if s.cached_prompt_tokens else ""
    finish = s.finish_reason
    if finish == "length":
        finish += f": the {generation.max_tokens}-token limit (--max-tokens)"
    return (
        f"[{s.prompt_tokens} prompt tokens{cached}, {prefilled} prefilled at {s.prefill_tokens_per_s:.1f} tok/s; "
        f"{s.generated_tokens} generated at {s.decode_tokens_per_s:.1f} tok/s; "
        f"first token after {s.time_to_first_token_s * 1e3:.0f} ms; finish: {finish}]"
    )


def why_nothing_came_out(generation, chat: bool, has_template: bool) -> str | None:
    """A sentence saying why a completion printed no text, and what to try; None when it printed some."""
    if generation.text.strip():
        return None
    s = generation.stats
    if s.finish_reason == "stop" and s.generated_tokens == 0:
        what = "the model ended its reply at once (its first token was end-of-sequence)"
    elif s.finish_reason == "stop" and generation.streaming.stopped:
        what = "a --stop string matched before any text"
    elif s.finish_reason == "length":
        what = f"the {generation.max_tokens} tokens allowed (--max-tokens) held no visible text"
    else:
        what = "the model wrote only whitespace"
    if not chat and has_template:
        hint = "this is a chat model and --raw skips its chat template: drop --raw to ask it a question"
    elif not chat:
        hint = "this model has no chat template, so the prompt is continued as plain text: end it where text follows"
    else:
        hint = "try another wording, another --temperature or --seed"
    return f"no text came out: {what}; {hint}"


def cmd_run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise InvalidArgumentError("the prompt is empty" + (" (stdin gave no text)" if args.prompt == "-" else ""))
    if args.raw and args.system:
        raise InvalidArgumentError("--system needs the model's chat template, which --raw skips")
    _check_generation_args(args)
    model = _load(args)
    try:
        return _answer(model, args, prompt)
    finally:
        model.close()


def _answer(model, args: argparse.Namespace, prompt: str) -> int:
    from .chat_session import ChatSession

    has_template = model.chat_template is not None
    chat = has_template and not args.raw
    if chat:
        generation = ChatSession(model, args.system, _sampling_kwargs(args)).ask(prompt)
    else:
        ids = model.tokenizer.encode(prompt, add_special=True)
        kwargs = _sampling_kwargs(args)
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = max(1, min(defaults.MAX_TOKENS, model.context_length - len(ids)))
        generation = model.generate(ids, **kwargs)
    _stream(generation, args.quiet)
    why = why_nothing_came_out(generation, chat, has_template)
    if why:
        print(f"perfx: {why}", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    _check_generation_args(args)
    model = _load(args)
    try:
        return _chat(model, args)
    finally:
        model.close()


def _chat(model, args: argparse.Namespace) -> int:
    from .chat_session import ChatSession
    from .line_editing import LineEditing

    session = ChatSession(model, args.system, _sampling_kwargs(args))
    interactive = sys.stdin.isatty()
    print(
        f"perfx chat with {model.path.name} on {model.backend}. /help lists the commands; /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    with LineEditing(enabled=interactive):
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as shells do
                print("\n(/exit or Ctrl-D quits)", file=sys.stderr)
                continue
            try:
                reply = session.handle(line)
            except PerfxError as exc:  # e.g. the conversation outgrew the context: say so and keep the session
                print(f"perfx: error: {exc} (/reset starts over)", file=sys.stderr)
                continue
            if reply.exit:
                return 0
            if reply.text:
                print(reply.text, file=sys.stderr)
            if reply.generation is None:
                continue
            try:
                _stream(reply.generation, args.quiet)
            except PerfxError as exc:
                print(f"\nperfx: error: {exc} (/reset starts over)", file=sys.stderr)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
                print("\n[stopped]", file=sys.stderr)
                reply.generation.close()
            session.finish(reply.generation)


def _count(n: int | None) -> str:
    if not n:
        return "-"
    return next(f"{n / scale:.{digits}f}{unit}" for scale, unit, digits in _SCALES if n >= scale or unit == "K")


_SCALES = ((1e9, "B", 1), (1e6, "M", 0), (1e3, "K", 0))


def cmd_models(args: argparse.Namespace) -> int:
    from .model_catalog import describe, find_models, search_roots

    infos = [describe(found) for found in find_models(args.dir)]
    if args.json:
        rows = [
            {
                "name": i.found.name,
                "path": str(i.found.path),
                "source": i.found.source,
                "architecture": i.architecture,
                "quantization": i.quantization,
                "parameters": i.parameters,
                "size_bytes": i.size_bytes,
                "runs": i.runs,
            }
            for i in infos
        ]
        print(json.dumps(rows, indent=2))
        return 0
    header = ("NAME", "ARCH", "QUANT", "PARAMS", "SIZE", "RUNS", "FOUND IN", "PATH")
    table = [header] + [
        (
            i.found.name,
            i.architecture,
            i.quantization,
            _count(i.parameters),
            f"{i.size_bytes / 2**20:.0f} MiB" if i.size_bytes < 2**30 else f"{i.size_bytes / 2**30:.1f} GiB",
            i.runs,
            i.found.source,
            str(i.found.path),
        )
        for i in infos
    ]
    widths = [max(len(row[c]) for row in table) for c in range(len(header) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    names = [i.found.name for i in infos]
    if len(set(names)) < len(names):
        print("\nA name listed twice: --model NAME takes the first; pass the path to load another.")
    print("\nSearched (besides the bundled and recent models):")
    for source, root in search_roots(args.dir):
        print(f"  {source:10s} {root}{'' if root.is_dir() else '  (not there)'}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from .plugins import FAILED_PLUGINS, get_registry

    registry = get_registry()
    for name, reason in sorted(FAILED_PLUGINS.items()):
        print(f"plugin {name!r} failed to load and is skipped: {reason}")
    for name, backend in sorted(registry.backends.items()):
        print(f"{name}  ({backend.description}; plugin {registry.backend_plugin[name]!r})")
        try:
            for dev in backend.devices():
                mem = f", {dev.memory_bytes / 2**30:.1f} GiB" if dev.memory_bytes else ""
                print(f"  device {dev.index}: {dev.name} [{dev.kind}{mem}]")
        except BackendUnavailableError as exc:
            print(f"  unavailable: {exc}")
        except Exception as exc:  # a third-party backend's bug must not hide the other backends
            print(f"  unavailable: {type(exc).__name__}: {exc}")
        if args.ops:
            try:
                chosen = registry.resolve(name)
                for op, impl in chosen.items():
                    print(f"    {op:18s} {impl.source}")
                _print_family_needs(chosen)
            except PerfxError as exc:
                print(f"    ops incomplete: {exc}")
    return 0


def _print_family_needs(chosen: dict) -> None:
    """Which model family needs which op beyond Llama's, and whether this backend has it on its device."""
    from .architectures import FAMILIES

    print("    families beyond Llama need:")
    for family in FAMILIES:
        needs = [
            f"{op} ({'through the host' if chosen[op].source.startswith('perfx_core:') else 'native'})"
            for op in family.extra_ops
        ]
        for op in ("attention_decode", "attention_prefill"):
            declared = set(getattr(chosen[op].function, "perfx_features", ()))
            lacking = [f for f in family.attention_features if f not in declared]
            if lacking:
                needs.append(f"{op} without {'/'.join(lacking)} (refused where the model needs it)")
        if needs:
            print(f"      {family.name:8s} {', '.join(needs)}")


def cmd_check_backend(args: argparse.Namespace) -> int:
    from .conformance import check_backend

    ops = args.ops.split(",") if args.ops else None
    report = check_backend(args.name, device=_device_arg(args.device), ops=ops)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    report = run_bench(
        args.model,
        backend=args.backend,
        device=_device_arg(args.device),
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        repeat=args.repeat,
        profile=args.profile,
        kv_dtype=args.kv_dtype,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from .bench_table import format_report

        print(format_report(report))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .plugins import get_registry

    form = (128, False)  # AWQ's groups: what `perfx quantize` and AutoAWQ checkpoints hold
    if args.llama2_7b:
        from .synthetic import LLAMA2_7B as config
    else:
        from .default_model import resolve_model_path

        path = resolve_model_path(args.model)
        if path.is_dir():
            from .formats import load_directory

            config = load_directory(path).config
        else:
            from .gguf_file import read_gguf
            from .gguf_loader import read_llama_config

            gguf = read_gguf(path)
            config = read_llama_config(gguf)
            form = _gguf_weight_form(gguf)
    group = args.group if args.group is not None else form[0]
    symmetric = args.symmetric if args.symmetric is not None else (form[1] and group == 32)
    rt = get_registry().open_runtime(args.backend, _device_arg(args.device))
    try:
        summary = rt.tune(
            config, quick=args.quick, progress=_TuneProgress(args.verbose), group_size=group, symmetric=symmetric
        )
    finally:
        rt.close()
    print(json.dumps(summary, indent=2))
    return 0


def _gguf_weight_form(gguf) -> tuple[int, bool]:
    """(group size, symmetric) of the int4 form most of a GGUF's matmul weights load as: Q4_0 is symmetric
    with 32-column groups, Q4_1 and Q4_K have a minimum per 32 columns; other types tune as AWQ's 128."""
    from collections import Counter

    types = Counter(
        t.ggml_type.name for name, t in gguf.tensors.items() if name.startswith("blk.") and len(t.shape) == 2
    )
    main = types.most_common(1)[0][0] if types else ""
    return {"Q4_0": (32, True), "Q4_1": (32, False), "Q4_K": (32, False)}.get(main, (128, False))


class _TuneProgress:
    """A line per shape as the tuner reaches it (every timing too with --verbose)."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.shape: str | None = None
        self.shapes = 0
        self.started = progress.begin("tuning the GEMV kernels: every candidate is timed on each matmul shape")

    def __call__(self, row: dict[str, Any]) -> None:
        if self.verbose:
            print(json.dumps(row), file=sys.stderr, flush=True)
        if row["shape"] != self.shape:
            self.shape, self.shapes = row["shape"], self.shapes + 1
            elapsed = time.perf_counter() - self.started
            progress.log.info("tuning shape %d: %s (%.0f s so far)", self.shapes, self.shape, elapsed)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="perfx", description="int4 LLM inference on pluggable backends")
    parser.add_argument("--version", action="version", version=f"perfx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="answer PROMPT (a chat model gets it as a user message) or complete it (--raw)")
    run.add_argument("prompt", help="the prompt; - reads it from stdin")
    run.add_argument(
        "--raw", action="store_true", help="complete PROMPT as plain text, without the model's chat template"
    )
    run.add_argument("--system", metavar="TEXT", help="system prompt (chat models)")
    _model_options(run)
    _sampling_options(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_options(chat)
    _sampling_options(chat)
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.set_defaults(func=cmd_chat)

    models = sub.add_parser(
        "models", help="list the bundled, recent and downloaded models (Hugging Face cache, LM Studio, llama.cpp)"
    )
    models.add_argument("--dir", action="append", default=[], help="also search this folder (repeatable)")
    models.add_argument("--json", action="store_true", help="print the list as JSON")
    models.set_defaults(func=cmd_models)

    backends = sub.add_parser("backends", help="list backends, their devices, and why one is unavailable")
    backends.add_argument("--ops", action="store_true", help="also show which implementation each op uses")
    backends.set_defaults(func=cmd_backends)

    check = sub.add_parser("check-backend", help="run the conformance kit on a backend")
    check.add_argument("name", help="backend name (see `perfx backends`)")
    check.add_argument("--device", "-d", help="device index or name (default: the backend's best)")
    check.add_argument("--ops", help="comma-separated ops to check (default: all)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=cmd_check_backend)

    bench = sub.add_parser("bench", help="measure prefill/decode speed and memory; prints a table (or --json)")
    _model_options(bench)
    bench.add_argument("--prompt-tokens", "-p", type=positive_int, default=128, help="prompt length (default 128)")
    bench.add_argument("--gen-tokens", "-g", type=positive_int, default=64, help="tokens generated (default 64)")
    bench.add_argument("--repeat", "-r", type=positive_int, default=3, help="timed runs (default 3)")
    bench.add_argument("--profile", action="store_true", help="add time per op type (decode, ms per token)")
    bench.add_argument("--json", action="store_true", help="print the full report as JSON")
    _quiet_option(bench)
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser(
        "tune", help="search a backend's kernel parameters for a model's shapes on one device; cached per device"
    )
    tune.add_argument("--model", "-m", help="model whose shapes to tune (default: $PERFX_MODEL or the bundled one)")
    tune.add_argument("--llama2-7b", action="store_true", help="tune the Llama-2-7B shapes instead of a model's")
    tune.add_argument("--backend", "-b", default="opencl", help="backend to tune (default opencl)")
    tune.add_argument("--device", "-d", help="device index or name (default: the backend's best)")
    tune.add_argument("--quick", action="store_true", help="two candidates per shape (a smoke run)")
    tune.add_argument(
        "--group", type=int, choices=(32, 128), help="weight group size to tune for (default: the model file's)"
    )
    tune.add_argument(
        "--symmetric",
        action=argparse.BooleanOptionalAction,
        help="weights without a zero point, as GGUF Q4_0 (default: the model file's; needs --group 32)",
    )
    tune.add_argument("--verbose", "-v", action="store_true", help="print every timing to stderr")
    _quiet_option(tune)
    tune.set_defaults(func=cmd_tune)
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an optional part that is not installed (e.g. the desktop app)
            continue
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The server logs through its own --log-level; every other command shows progress on stderr.
    shown = progress.on_stderr(quiet=getattr(args, "quiet", False)) if args.command != "serve" else nullcontext()
    try:
        with shown:
            return args.func(args)
    except PerfxError as exc:
        print(f"perfx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
