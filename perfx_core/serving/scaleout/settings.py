"""How many engine replicas, with what, on Ray Serve: validated once, before Ray is started."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgumentError

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


@dataclass(frozen=True)
class ReplicaSettings:
    replicas: int | None = None  # a fixed number of engine replicas (1 when neither this nor min/max is given)
    min_replicas: int | None = None  # with max_replicas: autoscaled on ongoing requests
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica, what autoscaling aims at; None: --max-running
    cpus: float = 1.0  # CPUs Ray reserves per replica (fractions pack several on one core)
    gpus: float | None = None  # GPUs per replica; None: one for a GPU backend where the cluster has GPUs
    ingress_replicas: int = 1  # the deployment that reads requests and routes them (no CPUs reserved)
    # More fields of Ray Serve's autoscaling_config (upscale_delay_s, downscale_delay_s, look_back_period_s...)
    autoscaling: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # environment variables of the engine replicas

    def __post_init__(self) -> None:
        if self.replicas is not None and (self.min_replicas is not None or self.max_replicas is not None):
            raise InvalidArgumentError("give either --replicas N or --min-replicas/--max-replicas, not both")
        for name in ("replicas", "min_replicas", "max_replicas", "ingress_replicas"):
            value = getattr(self, name)
            least = 0 if name == "min_replicas" else 1
            if value is not None and (not isinstance(value, int) or value < least):
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be an integer >= {least}; got {value!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InvalidArgumentError("autoscaling needs both --min-replicas and --max-replicas")
        if self.autoscaled and self.min_replicas > self.max_replicas:
            raise InvalidArgumentError(
                f"--min-replicas ({self.min_replicas}) must not exceed --max-replicas ({self.max_replicas})"
            )
        if not self.cpus > 0:
            raise InvalidArgumentError(f"replica-cpus must be > 0; got {self.cpus!r}")
        if self.gpus is not None and self.gpus < 0:
            raise InvalidArgumentError(f"replica-gpus must be >= 0; got {self.gpus!r}")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise InvalidArgumentError(f"target-ongoing-requests must be > 0; got {self.target_ongoing_requests!r}")

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None

    def thread_env(self, gpus: float) -> dict[str, str]:
        """Thread counts for a replica computing on the CPU: as many as the CPUs it was given (BLAS and numba
        would otherwise start a thread per core of the node, and replicas sharing a node would fight)."""
        if gpus > 0:
            return {}
        threads = str(max(1, int(self.cpus)))
        return {name: threads for name in THREAD_VARIABLES}
