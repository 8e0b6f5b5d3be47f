"""``perfx serve``: the command-line entry point of the OpenAI-compatible server (wired into perfx_core.cli)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from ..cli_options import add_context_option, non_negative_int, positive_int
from ..errors import InvalidArgumentError
from .config import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MIXED_CHUNK,
    ServeError,
    ServerConfig,
)
from .scaleout.cli_options import add_ray_options, ray_settings, run_on_ray

SWITCH_INTERVAL_S = 0.001  # the GIL switch interval of a serving process (see cmd_serve)


def add_commands(subparsers) -> None:
    """Add the ``serve`` subcommand to an argparse subparsers object."""
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API with continuous batching"
    )
    serve.add_argument("model", nargs="?", help="model file (default: $PERFX_MODEL or the bundled SmolLM2-135M)")
    serve.add_argument("--backend", "-b", default="numpy", help="backend name (see `perfx backends`)")
    serve.add_argument("--device", "-d", help="device index or name (default: the backend's best)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: localhost only)")
    serve.add_argument("--port", type=non_negative_int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--max-running", type=positive_int, default=8, help="sequences decoded together (KV-cache slots)"
    )
    serve.add_argument("--max-queue", type=non_negative_int, default=64, help="requests waiting for a slot before 429")
    add_context_option(serve, help="KV-cache length per slot in tokens (default: the model's, at most 4096)")
    serve.add_argument(
        "--prefill-chunk", type=positive_int, default=64, help="prompt tokens prefilled per scheduler step"
    )
    serve.add_argument("--kv-dtype", choices=("float16", "float32"), help="KV-cache dtype (default: the backend's)")
    serve.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run prompt chunks in the same forward pass as the decode rows "
        "(default: on for a GPU device, off on a CPU; docs/serving.md has the measurements)",
    )
    serve.add_argument(
        "--mixed-chunk",
        type=positive_int,
        default=DEFAULT_MIXED_CHUNK,
        help=f"prompt tokens per mixed step, at most, up to 64 (default {DEFAULT_MIXED_CHUNK}); a step's rows are "
        "padded to a multiple of 8. Larger: sooner first tokens, longer pauses for the sequences decoding meanwhile",
    )
    serve.add_argument(
        "--overlap-output",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="handle each step's text (detokenizing, stop strings, streaming) while the device runs the next "
        "step (default: on for a GPU device, off on a CPU)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PERFX_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $PERFX_API_KEY)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    serve.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names to answer besides the defaults ('*': any). By default a server on a "
        "loopback address answers only localhost names (against DNS rebinding), one on another address any name",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins (scheme://host[:port], '*': any) whose pages may call the API "
        "(CORS); none by default",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names clients may use for the model (space- or comma-separated; /v1/models lists them). Other names "
        "are then refused (404); without it any name is served and the file's name is listed",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help=f"seconds a client has to send its request headers, then its body (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        help=f"open connections at most; more get 503 (default {DEFAULT_LIMIT_CONCURRENCY})",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log detail (default info: the model load, warm-up and each request)",
    )
    add_ray_options(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..default_model import resolve_model_path

    try:
        import uvicorn

        from .app import create_app
        from .guard import header_timeout_protocol
    except ImportError as exc:
        raise ServeError(f"`perfx serve` needs {exc.name}, which perfx depends on: reinstall perfx") from None
    if not 0 <= args.port <= 65535:
        raise InvalidArgumentError(f"--port must be in 0..65535; got {args.port}")
    device = int(args.device) if args.device is not None and args.device.isdigit() else args.device
    config = ServerConfig(
        model_path=resolve_model_path(args.model),  # a missing model fails now, not after the server is up
        backend=args.backend,
        device=device,
        context_length=args.context,
        max_running=args.max_running,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        kv_dtype=args.kv_dtype,
        mixed_steps=args.mixed_steps,
        mixed_chunk=args.mixed_chunk,
        overlap_output=args.overlap_output,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        host=args.host,
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        served_model_names=tuple(n.strip() for arg in args.served_model_name for n in arg.split(",") if n.strip()),
        header_timeout_s=args.header_timeout,
        limit_concurrency=args.limit_concurrency,
    )
    replicas = ray_settings(args)  # None without --ray (Ray is then never imported)
    if replicas is None or args.ray_address is None:  # a joined cluster's proxies listen on its nodes, maybe not here
        _check_port_free(args.host, args.port)
    if replicas is not None:
        return run_on_ray(args, config, replicas)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    load_errors: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_failed(exc: BaseException) -> None:
        load_errors.append(exc)
        if server is not None:
            server.should_exit = True

    # Two threads share the GIL here: the scheduler (latency-critical: it queues each step's kernels) and the
    # event loop (streaming). At the default 5 ms switch interval a step could wait up to 5 ms for the loop's
    # thread to let go; 1 ms bounds that wait below a GPU decode step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(config, on_load_failed=on_load_failed)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            http=header_timeout_protocol(config.header_timeout_s),
            limit_concurrency=config.limit_concurrency,
        )
    )
    server.run()
    if load_errors:
        raise ServeError(f"the model failed to load: {load_errors[0]}")
    return 0


def _check_port_free(host: str, port: int) -> None:
    """uvicorn exits the process when it cannot bind; say so as a perfx error before loading anything."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"cannot resolve --host {host!r}: {exc}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
