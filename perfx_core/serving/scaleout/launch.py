"""``perfx serve --ray``: start a Ray cluster on this machine (or join one), deploy perfx on Ray Serve and serve
until interrupted."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import replace

from ..config import ServeError, ServerConfig
from .settings import ReplicaSettings

FORWARDED_PREFIX = "PERFX_"  # this shell's perfx settings reach the replicas on every node (not the API key)


def serve_on_ray(
    config: ServerConfig,
    settings: ReplicaSettings,
    *,
    address: str | None,
    port: int,
    log_level: str,
    bundled_model: bool,
) -> int:
    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions
        from ray.serve.schema import LoggingConfig
    except ImportError as exc:
        why = f"`perfx serve --ray` needs Ray Serve ({exc.name} is missing): pip install 'perfx[ray]'"
        raise ServeError(why) from None
    from .deployments import APP_NAME, build_app

    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIX) and k != "PERFX_API_KEY"}
    settings = replace(settings, env={**env, **settings.env})
    stop = _StopOnSignal()
    if address is None:
        ray.init(include_dashboard=False, logging_level=log_level.upper())
    else:
        ray.init(address=address, logging_level=log_level.upper())
    try:
        logging_config = LoggingConfig(log_level=log_level.upper(), enable_access_log=log_level == "debug")
        serve.start(http_options=HTTPOptions(host=config.host, port=port), logging_config=logging_config)
        app = build_app(
            config, settings, cluster_gpus=ray.cluster_resources().get("GPU", 0.0), bundled_model=bundled_model
        )
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", logging_config=logging_config)
        except RuntimeError as exc:  # Serve's "deployment failed", with the replica's error in it
            raise ServeError(f"the Ray Serve deployment failed: {exc}") from None
        count = (
            f"{settings.min_replicas}..{settings.max_replicas} (autoscaled)"
            if settings.autoscaled
            else str(settings.replicas or 1)
        )
        print(
            f"perfx: serving {config.model_id} from {count} replicas on Ray Serve at http://{config.host}:{port}",
            file=sys.stderr,
        )
        stop.wait()
    except KeyboardInterrupt:  # a signal while starting
        print("perfx: interrupted while starting; stopping", file=sys.stderr)
        return 130
    finally:
        if address is None:
            serve.shutdown()
        else:  # leave the cluster and its other applications running
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


class _StopOnSignal:
    """SIGINT and SIGTERM end the serving. One that arrives while the cluster starts or the replicas load also
    interrupts that (and, should Ray's waiting swallow the interrupt, ends the serving as soon as it is up)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._stop.set()
        if not self._serving:
            raise KeyboardInterrupt

    def wait(self) -> None:
        self._serving = True
        while not self._stop.wait(1.0):
            pass
        logging.getLogger("perfx.serving").info("stopping")
