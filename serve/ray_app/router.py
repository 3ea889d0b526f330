"""``BatchAwareRouter``: a Ray Serve request router that sends a request where it joins a batch.

A request runs in the same transformer forwards as the other live requests of its batch key on the
replica it lands on (continuous batching), so the best replica is one already running that key
with room left in its budget (``max_batch_size``). The order, per request:

1. replicas with live requests of the same routing key and fewer than their budget, the fullest
   batch first (then the least loaded);
2. otherwise replicas below their budget in total, the least loaded first;
3. otherwise every replica, the least loaded first (the request waits in that replica's queue).

So same-key requests go to one replica until its batch is full, then spread; a replica is never
handed more of one key than its budget while another has room. Ray Serve walks the ranks in order
and skips replicas at ``max_ongoing_requests``.

What a replica holds comes from two sources: the requests this router sent that have not completed
(exact and immediate), plus what each replica reports through ``record_routing_stats`` for requests
sent by other routers (e.g. other ingress replicas; up to ``routing_stats_period_s`` old). Requests
carry their routing key and their router's origin tag as keyword arguments (see ``client.py``).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger("ray.serve")


@dataclass
class _InFlight:
    replica: ReplicaID
    key: str
    pending: PendingRequest
    confirmed: bool = False  # Ray Serve reported it routed there (on_request_routed)


class BatchAwareRouter(RequestRouter):
    """See the module docstring. ``request_router_kwargs``: ``budget`` (requests per forward,
    used until a replica reports its own)."""

    def initialize_state(self, budget: int = 8, **kwargs) -> None:
        self.default_budget = budget
        self.inflight: dict[str, _InFlight] = {}  # internal request id -> where it went
        self.decisions: collections.Counter = collections.Counter()  # joined / open / overflow

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        key, origin = kwargs.get("route_key"), kwargs.get("origin")
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when every replica is full
        self._prune()
        if key is None:  # not a generation request: the least loaded replica
            return [sorted(candidate_replicas, key=lambda r: self._load(r, origin))]
        ranked, decision = self.rank(candidate_replicas, key, origin)
        self.decisions[decision] += 1
        iid = pending_request.metadata.internal_request_id
        self.inflight[iid] = _InFlight(ranked[0].replica_id, key, pending_request)
        return [[r] for r in ranked]

    def rank(self, replicas: list[RunningReplica], key: str, origin: str | None) -> tuple[list, str]:
        """Replicas in preference order for a request of routing ``key``, and which rule chose the first."""
        same = {r.replica_id: self._count(r, key, origin) for r in replicas}
        load = {r.replica_id: self._load(r, origin) for r in replicas}
        budget = {r.replica_id: self._budget(r, key) for r in replicas}
        joinable = sorted((r for r in replicas if 0 < same[r.replica_id] < budget[r.replica_id]),
                          key=lambda r: (-same[r.replica_id], load[r.replica_id]))
        rest = [r for r in replicas if r not in joinable]
        open_ = sorted((r for r in rest if load[r.replica_id] < budget[r.replica_id]),
                       key=lambda r: load[r.replica_id])
        full = sorted((r for r in rest if r not in open_), key=lambda r: load[r.replica_id])
        decision = "joined" if joinable else "open" if open_ else "overflow"
        return joinable + open_ + full, decision

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        entry = self.inflight.get(pending_request.metadata.internal_request_id)
        if entry is not None:
            entry.replica, entry.confirmed = replica_id, True

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.inflight.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for iid in [i for i, e in self.inflight.items() if e.replica == replica_id]:
            del self.inflight[iid]

    # ---- what a replica holds ----

    def _prune(self) -> None:
        """Forget requests that were cancelled before Ray Serve sent them anywhere."""
        for iid in [i for i, e in self.inflight.items() if not e.confirmed and e.pending.future.cancelled()]:
            del self.inflight[iid]

    def _mine(self, replica: RunningReplica, key: str | None) -> int:
        return sum(1 for e in self.inflight.values()
                   if e.replica == replica.replica_id and (key is None or e.key == key))

    def _reported(self, replica: RunningReplica, key: str | None, origin: str | None) -> int:
        """Live requests the replica reported that other routers (other origins) sent."""
        keys = (replica.routing_stats or {}).get("keys") or {}
        return sum(n for o, per_key in keys.items() if o != (origin or "")
                   for k, n in per_key.items() if key is None or k == key)

    def _count(self, replica: RunningReplica, key: str, origin: str | None) -> int:
        return self._mine(replica, key) + self._reported(replica, key, origin)

    def _load(self, replica: RunningReplica, origin: str | None) -> int:
        return self._mine(replica, None) + self._reported(replica, None, origin)

    def _budget(self, replica: RunningReplica, key: str) -> int:
        budgets = (replica.routing_stats or {}).get("budgets") or {}
        return int(budgets.get(key.split("|", 1)[0], self.default_budget))
