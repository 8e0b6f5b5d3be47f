"""The ``perfx serve`` options of the Ray Serve deployment (``--ray`` and what goes with it); Ray itself is imported
only once ``--ray`` is given (launch.serve_on_ray)."""

from __future__ import annotations

import argparse
import os

from ...errors import InvalidArgumentError
from ..config import ServerConfig
from .settings import ReplicaSettings

RAY_ONLY = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "ray_address", "replica_gpus")


def add_ray_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("scale-out on Ray Serve (pip install 'perfx[ray]'; docs/serving.md)")
    group.add_argument(
        "--ray", action="store_true", help="serve from engine replicas on a Ray cluster (started here unless joined)"
    )
    group.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    group.add_argument("--min-replicas", type=int, help="autoscale on ongoing requests between these two")
    group.add_argument("--max-replicas", type=int, help="the most replicas autoscaling starts (with --min-replicas)")
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        help="ongoing requests per replica that autoscaling aims at (default: --max-running, a full batch)",
    )
    group.add_argument(
        "--ray-address", help="join this Ray cluster ('auto', or the head's HOST:6379) instead of starting one"
    )
    group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica; fractions pack several (default 1)"
    )
    group.add_argument(
        "--replica-gpus",
        type=float,
        help="GPUs per replica (default: 1 for an OpenCL backend where the cluster has GPUs, else 0)",
    )


def ray_settings(args: argparse.Namespace) -> ReplicaSettings | None:
    """The replica settings when ``--ray`` was given, else None (and an error for options that need it)."""
    if not args.ray:
        given = [name for name in RAY_ONLY if getattr(args, name) is not None]
        if given or args.replica_cpus != 1.0:
            names = ", ".join("--" + n.replace("_", "-") for n in (given or ["replica_cpus"]))
            raise InvalidArgumentError(f"{names} only apply with --ray")
        return None
    return ReplicaSettings(
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        cpus=args.replica_cpus,
        gpus=args.replica_gpus,
    )


def run_on_ray(args: argparse.Namespace, config: ServerConfig, settings: ReplicaSettings) -> int:
    from .launch import serve_on_ray

    return serve_on_ray(
        config,
        settings,
        address=args.ray_address,
        port=args.port,
        log_level=args.log_level,
        bundled_model=not (args.model or os.environ.get("PERFX_MODEL")),
    )
