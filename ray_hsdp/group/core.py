"""One shard group: S rank actors on one placement group, a cost-aware queue, teardown.

``ShardGroup`` is the façade its callers hold: its state is one ``state.GroupState``, which its
parts receive (``ranks.RankActors``, ``scheduler.Scheduler`` and its thread ``loop.SchedulerLoop``,
``widening.Widening``, ``mend.Mend``, ``warm_up.WarmUp``); what it tells about itself is
``inspection``'s functions of that state, what enters its queue ``intake``'s.

Plain Python, not Serve code: a notebook or a script can own a group directly, and the Serve
deployment wraps one group per replica.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import ray
from ray.util.placement_group import PlacementGroup

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import inspection, intake, residency
from ray_hsdp.group.errors import GroupBusyError, GroupFailedError
from ray_hsdp.group.failure import fail
from ray_hsdp.group.loop import SchedulerLoop
from ray_hsdp.group.mend import Mend
from ray_hsdp.group.ranks import RankActors, check_placeable
from ray_hsdp.group.scheduler import Scheduler
from ray_hsdp.group.state import GroupState, resolve
from ray_hsdp.group.warm_up import WarmUp
from ray_hsdp.group.widening import Widening
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.variant import RequestVariant

__all__ = ["ShardGroup", "check_placeable"]

logger = logging.getLogger("ray_hsdp")


def _shared(name: str, doc: str) -> property:
    """The group's attribute ``name``, read and set in its state (every part sees a change)."""
    return property(lambda group: getattr(group.state, name), lambda group, v: setattr(group.state, name, v), doc=doc)


