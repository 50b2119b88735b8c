"""One shard group: S rank actors on one placement group, a cost-aware queue, teardown
(``core.ShardGroup``, a façade over its parts); the engine interface a Serve replica calls, which
the group implements (``engine.Engine``). The group's shared state is one object
(``state.GroupState``) that its parts receive: its rank actors (``ranks``), its scheduler
(``scheduler``) and the thread that runs it and answers the jobs (``loop``), lane widening
(``widening``), the replacement of a lost rank (``mend``), the warm-up (``warm_up``) and its
failure (``failure``); what enters its queue (``intake``), what it tells about itself
(``inspection``) and its requests' records (``records``) are functions of that state; its errors
(``errors``).

Plain Python, not Serve code: a notebook or a script can own a group directly, and the Serve
deployment wraps one group per replica.

Layer: Below the Serve front: may import rank, pipeline, runtime, variant, loading, sharding, config
and the shared modules; not serve or cli."""

from ray_hsdp.group.core import ShardGroup, check_placeable
from ray_hsdp.group.engine import Engine
from ray_hsdp.group.errors import (
    GroupBusyError,
    GroupFailedError,
    GroupOverloadedError,
    GroupUnplaceableError,
    QueueTimeoutError,
    remote_cause,
)
from ray_hsdp.group.scheduler import RequestRecord, pick_next

__all__ = [
    "Engine",
    "GroupBusyError",
    "GroupFailedError",
    "GroupOverloadedError",
    "GroupUnplaceableError",
    "QueueTimeoutError",
    "RequestRecord",
    "ShardGroup",
    "check_placeable",
    "pick_next",
    "remote_cause",
]
