"""A group's shared state (``GroupState``): what its parts (the scheduler and its thread, the
widening, the mend, the warm-up, the rank actors) read and change, in one object that each of them
receives, under one lock; and the queued job (``QueuedJob``) that moves through it.

The parts hold no copy of what is here: a caller that replaces a member (``lane_times`` in a test,
``config`` at the start) changes what every part reads next."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import ray

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group.lanes import LaneTimes, LeanLanes, TickModel
from ray_hsdp.phases import Phases
from ray_hsdp.request import GenerationRequest
from ray_hsdp.variant import RequestVariant


def resolve(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Answers ``future`` unless it was answered already (every path may try; the first wins)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


@dataclass
class QueuedJob:
    variant: RequestVariant  # takes its ticket when a lane takes it
    future: Future
    enqueued: float
    deadline: float  # time.time() by which a lane must take it (its queue_deadline)
    taken: float | None = None  # when a lane took it
    lane: int | None = None  # the lane's index among the group's lanes of its size
    ranks: range = range(0)  # the lane's ranks; the first leads it
    tick_work: float = 0.0  # adaptive lanes: the busiest rank's work once it was taken (TickModel)
    wide: range = range(0)  # lane widening: the wider lane its forwards run on while helped
    helpers: tuple[int, ...] = ()  # the ranks of ``wide`` that help it now
    widened_to: int | None = None  # the size of the wider lane it was given, once widened
    warm_up: bool = False  # a compiled group's warm-up at its start: not a user's request

    @property
    def request(self) -> GenerationRequest:
        return self.variant.request


@dataclass(eq=False)
class GroupState:
    """One group's state: what it is (configuration, mesh, id), what it learnt (lane times, tick
    model), its ranks, its queue and running jobs, what Ray reported, and whether it failed.
    Members under ``cond`` are read and changed with it held."""

    config: GroupConfig
    dims: ParallelDims
    #: This group's id: in its ranks' actor names, their log prefixes and every request's log line.
    group_id: str
    #: Said in each request's log line and in ``describe`` (a Serve replica passes its id).
    labels: dict[str, str]
    #: Called with a ``RequestRecord`` once per accepted request, when it is answered (metrics).
    listeners: list[Callable] = field(default_factory=list)
    #: Seconds its requests ran, per lane size and work (the serving order and the lane policy read it).
    lane_times: LaneTimes = field(default_factory=LaneTimes)
    #: A step's fixed part and its part that grows with the work (the neighbour rule reads it).
    tick_model: TickModel = field(default_factory=TickModel)
    #: Adaptive lanes: which lane the first waiting request gets (``lanes.LeanLanes``).
    lane_policy: LeanLanes = field(init=False)
    #: The ranks' actor handles, by rank index, and where each runs.
    ranks: list = field(default_factory=list)
    placement: list[dict] = field(default_factory=list)
    #: What the loaded pipeline tells its callers (``ShardedPipeline.facts``).
    pipeline_facts: dict = field(default_factory=dict)
    #: Seconds per phase of the start, the group's and each rank's.
    phases: Phases = field(init=False)
    rank_phases: list[dict[str, float]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # what the start's total counts from
    #: Each rank's ``tick_stats`` once its warm-up ran (none ran: empty): what metrics count from.
    warm_up_stats: list[dict] = field(default_factory=list)
    #: The warm-up's own record, per request warmed (``warm_up.WarmUp``).
    warm_up_record: list[dict] = field(default_factory=list)
    #: The group's warm-up, run again after a mend with ``compile``: the new rank loads its graphs
    #: from the compile cache there rather than in a user's request.
    rewarm: Callable[[], None] | None = None
    #: Why this group cannot replace a lost rank alone (``ray_hsdp.rank.start.mend_refusal``), or None.
    mend_refusal: str | None = "the group has not started"
    #: Each mend so far: the rank replaced and the seconds of its phases.
    mends: list[dict] = field(default_factory=list)
    #: The rank being replaced now, or None.
    mending_rank: int | None = None
    tickets: itertools.count = field(default_factory=itertools.count)
    pending: list[QueuedJob] = field(default_factory=list)
    inflight: dict[ray.ObjectRef, tuple[int, QueuedJob]] = field(default_factory=dict)  # offer -> (rank, job)
    sessions: dict[ray.ObjectRef, int] | None = None  # running session -> rank index
    sessions_done: set[ray.ObjectRef] = field(default_factory=set)
    watchers: dict[ray.ObjectRef, int] = field(default_factory=dict)  # each rank's open ``watch`` call -> rank
    loop_watches: dict[ray.ObjectRef, QueuedJob] = field(default_factory=dict)  # a widened job's ``denoised``
    #: Offers and sessions that completed, as Ray reports them; the scheduler thread handles them.
    events: deque[tuple[str, ray.ObjectRef, Future]] = field(default_factory=deque)
    wake: bool = False  # a request was submitted
    #: (rank index, request id) of the cancels to send: sent by the scheduler thread, never by the
    #: caller's. A caller is often a Serve request being cancelled, and Ray's cancel of a task
    #: reaches the tasks it submitted (``recursive``): a rank's cancel sent from it was seen
    #: dropped before it ran, and the request ran all its steps.
    cancels: list[tuple[int, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    failure: str | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.lane_policy = LeanLanes(self.dims, self.config.requests_per_rank)
        self.phases = Phases(f"group {self.group_id}")

    @property
    def mending(self) -> bool:
        """Whether a lost rank is being replaced now (requests wait in the queue meanwhile)."""
        return self.mending_rank is not None

    @property
    def running_capacity(self) -> int:
        """Requests the ranks run at once: ``requests_per_rank`` per lane."""
        return self.dims.num_lanes * self.config.requests_per_rank

    def watch(self, kind: str, ref: ray.ObjectRef) -> None:
        """Hands ``ref``'s completion to the scheduler thread (Ray calls back; nothing polls)."""

        def completed(future: Future) -> None:
            with self.cond:
                self.events.append((kind, ref, future))
                self.cond.notify_all()

        ref.future().add_done_callback(completed)

    def running_jobs(self) -> dict[int, tuple[QueuedJob, list[int]]]:
        """id -> (job, the ranks that still hold it) of the requests the lanes run now (lock held)."""
        holders: dict = {}
        for rank_index, job in self.inflight.values():
            holders.setdefault(id(job), (job, []))[1].append(rank_index)
        return holders

    def helping_ranks(self) -> list[int]:
        """The ranks that help a widened request now (lock held)."""
        return [rank for job, _ in self.running_jobs().values() for rank in job.helpers]