class ShardGroup:
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

    config = _shared("config", "Group configuration (its device resolved at the start).")
    dims = _shared("dims", "The pool's mesh arithmetic.")
    group_id = _shared("group_id", "This group's id: in its ranks' actor names and every request's log line.")
    labels = _shared("labels", "Said in each request's log line and in ``describe``.")
    listeners = _shared("listeners", "Called with a ``RequestRecord`` once per answered request (metrics).")
    lane_times = _shared("lane_times", "Seconds its requests ran, per lane size and work.")
    tick_model = _shared("tick_model", "A step's fixed part and its part that grows with the work.")
    lane_policy = _shared("lane_policy", "Adaptive lanes: which lane the first waiting request gets.")
    ranks = _shared("ranks", "The ranks' actor handles, by rank index.")
    placement = _shared("placement", "Where each rank runs (node, GPU, actor name, bundle).")
    pipeline_facts = _shared("pipeline_facts", "What the loaded pipeline tells its callers.")
    phases = _shared("phases", "Seconds per phase of its start.")
    rank_phases = _shared("rank_phases", "Seconds per phase of each rank's start.")
    warm_up_stats = _shared("warm_up_stats", "Each rank's ``tick_stats`` once its warm-up ran.")
    warm_up_record = _shared("warm_up_record", "The warm-up's record, per request warmed.")
    mend_refusal = _shared("mend_refusal", "Why it cannot replace a lost rank alone, or None.")
    mends = _shared("mends", "Each mend so far: the rank replaced and the seconds of its phases.")
    _cond = _shared("cond", "The lock of its state (the scheduler reads the measured times under it).")

    def __init__(
        self,
        config: GroupConfig,
        placement_group: PlacementGroup | None = None,
        dims: ParallelDims | None = None,
        labels: dict[str, str] | None = None,
        shares_gpus: bool = False,
    ):
        self.state = GroupState(config, dims or config.parallel_dims(), uuid.uuid4().hex[:8], dict(labels or {}))
        self._actors = RankActors(self.state, placement_group, shares_gpus)
        self._mend = Mend(self.state, self._actors)
        widening = Widening(self.state)
        self._loop = SchedulerLoop(self.state, Scheduler(self.state, widening), widening, self._mend)
        self._warm_up = WarmUp(self.state, self.shutdown)

    @property
    def shares_gpus(self) -> bool:
        """Its ranks share their GPUs with other models' groups (a GPU share's placement group, whose
        bundles each hold one GPU): each takes a sliver of its bundle's GPU and none of its CPUs."""
        return self._actors.shares_gpus

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
        state = self.state
        state.started = started = time.perf_counter()
        state.config = state.config.resolve_device(ray.cluster_resources().get("GPU", 0) > 0)
        try:
            self._actors.start()
        except BaseException:
            self.shutdown()
            raise
        for rank_index in range(len(state.ranks)):
            self._actors.watch(rank_index)
        self._loop.start()
        if warm_up and state.config.compile:
            self.compile_warm_up()
        state.phases.seconds["total"] = round(time.perf_counter() - started, 3)
        logger.info(
            "Shard group ready in %.1f s: %d ranks on %s, mode=%s",
            state.phases.seconds["total"],
            state.dims.shard_size,
            sorted({p["node_ip"] for p in state.placement}),
            state.config.mode,
        )
        return self

    def shutdown(self) -> None:
        """Fails queued and running requests, destroys the process group, kills the ranks,
        removes an owned placement group. Safe to call more than once."""
        state = self.state
        with state.cond:
            state.closed = True
            jobs = state.pending + [j for _, j in state.inflight.values()]
            state.pending, state.inflight = [], {}
            state.cond.notify_all()
        for job in jobs:
            resolve(job.future, error=GroupFailedError("the shard group was shut down before the request finished"))
        self._loop.join(timeout_s=30)
        self._actors.close()

    @property
    def _pg(self) -> PlacementGroup | None:
        """The placement group its ranks run in (``None`` before the start and once removed)."""
        return self._actors.placement_group

    @property
    def failure(self) -> str | None:
        """Why the group failed, or ``None`` while it is healthy."""
        return self.state.failure

    @property
    def mending(self) -> bool:
        """Whether a lost rank is being replaced now (requests wait in the queue meanwhile)."""
        return self.state.mending

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
        return intake.enqueue(self.state, request)

    def check(self, request: GenerationRequest) -> RequestVariant:
        """The request's variant: every per-request choice read and checked once
        (``RequestVariant.build``: the pairs of the table of refusals, each feature's field, the
        split of its tokens over a lane).

        Raises:
            InvalidRequestError: Naming the field and what to send instead
                (``UnsplittableRequestError`` for tokens that do not split over a lane).
        """
        return intake.check(self.state, request)

    @property
    def running_capacity(self) -> int:
        """Requests the ranks run at once: ``requests_per_rank`` per lane."""
        return self.state.running_capacity

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
        return intake.cancel(self.state, request_id)

    def warm_up(
        self,
        requests: Sequence[GenerationRequest],
        follow: Callable[[GenerationRequest, GenerationResult], None] | None = None,
    ) -> None:
        """Runs each request on every lane of the group (``warm_up.on_every_lane``; each copy under
        its own id), marked as the warm-up, then ``follow(request, result)`` with one of its results
        (a caller warms what follows the group: a response's encoding; not after a request of
        ``decode`` False, whose output is latents), all in the start's ``warm-up`` phase. A warm-up
        that fails shuts the group down: it would fail a user's request the same way."""
        self._warm_up.warm_up(requests, follow)

    def compile_warm_up(self) -> None:
        """Compiles each lane's first forwards with small requests (``warm_up.warm_up_requests``)."""
        self._warm_up.compile_warm_up()

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
        state = self.state
        with state.cond:
            if state.pending or state.inflight:
                raise GroupBusyError(
                    f"the shard group holds {len(state.pending) + len(state.inflight)} requests; it sleeps once "
                    "they are answered"
                )
            ranks = list(state.ranks)
        return residency.sleep_ranks(ranks, state.config.load_timeout_s)

    def wake(self) -> dict:
        """Copies every rank's weights back to its device (after ``sleep``); returns as ``sleep``."""
        with self.state.cond:
            ranks = list(self.state.ranks)
        return residency.wake_ranks(ranks, self.state.config.load_timeout_s)

    def fail(self, reason: str) -> None:
        """Marks the group failed from outside (its wake failed): its requests fail with ``reason``
        and its ranks are killed, as when a rank dies; its keeper rebuilds it."""
        fail(self.state, reason)

    # ---- inspection (``inspection``'s functions of the state) ------------------------------

    def memory(self, units: bool = False) -> list[dict]:
        """Each rank's memory report merged with where it runs."""
        return inspection.memory(self.state, units)

    def tick_stats(self) -> list[dict]:
        """Each rank's counts of ticks, ghost passes and batched calls since it loaded (and, with
        compile, of the graphs it compiled)."""
        return inspection.tick_stats(self.state)

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Starts every rank's profile window (tick log, request phases, GPU kernels)."""
        inspection.start_profile(self.state, trace_dir)

    def stop_profile(self) -> list[dict]:
        """Ends the profile windows; each rank's summary (see ``ray_hsdp.rank.profiling``)."""
        return inspection.stop_profile(self.state)

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Pings every rank with a deadline (``inspection.check_health``).

        Raises:
            GroupFailedError: The group is broken, or a rank died or did not answer in time (the
                group then fails, naming the rank).
        """
        inspection.check_health(self.state, self._mend.lost, timeout_s)

    def describe(self) -> dict:
        """Topology of this group: sizes, mode, device, where each rank runs, its start's phases."""
        return inspection.describe(self.state)

    def load(self) -> tuple[int, int]:
        """``(queued, running)``: requests waiting in the queue, and those the lanes run now."""
        return inspection.load(self.state)

    def idle_lanes(self) -> int:
        """Lanes where a request would start at once and alone, less the requests waiting for one
        (``inspection.idle_lanes``)."""
        return inspection.idle_lanes(self.state)

    def progress(self) -> dict[str, dict]:
        """Request id -> its state: queued, or running with its leader rank, lane, lane size, step,
        total and helpers (``inspection.progress``)."""
        return inspection.progress(self.state)
