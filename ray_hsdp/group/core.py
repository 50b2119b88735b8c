"""One shard group: S rank actors on one placement group, a cost-aware queue, teardown.

Plain Python, not Serve code: a notebook or a script can own a group directly, and the Serve
deployment wraps one group per replica.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_hsdp import deadlines
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import PLACEMENT_STRATEGY, ParallelDims
from ray_hsdp.group import residency
from ray_hsdp.group.errors import GroupBusyError, GroupFailedError, GroupOverloadedError, GroupUnplaceableError
from ray_hsdp.group.inspection import GroupInspection
from ray_hsdp.group.lanes import LaneTimes, LeanLanes, TickModel
from ray_hsdp.group.mend import GroupMend
from ray_hsdp.group.records import GroupRecords
from ray_hsdp.group.scheduler import GroupScheduler, QueuedJob, RequestRecord, resolve
from ray_hsdp.group.warm_up import GroupWarmUp
from ray_hsdp.group.widening import GroupWidening
from ray_hsdp.phases import Phases
from ray_hsdp.rank.actor import CONCURRENCY_GROUPS, Rank
from ray_hsdp.request import GenerationRequest, GenerationResult, RequestCancelledError
from ray_hsdp.variant import RequestVariant

logger = logging.getLogger("ray_hsdp")

#: The share of its bundle's GPU a rank of a GPU share asks Ray for: any number of models' ranks fit
#: on one GPU, and Ray still gives each the bundle's GPU (its CUDA_VISIBLE_DEVICES).
SHARED_GPU = 0.01


def check_placeable(bundles: list[dict[str, float]]) -> None:
    """Fails at once when no alive node of the cluster has the resources of all of a group's
    bundles together, instead of leaving Ray to wait for a node that will never come.

    Raises:
        GroupUnplaceableError: With what a group needs, what the largest node has, and the fix.
    """
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if any(all(node.get(name, 0.0) >= amount for name, amount in need.items()) for node in nodes):
        return
    largest = max(nodes, key=lambda node: tuple(node.get(name, 0.0) for name in need), default={})
    have = ", ".join(f"{name}: {largest.get(name, 0.0):g}" for name in need)
    fixes = []
    if "GPU" in need and largest.get("GPU", 0.0) < need["GPU"]:
        fixes.append(f"a smaller shard_size (at most {int(largest.get('GPU', 0.0))})")
    elif largest.get("CPU", 0.0) < need.get("CPU", 0.0):
        fits = int(100 * largest.get("CPU", 0.0) / len(bundles)) / 100
        fixes.append(f"cpus_per_rank: {fits:g}" if fits > 0 else "a smaller shard_size")
    raise GroupUnplaceableError(
        f"a shard group needs {len(bundles)} x {bundles[0]} on one node; the largest node has {{{have}}} "
        f"(cluster: {ray.cluster_resources()}); set {' or '.join(fixes) or 'smaller bundles'}, or add a node "
        "that large"
    )


class ShardGroup(GroupScheduler, GroupWidening, GroupInspection, GroupRecords, GroupWarmUp, GroupMend):
    """S ranks that together hold one copy of the pipeline and run requests from one queue.

    The ranks form lanes (``ParallelDims``): a lane runs each of its requests on all its ranks
    (split by sequence and CFG parallel in combined mode; the whole request on every rank when
    replicated), its leader answers, and it takes the next queued request as soon as it has room.
    In ``batch`` mode without splits a lane is one rank. The tick protocol keeps any mix of
    requests on the lanes in lock step.

    Args:
        config: Group configuration.
        placement_group: A placement group of S bundles to place the ranks in (a Serve replica's
            own); when ``None`` the group creates one and removes it at shutdown.
        dims: The pool's mesh arithmetic; built from ``config`` when not given.
        labels: Said in each request's log line and in ``describe`` (a Serve replica passes its id).
        shares_gpus: ``placement_group`` is a GPU share's, whose GPUs other models' groups use too
            (``serve.replica.gpu_share``).

    Use ``start()`` (or a ``with`` block), then ``generate`` (blocking) or ``submit`` (a future).
    """

    def __init__(
        self,
        config: GroupConfig,
        placement_group: PlacementGroup | None = None,
        dims: ParallelDims | None = None,
        labels: dict[str, str] | None = None,
        shares_gpus: bool = False,
    ):
        self.config = config
        #: Its ranks share their GPUs with other models' groups (a GPU share's placement group, whose
        #: bundles each hold one GPU): each takes a sliver of its bundle's GPU and none of its CPUs.
        self.shares_gpus = shares_gpus
        self.dims = dims or config.parallel_dims()
        #: This group's id: in its ranks' actor names, their log prefixes and every request's log line.
        self.group_id = uuid.uuid4().hex[:8]
        self.labels = dict(labels or {})
        #: Called with a ``RequestRecord`` once per accepted request, when it is answered (metrics).
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self._tickets = itertools.count()
        #: Seconds its requests ran, per lane size and work (the serving order and the lane policy read it).
        self.lane_times = LaneTimes()
        #: A step's fixed part and its part that grows with the work (the neighbour rule reads it).
        self.tick_model = TickModel()
        #: Adaptive lanes: which lane the first waiting request gets (``lanes.LeanLanes``).
        self.lane_policy = LeanLanes(self.dims, config.requests_per_rank)
        self._pg = placement_group
        self._owns_pg = placement_group is None
        self.ranks: list = []
        self.placement: list[dict] = []
        #: What the loaded pipeline tells its callers (``ShardedPipeline.facts``).
        self.pipeline_facts: dict = {}
        #: Each rank's ``tick_stats`` once its warm-up ran (none ran: empty): what metrics count from.
        self.warm_up_stats: list[dict] = []
        self.warm_up_record: list[dict] = []  # ``GroupWarmUp``
        self._pending: list[QueuedJob] = []
        self._inflight: dict[ray.ObjectRef, tuple[int, QueuedJob]] = {}  # offer -> (rank index, job)
        self._sessions: dict[ray.ObjectRef, int] | None = None  # running session -> rank index
        self._sessions_done: set[ray.ObjectRef] = set()
        self._watchers: dict[ray.ObjectRef, int] = {}  # each rank's open ``watch`` call -> rank index
        self._loop_watches: dict[ray.ObjectRef, QueuedJob] = {}  # a widened request's ``denoised`` call -> it
        # Offers and sessions that completed, as Ray reports them; the scheduler handles them.
        self._events: deque[tuple[str, ray.ObjectRef, Future]] = deque()
        self._wake = False  # a request was submitted
        # (rank index, request id) of the cancels to send: sent by the scheduler thread, never by the
        # caller's. A caller is often a Serve request being cancelled, and Ray's cancel of a task
        # reaches the tasks it submitted (``recursive``): a rank's cancel sent from it was seen
        # dropped before it ran, and the request ran all its steps.
        self._cancels: list[tuple[int, str]] = []
        self._cond = threading.Condition()
        self._scheduler: threading.Thread | None = None
        self._failure: str | None = None
        self._closed = False
        self.phases = Phases(f"group {self.group_id}")
        self._started = time.perf_counter()  # (again at ``start``) what the start's total counts from
        self.rank_phases: list[dict[str, float]] = []
        self._init_mend()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, warm_up: bool = True) -> ShardGroup:
        """Places the ranks, forms the process group, loads and shards the pipeline, starts intake.

        Args:
            warm_up: With ``compile``, compile each lane's first forwards with small requests before
                the group serves (``compile_warm_up``). A caller that warms the shapes its users
                send (``warm_up``: a Serve replica) leaves this out.
        """
        if not ray.is_initialized():
            ray.init()
        self._started = started = time.perf_counter()
        self.config = self.config.resolve_device(ray.cluster_resources().get("GPU", 0) > 0)
        bundles = self.dims.bundles(self.config.device, self.config.cpus_per_rank)
        try:
            with self.phases.phase("placement"):
                if self._pg is None:
                    check_placeable(bundles)
                    self._pg = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
                if not self._pg.wait(timeout_seconds=self.config.rendezvous_timeout_s):
                    raise GroupFailedError(
                        f"could not place {self.dims.shard_size} ranks of {bundles[0]} on one node within "
                        f"{self.config.rendezvous_timeout_s:.0f}s (cluster resources: {ray.available_resources()})"
                    )
            self._spawn_and_join()
            with self.phases.phase("load"):
                reports = ray.get([r.load.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
            self.pipeline_facts = reports[0]["pipeline"]
            self.mend_refusal = reports[0]["mend_refusal"]
            if self.shares_gpus:
                # Its other ranks may be asleep when one is lost: the group is rebuilt whole.
                self.mend_refusal = self.mend_refusal or "the group is on a GPU share (its ranks may sleep)"
            self.rank_phases = [r["start_phases_s"] for r in reports]
        except BaseException:
            self.shutdown()
            raise
        for rank_index in range(len(self.ranks)):
            self._watch_rank(rank_index)
        self._scheduler = threading.Thread(target=self._schedule, name="ray_hsdp-scheduler", daemon=True)
        self._scheduler.start()
        if warm_up and self.config.compile:
            self.compile_warm_up()
        self.phases.seconds["total"] = round(time.perf_counter() - started, 3)
        logger.info(
            "Shard group ready in %.1f s: %d ranks on %s, mode=%s",
            self.phases.seconds["total"],
            self.dims.shard_size,
            sorted({p["node_ip"] for p in self.placement}),
            self.config.mode,
        )
        return self

    def _spawn_rank(self, index: int, spawned_at: float):
        """Rank ``index``'s actor in bundle ``index`` of the group's placement group."""
        bundle = self.dims.bundles(self.config.device, self.config.cpus_per_rank)[index]
        if self.shares_gpus:
            bundle = {"CPU": 0, "GPU": SHARED_GPU if "GPU" in bundle else 0}
        return (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Rank)
            .options(
                name=self._rank_name(index),
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=index
                ),
            )
            .remote(index, self.config, self.dims, self.group_id, spawned_at)
        )

    def _rank_name(self, index: int) -> str:
        """Rank ``index``'s actor name (``ray list actors`` tells the ranks of each group apart by
        it); a replacement's has its mend's number, as Ray may not have freed the lost one's yet."""
        return f"ray_hsdp-{self.group_id}-rank{index}" + (f"-mend{len(self.mends) + 1}" if self.mending else "")

    def _watch_rank(self, index: int) -> None:
        """Keeps rank ``index``'s ``watch`` call open: Ray tells the scheduler at once of its death."""
        watch = self.ranks[index].watch.remote()
        self._watchers[watch] = index
        self._watch("rank", watch)

    def _spawn_and_join(self) -> None:
        names = [self._rank_name(i) for i in range(self.dims.shard_size)]
        with self.phases.phase("rank processes and imports"):
            spawned_at = time.time()  # each rank's "actor start" counts from it
            self.ranks = [self._spawn_rank(i, spawned_at) for i in range(self.dims.shard_size)]
            ray.get([r.prepare.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
        # Rank 0 binds its rendezvous store first and hands out the port it holds: no port race.
        master, port = ray.get(self.ranks[0].address.remote(), timeout=self.config.rendezvous_timeout_s)
        with self.phases.phase("rendezvous"):
            joined = ray.get(
                [r.join.remote(master, port) for r in self.ranks], timeout=self.config.rendezvous_timeout_s
            )
        self.placement = [
            {**place, "actor_name": name, "bundle": i} for i, (place, name) in enumerate(zip(joined, names))
        ]

    def _kill_ranks(self) -> None:
        ranks, self.ranks = self.ranks, []
        for r in ranks:
            ray.kill(r, no_restart=True)

    def shutdown(self) -> None:
        """Fails queued and running requests, destroys the process group, kills the ranks,
        removes an owned placement group. Safe to call more than once."""
        with self._cond:
            self._closed = True
            jobs = self._pending + [j for _, j in self._inflight.values()]
            self._pending, self._inflight = [], {}
            self._cond.notify_all()
        for job in jobs:
            resolve(job.future, error=GroupFailedError("the shard group was shut down before the request finished"))
        if self._scheduler is not None and self._scheduler is not threading.current_thread():
            self._scheduler.join(timeout=30)
        if self.ranks:
            if self._failure is None:
                try:
                    ray.get([r.leave.remote() for r in self.ranks], timeout=30)
                except Exception as err:  # noqa: BLE001 - a dead rank cannot leave; it is killed below anyway
                    logger.warning("Ranks did not leave cleanly: %s", err)
            self._kill_ranks()
        if self._pg is not None and self._owns_pg:
            remove_placement_group(self._pg)
            self._pg = None

    @property
    def failure(self) -> str | None:
        """Why the group failed, or ``None`` while it is healthy."""
        return self._failure

    def __enter__(self) -> ShardGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------

    def submit(self, request: GenerationRequest | RequestVariant) -> Future:
        """Queues a request, or the variant ``check`` made of it (a caller that checked it: built
        once); the future resolves to its ``GenerationResult`` or the error that ended it, exactly once.

        Raises:
            GroupFailedError: The group is shut down or broken.
            GroupOverloadedError: Every rank is busy and ``max_queue`` requests are already waiting.
            InvalidRequestError: The group cannot run what the request asks (see ``check``).
        """
        return self._enqueue(request)

    def _enqueue(self, ask: GenerationRequest | RequestVariant, warm_up: bool = False) -> Future:
        """``submit``; a ``warm_up`` request (the compile warm-up) is logged, but no listener hears of it."""
        variant = ask if isinstance(ask, RequestVariant) else self.check(ask)
        request = variant.request
        future: Future = Future()
        with self._cond:
            if self._closed or self._failure:
                raise GroupFailedError(self._failure or "the shard group is shut down")
            running = len({id(job) for _, job in self._inflight.values()})
            if len(self._pending) + running >= self.running_capacity + self.config.max_queue:
                raise GroupOverloadedError(
                    f"the shard group's queue is full: {running} requests running, {len(self._pending)} waiting "
                    f"(max_queue={self.config.max_queue}); retry later"
                )
            deadline = deadlines.queue_deadline(request, self.config)
            job = QueuedJob(variant, future, time.monotonic(), deadline, warm_up=warm_up)
            self._pending.append(job)
            self._wake = True
            self._cond.notify_all()
        future.add_done_callback(lambda done: self._record(job, done))
        return future

    def check(self, request: GenerationRequest) -> RequestVariant:
        """The request's variant: every per-request choice read and checked once
        (``RequestVariant.build``: the pairs of the table of refusals, each feature's field, the
        split of its tokens over a lane).

        Raises:
            InvalidRequestError: Naming the field and what to send instead
                (``UnsplittableRequestError`` for tokens that do not split over a lane).
        """
        return RequestVariant.build(request, self.config, self.pipeline_facts)

    @property
    def running_capacity(self) -> int:
        """Requests the ranks run at once: ``requests_per_rank`` per lane."""
        return self.dims.num_lanes * self.config.requests_per_rank

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Runs requests through the queue and waits for all of them, in the order given."""
        return [f.result() for f in [self.submit(r) for r in requests]]

    def cancel(self, request_id: str) -> bool:
        """Cancels a request: a queued one is dropped, a running one stops at the end of its
        current denoising step without decoding (its lock step is not broken: the other ranks
        just stop seeing its forwards). Its future fails with ``RequestCancelledError``.

        Returns:
            Whether the group held the request.
        """
        with self._cond:
            queued = [j for j in self._pending if j.request.request_id == request_id]
            self._pending = [j for j in self._pending if j.request.request_id != request_id]
            # The leader decides for its lane: it stops the request on all the lane's ranks at one tick.
            holders = {
                i for i, j in self._inflight.values() if j.request.request_id == request_id and i == j.ranks.start
            }
            if holders:
                self._cancels.extend((rank_index, request_id) for rank_index in holders)
                self._cond.notify_all()
        for job in queued:
            resolve(job.future, error=RequestCancelledError(f"request {request_id!r} was cancelled while queued"))
        return bool(queued or holders)

    # ---- sleep and wake --------------------------------------------------------------------

    def sleep(self) -> dict:
        """Parks every rank's weights in host memory and gives their device memory back
        (``group.residency``); the ranks, their communicators and compiled graphs stay. The next
        request wakes the ranks it runs on; ``wake`` wakes them all at once.

        Returns:
            The seconds it took, the most bytes a rank parked, each rank's report.

        Raises:
            GroupBusyError: The group holds requests (queued or running).
        """
        with self._cond:
            if self._pending or self._inflight:
                raise GroupBusyError(
                    f"the shard group holds {len(self._pending) + len(self._inflight)} requests; it sleeps once "
                    "they are answered"
                )
            ranks = list(self.ranks)
        return residency.sleep_ranks(ranks, self.config.load_timeout_s)

    def wake(self) -> dict:
        """Copies every rank's weights back to its device (after ``sleep``); returns as ``sleep``."""
        with self._cond:
            ranks = list(self.ranks)
        return residency.wake_ranks(ranks, self.config.load_timeout_s)

    def fail(self, reason: str) -> None:
        """Marks the group failed from outside (its wake failed): its requests fail with ``reason``
        and its ranks are killed, as when a rank dies; its keeper rebuilds it."""
        self._fail(reason)

    # ---- inspection ------------------------------------------------------------------------
