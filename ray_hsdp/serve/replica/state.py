"""What the parts of a replica (``HSDPServer``: its request path ``requests.GroupRequests``, its video
jobs ``videos.VideoJobs``, its metrics poll) share: one ``ReplicaState``, handed to each part, and
the reads of it (its group's state, its load, its metrics' poll) as functions of it."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field

import ray

from ray_hsdp.config.app import AppConfig
from ray_hsdp.group import Engine, GroupFailedError
from ray_hsdp.serve.errors import UnknownModelError
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.replica.keeper import GroupKeeper
from ray_hsdp.serve.replica.metrics import ReplicaMetrics
from ray_hsdp.serve.replica.share_member import ShareMember

logger = logging.getLogger("ray_hsdp")

#: How many ids of cancelled requests a replica remembers (ids are unique: a bounded memory is enough).
CANCELLED_KEPT = 4096


@dataclass(eq=False)
class ReplicaState:
    """One replica's state, as its parts share it.

    Attributes:
        config: The model's configuration.
        replica: Serve's id of this replica (what a retry of a request it failed avoids).
        pool: The job store's name of this deployment: its released and waiting jobs move only
            among its groups.
        metrics: What the replica exports.
        store: The cluster's video job store, found at its first use (an ingress starts it).
        share: The model's place in its GPU share (``gpu_share``): its ranks go in the share's
            placement group, its load waits for room and each request holds it awake; None: GPUs
            of its own.
        keeper: The group and its rebuilds; None while the group is starting.
        videos: Video id -> the task that runs it here (a drain releases those left).
        attempts: Video id -> the attempt of it that runs here (every report carries it).
        cancelled: Ids this replica cancelled lately: a request waiting for its group's rebuild
            or its model's wake is never handed to the group.
        draining: Serve removes the replica: it takes no new job.
        stopping: Set once the replica stops: its background loops end.
    """

    config: AppConfig
    replica: str
    pool: str
    metrics: ReplicaMetrics
    store: StoreClient
    share: ShareMember | None = None
    keeper: GroupKeeper | None = None
    videos: dict[str, asyncio.Task] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    cancelled: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=CANCELLED_KEPT))
    draining: bool = False
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def group(self) -> Engine:
        """The replica's current shard group (failed or not)."""
        return self.keeper.group


def group_state(state: ReplicaState) -> str:
    """The group's state, one of ``GROUP_STATES``."""
    if state.draining:
        return "draining"
    if state.keeper is None:
        return "starting"
    if state.keeper.broken:
        return "failed"
    if not state.keeper.ready:
        return "rebuilding"
    if state.share is not None and (shared := state.share.state()["state"]) in ("sleeping", "waking"):
        return shared
    return "serving"


def group_load(state: ReplicaState) -> int:
    """Requests the group holds, queued or running, video jobs included; while the group is
    rebuilt, the video jobs waiting for it."""
    load = len(state.videos)
    if state.keeper is not None and state.keeper.ready:
        load = max(load, sum(state.keeper.group.load()))
    return load


def check_model(state: ReplicaState, model: str | None) -> None:
    """Refuses a request that names another model than this replica's."""
    if model is not None and model != state.model_name:
        raise UnknownModelError(f"model {model!r} is not served here; available: [{state.model_name!r}]")


def refusal(state: ReplicaState, message: str) -> GroupFailedError:
    """A refusal the ingress retries on another group: it names this replica, the one to avoid."""
    error = GroupFailedError(message)
    error.replica = state.replica
    return error


def forget_stop(state: ReplicaState, request_id: str) -> None:
    """A stop of an earlier copy of ``request_id`` here no longer applies (a new attempt of its job runs)."""
    while request_id in state.cancelled:
        state.cancelled.remove(request_id)


def report_metrics(state: ReplicaState) -> None:
    """Every ``metrics_interval_s`` until the replica stops: the group's state, queue and ranks, its
    failures, the job table (a thread of its own: a poll blocks)."""
    while not state.stopping.wait(state.config.metrics_interval_s):
        try:
            state.metrics.state(group_state(state), group_load(state))
            if state.keeper is None:
                continue
            if state.keeper.ready:
                group = state.keeper.group
                state.metrics.group(group.group_id, *group.load(), group.tick_stats(), group.warm_up_stats)
            state.metrics.keeper(state.keeper.failures, state.keeper.rebuilds)
            if state.share is not None:
                shared = state.share.state()
                state.metrics.sleeping(shared.get("node") or "", shared.get("parked_bytes", 0))
            if (store := state.store.cached()) is not None:
                counts = ray.get(store.counts.remote(), timeout=state.config.metrics_interval_s)
                state.metrics.video_jobs(counts)
        except Exception as err:  # noqa: BLE001 - a missed poll is reported again at the next one
            logger.warning("Metrics poll failed: %s", err)
