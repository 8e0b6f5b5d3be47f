"""One /metrics for many engine replicas: each replica's Prometheus text, added up under the same names, with
a few series per replica so the spread of load can be seen.

- Counters and histograms (buckets, counts, sums) are summed; ``_created`` timestamps take the earliest.
- Gauges are summed (requests running, slots used and total, models loaded: so many replicas), except
  ``perfx_max_*``, which take the largest.
- Per replica: ``perfx_replica_info{replica, node, pid}`` (1), ``perfx_replica_requests_running{replica}`` and
  ``perfx_replica_requests_waiting{replica}``; ``perfx_replicas`` counts the replicas that answered.

A replica that goes away takes its counts with it: the sums can then go down, which Prometheus' ``rate()``
reads as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ReplicaMetrics:
    replica: str  # its Ray Serve replica id (the x-perfx-replica header)
    node: str  # the address of the node it runs on
    pid: int
    text: str  # its /metrics


def merge(replicas: Sequence[ReplicaMetrics], extra: Iterable[Metric] = ()) -> bytes:
    """The Prometheus text of ``replicas`` merged, then the per-replica series and ``extra`` families."""
    merged, running, waiting = _merge_texts(r.text for r in replicas)
    return render([*merged, *_per_replica(replicas, running, waiting), *extra])


def render(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _merge_texts(texts: Iterable[str]) -> tuple[list[Metric], dict[int, float], dict[int, float]]:
    """The merged families, and each text's (by index) requests running and waiting."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    running: dict[int, float] = {}
    waiting: dict[int, float] = {}
    for index, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            taken = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if sample.name == "perfx_requests_running":
                    running[index] = sample.value
                elif sample.name == "perfx_requests_waiting":
                    waiting[index] = sample.value
                if key not in taken:
                    taken[key] = sample.value
                elif sample.name.endswith("_created"):
                    taken[key] = min(taken[key], sample.value)
                elif family.type == "gauge" and family.name.startswith("perfx_max_"):
                    taken[key] = max(taken[key], sample.value)
                else:
                    taken[key] += sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values()), running, waiting


def _per_replica(
    replicas: Sequence[ReplicaMetrics], running: dict[int, float], waiting: dict[int, float]
) -> list[Metric]:
    count = Metric("perfx_replicas", "Engine replicas whose metrics are added up here", "gauge")
    count.add_sample("perfx_replicas", {}, float(len(replicas)))
    info = Metric("perfx_replica_info", "One series per engine replica: its id, node and process", "gauge")
    run = Metric("perfx_replica_requests_running", "Requests holding a KV-cache slot, per replica", "gauge")
    wait = Metric("perfx_replica_requests_waiting", "Requests queued for a slot, per replica", "gauge")
    for index, r in enumerate(replicas):
        info.add_sample(info.name, {"replica": r.replica, "node": r.node, "pid": str(r.pid)}, 1.0)
        run.add_sample(run.name, {"replica": r.replica}, running.get(index, 0.0))
        wait.add_sample(wait.name, {"replica": r.replica}, waiting.get(index, 0.0))
    return [count, info, run, wait]
