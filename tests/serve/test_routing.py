"""The request router of shard groups (``GroupAwareRouter``), on Serve's own replica wrappers."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.request_router import PendingRequest, RunningReplica

from ray_hsdp.serve.routing import GROUP_LOAD, GROUP_OK, RECENT_S, GroupAwareRouter

DEPLOYMENT = DeploymentID(name="HSDPServer", app_name="routing-test")


@ray.remote(num_cpus=0)
class Replica:
    """Stands where a Serve replica's actor stands: the router only needs its handle."""


@pytest.fixture(scope="module")
def replica_names(ray_cluster):
    names = [f"routing-test-{i}" for i in range(2)]
    actors = [Replica.options(name=name, namespace=SERVE_NAMESPACE).remote() for name in names]
    yield names
    for actor in actors:
        ray.kill(actor)


def running(name: str, load: int) -> RunningReplica:
    info = RunningReplicaInfo(
        replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT),
        node_id=None, node_ip=None, availability_zone=None, actor_name=name, max_ongoing_requests=8,
        routing_stats={GROUP_OK: True, GROUP_LOAD: load},
    )  # fmt: skip
    return RunningReplica(info)


async def first_tier(router: GroupAwareRouter) -> set[str]:
    tiers = await router.choose_replicas(list(router.curr_replicas.values()))
    return {replica.replica_id.unique_id for replica in tiers[0]}


def routed(router: GroupAwareRouter, name: str, call_method: str = "create_video") -> None:
    """``name``'s replica accepted a call of ``call_method`` from the ingress (Serve's callback after the send)."""
    meta = RequestMetadata(request_id=call_method, internal_request_id=call_method, call_method=call_method)
    replica = next(replica for replica in router.curr_replicas if replica.unique_id == name)
    router.on_request_routed(PendingRequest(args=[], kwargs={}, metadata=meta), replica, None)


def test_requests_this_router_sent_count_as_load_until_the_replica_s_report_holds_them(replica_names):
    a, b = replica_names
    now = [1000.0]

    async def scenario():  # Serve runs its router on an event loop
        router = GroupAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: now[0])
        router.update_replicas([running(a, 0), running(b, 0)])
        assert await first_tier(router) == {a, b}
        # Calls that end before they return leave the choice as it was...
        for _ in range(3):
            routed(router, a, call_method="pool")
            routed(router, a, call_method="generate")
        assert await first_tier(router) == {a, b}
        # ...a video job's creation returns at once: the next one, before a report holds it, goes elsewhere.
        routed(router, a)
        assert await first_tier(router) == {b}
        now[0] += 1.0
        router.update_replicas([running(a, 0), running(b, 0)])  # a report taken before the job arrived
        assert await first_tier(router) == {b}
        routed(router, b)
        assert await first_tier(router) == {a, b}
        # Past RECENT_S the replicas' reports speak alone.
        now[0] += RECENT_S + 0.5
        router.update_replicas([running(a, 1), running(b, 0)])
        assert await first_tier(router) == {b}
        routed(router, b)
        assert await first_tier(router) == {a, b}

    asyncio.run(scenario())
