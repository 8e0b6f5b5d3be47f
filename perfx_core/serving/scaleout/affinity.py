"""Rendezvous (highest-random-weight) hashing: which replica a prefix key belongs to. Every router computes the
same answer from the key and the replica ids alone, and when a replica comes or goes only the keys that rank it
first move."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def affinity_score(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest(), "big")


def rank_by_affinity(key: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` best first for ``key``."""
    return sorted(replica_ids, key=lambda rid: affinity_score(key, rid), reverse=True)
