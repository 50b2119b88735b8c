"""Serve's request router for shard groups: prefer replicas whose group is healthy, and never send
a retried request back to the replica whose group failed it."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

#: Keyword argument of ``HSDPServer.run_request`` and ``adopt_video`` naming the replica a retried
#: request or a moved video job must avoid.
AVOID_REPLICA = "avoid_replica"

#: Routing stat a replica reports: ``False`` while its shard group is failed or being rebuilt.
GROUP_OK = "group_ok"

#: Routing stat a replica reports: requests its group holds, queued or running, video jobs
#: included (Serve's own queue length misses a video job once its ``POST`` has returned).
GROUP_LOAD = "group_load"


class GroupAwareRouter(RequestRouter):
    """Power of two choices over the replicas whose shard group is healthy and least loaded.

    Ranks the replicas in tiers: healthy ones whose group reported the least load (two picked at
    random, the shorter queue wins), the other healthy ones, then replicas that reported a failed
    group (a request there waits for or is refused by the rebuild), then the replica a retry must
    avoid: it is chosen only when no other can take the request, and then refuses it at once.
    Each request is assigned the replica chosen for it (no FIFO hand-over), so the avoidance holds
    per request. The load is what the group holds, video jobs included: a job's ``POST`` returns
    at once, so Serve's queue lengths alone would pile video jobs onto one group.
    """

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
        least = min((_load(r) for r in healthy), default=0)
        idle = [r for r in healthy if _load(r) == least]
        busy = [r for r in healthy if _load(r) != least]
        return [random.sample(tier, min(2, len(tier))) for tier in (idle, busy, failing, avoided) if tier]


def _load(replica: RunningReplica) -> float:
    return (replica.routing_stats or {}).get(GROUP_LOAD, 0)
