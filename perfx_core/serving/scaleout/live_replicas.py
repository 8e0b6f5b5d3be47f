"""The engine replicas that this process's request routers route to, by application: what the ingress asks for
/health and /metrics. (Its own module: Serve pickles the router's module by value, so state kept there would be
a copy in every process.)"""

from __future__ import annotations

import threading
from collections.abc import Iterable

_live: dict[str, tuple[str, ...]] = {}
_lock = threading.Lock()  # routers run on a loop of their own thread; the ingress reads from its own loop


def publish(app_name: str, replica_ids: Iterable[str]) -> None:
    with _lock:
        _live[app_name] = tuple(replica_ids)


def live_replicas(app_name: str) -> tuple[str, ...]:
    with _lock:
        return _live.get(app_name, ())
