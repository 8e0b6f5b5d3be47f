"""The ``perfx`` command line: run, chat, backends, check-backend, bench, and the commands of COMMAND_MODULES."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from .errors import BackendUnavailableError, PerfxError

# Modules with more subcommands, each with add_commands(subparsers); they import their heavy parts lazily.
COMMAND_MODULES = ("perfx_core.quant.cli_commands", "perfx_core.serving.cli_commands", "perfx_gui.cli_commands")


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="model file (default: $PERFX_MODEL or the bundled SmolLM2-135M)")
    parser.add_argument("--backend", "-b", default="numpy", help="backend name (see `perfx backends`)")
    parser.add_argument("--device", "-d", help="device index or name (default: the backend's best)")
    parser.add_argument("--context", type=int, help="KV-cache length in tokens (default: min(model, 4096))")
    parser.add_argument("--kv-dtype", choices=("float16", "float32"), help="KV-cache dtype (default: the backend's)")


def _sampling_options(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max-tokens", "-n", type=int, default=128)
    parser.add_argument("--temperature", "-t", type=float, default=temperature, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0 disables")
    parser.add_argument("--top-p", type=float, default=0.95, help="1 disables")
    parser.add_argument("--min-p", type=float, default=0.05, help="0 disables")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--quiet-stats", action="store_true", help="do not print speed to stderr")


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


def _stream(generation, quiet: bool) -> None:
    for event in generation:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = generation.stats
    if not quiet:
        print(
            f"[{s.prompt_tokens} prompt tokens at {s.prefill_tokens_per_s:.1f} tok/s, "
            f"{s.generated_tokens} generated at {s.decode_tokens_per_s:.1f} tok/s, "
            f"first token after {s.time_to_first_token_s * 1e3:.0f} ms, finish: {s.finish_reason}]",
            file=sys.stderr,
        )


def cmd_run(args: argparse.Namespace) -> int:
    model = _load(args)
    _stream(model.generate(args.prompt, **_sampling_kwargs(args)), args.quiet_stats)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    model = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        f"perfx chat with {model.path.name} on {model.backend}. /reset clears, /exit or Ctrl-D quits.", file=sys.stderr
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        generation = None
        try:
            generation = model.chat(messages, **_sampling_kwargs(args))
            _stream(generation, args.quiet_stats)
        except PerfxError as exc:  # e.g. the conversation outgrew the context: say so and keep the session
            messages.pop()
            print(f"\nperfx: error: {exc} (/reset starts over)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            print("\n[stopped]", file=sys.stderr)
            if generation is None:
                messages.pop()
                continue
            generation.close()
        messages.append({"role": "assistant", "content": generation.text})


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
    print(json.dumps(report, indent=2))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .plugins import get_registry

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

            config = read_llama_config(read_gguf(path))
    rt = get_registry().open_runtime(args.backend, _device_arg(args.device))
    try:
        progress = (lambda row: print(json.dumps(row), file=sys.stderr, flush=True)) if args.verbose else None
        summary = rt.tune(config, quick=args.quick, progress=progress)
    finally:
        rt.close()
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfx", description="int4 LLM inference on pluggable backends")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="stream a completion of PROMPT")
    run.add_argument("prompt")
    _model_options(run)
    _sampling_options(run, temperature=0.8)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_options(chat)
    _sampling_options(chat, temperature=0.8)
    chat.add_argument("--system", help="system prompt")
    chat.set_defaults(func=cmd_chat)

    backends = sub.add_parser("backends", help="list backends, their devices, and why one is unavailable")
    backends.add_argument("--ops", action="store_true", help="also show which implementation each op uses")
    backends.set_defaults(func=cmd_backends)

    check = sub.add_parser("check-backend", help="run the conformance kit on a backend")
    check.add_argument("name")
    check.add_argument("--device", "-d")
    check.add_argument("--ops", help="comma-separated ops to check (default: all)")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_check_backend)

    bench = sub.add_parser("bench", help="measure prefill/decode speed and memory; prints JSON")
    _model_options(bench)
    bench.add_argument("--prompt-tokens", "-p", type=int, default=128)
    bench.add_argument("--gen-tokens", "-g", type=int, default=64)
    bench.add_argument("--repeat", "-r", type=int, default=3)
    bench.add_argument("--profile", action="store_true", help="add time per op type (decode, ms per token)")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser(
        "tune", help="search a backend's kernel parameters for a model's shapes on one device; cached per device"
    )
    tune.add_argument("--model", "-m", help="model whose shapes to tune (default: $PERFX_MODEL or the bundled one)")
    tune.add_argument("--llama2-7b", action="store_true", help="tune the Llama-2-7B shapes instead of a model's")
    tune.add_argument("--backend", "-b", default="opencl")
    tune.add_argument("--device", "-d")
    tune.add_argument("--quick", action="store_true", help="two candidates per shape (a smoke run)")
    tune.add_argument("--verbose", "-v", action="store_true", help="print every timing to stderr")
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
    try:
        return args.func(args)
    except PerfxError as exc:
        print(f"perfx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
