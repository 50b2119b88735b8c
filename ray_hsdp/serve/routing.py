"""Serve's request router for shard groups: prefer replicas whose group is healthy, and never send
a retried request back to the replica whose group failed it."""

from __future__ import annotations

import random
from collections import deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

#: The group deployment's name where an application serves one model (several: one per model, named by it).
SERVER_NAME = "HSDPServer"

#: Keyword argument of the ingress' retried calls (``HSDPServer.generate``, ``create_video``,
#: ``adopt_video``) naming the replica whose group failed it or that a moved video job left.
AVOID_REPLICA = "avoid_replica"

#: Routing stat a replica reports: ``False`` while its shard group is failed or being rebuilt.
GROUP_OK = "group_ok"

#: Routing stat a replica reports: requests its group holds, queued or running, video jobs
#: included (Serve's own queue length misses a video job once its ``POST`` has returned).
GROUP_LOAD = "group_load"

#: How long a video job this router gave a replica counts as its load: two report periods
#: (``request_routing_stats_period_s`` is 1 s), by when the replica's own report holds it.
RECENT_S = 2.0


class GroupAwareRouter(RequestRouter):
    """Power of two choices over the replicas whose shard group is healthy and least loaded.

    Ranks the replicas in tiers: healthy ones whose group reported the least load (two picked at
    random, the shorter queue wins), the other healthy ones, then replicas that reported a failed
    group (a request there waits for or is refused by the rebuild), then the replica a retry must
    avoid: it is chosen only when no other can take the request, and then refuses it at once.
    Each request is assigned the replica chosen for it (no FIFO hand-over), so the avoidance holds
    per request. The load is what the group holds, video jobs included: a job's ``POST`` returns
    at once, so Serve's queue lengths alone would pile video jobs onto one group. A replica reports
    its load about once a second, and the report reaches the router later still: video jobs this
    router gave a replica within the last ``RECENT_S`` count as its load too, so a burst of jobs
    spreads over the groups (a job counted twice, reported and recent, only weighs more against
    the busier replica). Other requests stay in Serve's queue lengths while they run.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: Replica -> when it accepted video jobs from this router, oldest first (the last ``RECENT_S``).
        self._sent: dict[ReplicaID, deque[float]] = {}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Serve calls this when a replica accepted a request (its default, strict
        ``max_ongoing_requests``): a video job's creation or placement is remembered."""
        meta = pending_request.metadata
        if meta.call_method in ("create_video", "adopt_video"):  # the ingress' calls
            self._sent.setdefault(replica_id, deque()).append(self._get_curr_time_s())

    def _load(self, replica: RunningReplica) -> float:
        """The replica's reported load, plus the video jobs it accepted from this router within ``RECENT_S``."""
        sent = self._sent.get(replica.replica_id, deque())
        while sent and sent[0] < self._get_curr_time_s() - RECENT_S:
            sent.popleft()
        return (replica.routing_stats or {}).get(GROUP_LOAD, 0) + len(sent)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        avoid = pending_request.kwargs.get(AVOID_REPLICA) if pending_request is not None else None
        healthy, failing, avoided = [], [], []
        for replica in candidate_replicas:
            if avoid is not None and replica.replica_id.unique_id == avoid:
                avoided.append(replica)
            elif (replica.routing_stats or {}).get(GROUP_OK, True):
                healthy.append(replica)
            else:
                failing.append(replica)
        loads = {r.replica_id: self._load(r) for r in healthy}
        least = min(loads.values(), default=0)
        idle = [r for r in healthy if loads[r.replica_id] == least]
        busy = [r for r in healthy if loads[r.replica_id] != least]
        return [random.sample(tier, min(2, len(tier))) for tier in (idle, busy, failing, avoided) if tier]
