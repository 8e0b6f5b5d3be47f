"""The engine deployment's request router (Ray Serve's custom request router API): prefix-affine, with the
least-loaded replica as the fallback.

A request carrying a prefix key (``prefix_key.prefix_key``) goes to the replica that rendezvous hashing picks for
that key (the highest hash of key and replica id) while that replica has a free KV-cache slot or is no busier
than any other, so a conversation stays where its prefix is cached; otherwise it goes to the less loaded of the
two least-loaded replicas. Rendezvous hashing needs no shared state: every router (one per ingress replica, on
any node) maps a key to the same replica, and when replicas come or go only the keys of those replicas move.
Requests without a key take the less loaded of two random replicas (power of two choices, Serve's default).

Loads are Serve's counts of requests ongoing at each replica (queue-length cache, probed where missing, as
Ray's own PrefixCacheAffinityRouter does). Serve pickles this module by value into every process that routes:
it keeps no state of its own.
A request may also name one replica (``replica_id=``): the ingress asks every replica for /health and /metrics.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# Modules, so pickled by name: the process's own registry (see its docstring), and the hashing the tests check.
from . import affinity, live_replicas

KEY_ARG = "prefix_key"
TARGET_ARG = "replica_id"


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, slots: int = 8) -> None:
        self._slots = slots  # a replica's KV-cache slots (--max-running): below that many ongoing, one is free

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        live_replicas.publish(self.app_name, (rid.unique_id for rid in self.curr_replicas))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            # No tiers of candidates to go through first: when every one is full, wait before trying again.
            pending_request.routing_context.should_backoff = True
        target = kwargs.get(TARGET_ARG)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        key = kwargs.get(KEY_ARG)
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in affinity.rank_by_affinity(key, list(by_id))]
        loads = await self._loads(candidate_replicas)
        affine = ranked[0]
        if loads[affine.replica_id] < self._slots or loads[affine.replica_id] <= min(loads.values()):
            return [[affine], ranked[1:]]  # the rest only if the affine one turns out to be full
        return [sorted(candidate_replicas, key=lambda r: loads[r.replica_id])[:2]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict:
        """Requests ongoing per replica id: from Serve's cache, probing the replicas it has no fresh count of
        (one that does not answer counts as fully loaded)."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                loads[replica.replica_id] = queue_len
        return {rid: (n if n is not None else float("inf")) for rid, n in loads.items()}
