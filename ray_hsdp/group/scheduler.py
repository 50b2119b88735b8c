"""The group's scheduler (``ShardGroup``, whose state it runs on): its queue of jobs, the choice
of the next one for a free lane, the hand-over to the lane's ranks, and every way a job is
answered (a result, its own error, a queue deadline, the group's failure)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import ray

from ray_hsdp.group.errors import GroupFailedError, QueueTimeoutError, died, remote_cause
from ray_hsdp.group.lanes import LaneAsk, LaneRoom, LockStep, Waiting, as_fast, queue_keeps_up, serving_order
from ray_hsdp.protocol import lane_ticket
from ray_hsdp.request import GenerationRequest
from ray_hsdp.runtime import SessionFailedError
from ray_hsdp.variant import RequestVariant

logger = logging.getLogger("ray_hsdp")

# A survivor's collective breaks the moment a peer dies, often before Ray reports the death;
# this long a failed session waits for that report so that the reason names the dead rank.
_DEATH_REPORT_GRACE_S = 2.0


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


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one accepted request: one per request, on every path.

    Attributes:
        request_id: The request's id.
        status: ``ok``, ``cancelled``, ``error`` (its own: bad input, deadline) or ``failed`` (its
            group failed under it).
        steps: Denoising steps it asked for.
        queued_s: Seconds in the group's queue (to its end when it never left the queue).
        run_s: Seconds from a lane taking it to its answer; ``None`` when it never ran.
        lane: The lane that ran it, and ``rank`` its leader (the rank that answered);
            ``lane_size`` its ranks.
        step_s: Mean seconds per denoising step, as the rank measured them.
        before_loop_s: Seconds the leader ran before the denoising loop (encodings, and ticks it
            waited for), and ``after_loop_s`` after it (the decode); ``GenerationResult``'s.
        error: The error's type and first line, when it did not succeed.
        widened_to: The size of the wider lane its forwards ran on for a while (``lane_widening``),
            when it was widened.
        compiled: Whether ``torch.compile`` built graphs while it ran (``GenerationResult.compiled``):
            its times are not the group's pace.
    """

    request_id: str
    status: str
    steps: int
    queued_s: float
    run_s: float | None = None
    lane: int | None = None
    rank: int | None = None
    lane_size: int | None = None
    step_s: float | None = None
    before_loop_s: float | None = None
    after_loop_s: float | None = None
    error: str | None = None
    widened_to: int | None = None
    compiled: bool = False


def pick_next(
    pending: Sequence[GenerationRequest],
    waited_s: float,
    running: Sequence[GenerationRequest],
    lookahead: int,
    max_skip_s: float,
) -> int | None:
    """Index of the queued request a free rank should take next.

    Ranks in lock step wait for the slowest forward of each tick, so a free rank takes, among the
    first ``lookahead`` queued requests, the one whose per-forward cost is closest to what the
    other ranks are running (ties: the oldest). The oldest request is taken regardless once it
    has waited ``max_skip_s``, so nothing starves.

    Args:
        pending: Queued requests, oldest first.
        waited_s: How long the oldest has waited.
        running: Requests the other ranks are running.
        lookahead: How many queued requests to consider.
        max_skip_s: Longest the oldest request may be passed over.
    """
    if not pending:
        return None
    if not running or waited_s >= max_skip_s:
        return 0
    target = sum(r.forward_cost for r in running) / len(running)
    window = range(min(lookahead, len(pending)))
    return min(window, key=lambda i: (abs(math.log(pending[i].forward_cost / target)), i))


class GroupScheduler:
    """The scheduling side of ``ShardGroup``: runs on its scheduler thread, under its lock."""

    def _take(self, index: int) -> QueuedJob | None:
        job = self._pending.pop(index)
        return job if job.future.set_running_or_notify_cancel() else None

    def _offer(self, ranks: range, job: QueuedJob) -> None:
        """Hands ``job`` to every rank of the lane ``ranks`` under one ticket, which names the lane
        (called with the lock held)."""
        job.variant = job.variant.with_ticket(lane_ticket(next(self._tickets), ranks.start, len(ranks)))
        job.taken, job.lane, job.ranks = time.monotonic(), ranks.start // len(ranks), ranks
        for rank_index in ranks:
            ref = self.ranks[rank_index].offer.remote(job.variant)
            self._inflight[ref] = (rank_index, job)
            self._watch("offer", ref)

    def _watch(self, kind: str, ref: ray.ObjectRef) -> None:
        """Hands ``ref``'s completion to the scheduler thread (Ray calls back; nothing polls)."""

        def completed(future: Future) -> None:
            with self._cond:
                self._events.append((kind, ref, future))
                self._cond.notify_all()

        ref.future().add_done_callback(completed)

    def _assign(self) -> None:
        """Hands queued requests to lanes with room, in the serving order (``lanes.serving_order``;
        called with the lock held)."""
        if self.dims.adaptive:
            self._assign_adaptive()
            return
        while self._pending:
            # The least loaded lane first, so that every lane has work before any has two.
            lane = min(range(self.dims.num_lanes), key=self._load)
            if self._load(lane) >= self.config.requests_per_rank:
                return
            others = list(
                {id(job): job.request for i, job in self._inflight.values() if self.dims.lane_of(i) != lane}.values()
            )
            order = self._serving_order()
            index = pick_next(
                [self._pending[i].request for i in order],
                time.monotonic() - self._pending[order[0]].enqueued,
                others,
                self.config.queue_lookahead,
                self.config.queue_max_skip_s,
            )
            job = self._take(order[index])
            if job is not None:
                self._offer(self.dims.lane_ranks(lane), job)

    def _lane_sizes_of(self, variant: RequestVariant) -> tuple[int, ...]:
        """The lane sizes ``variant``'s request may run on in this group."""
        if not self.dims.adaptive:
            return (len(self.dims.lane_ranks(0)),)
        return (variant.request.lane_size,) if variant.request.lane_size is not None else variant.lane_sizes

    def _serving_order(self) -> list[int]:
        """Indices of the queued jobs in the order they are served (lock held)."""
        now, wall = time.monotonic(), time.time()
        waiting = []
        for job in self._pending:
            target = job.request.deadline
            due_s = target - wall if target is not None else None
            times = self.lane_times.estimates(self._lane_sizes_of(job.variant), job.variant.work)
            waiting.append(Waiting(now - job.enqueued, due_s, min(times.values(), default=None)))
        return serving_order(waiting, self.config.queue_max_skip_s)

    def _assign_adaptive(self) -> None:
        """Adaptive lanes: the first request in the serving order, on the lane the group's
        ``LeanLanes`` gives it (it waits while there is none, and the requests behind it with it);
        with none waiting, the running requests widened (``widening``). A request that waits takes
        every helper back first, whatever lane it then gets: its ranks are free at their next tick.
        Called with the lock held."""
        while True:
            if not self._pending:
                self._widen(self._rank_loads())
                return
            self._release_all()
            loads = self._rank_loads()
            order = self._serving_order()
            first = order[0]
            variant = self._pending[first].variant
            deadline = variant.request.deadline
            ask = LaneAsk(
                variant.lane_sizes,
                variant.request.lane_size,
                deadline - time.time() if deadline is not None else None,
                self.lane_times.estimates(variant.lane_sizes, variant.work),
                keeps_up=deadline is not None and self._keeps_up(order),
            )
            lock_step = LockStep(self._rank_work(), variant.request.forward_cost, self.tick_model.floor())
            ranks = self.lane_policy.lane(ask, LaneRoom(loads, len(self._pending), lock_step))
            if ranks is None:
                return
            job = self._take(first)
            if job is not None:
                job.tick_work = max(lock_step.with_lane(ranks))
                self._offer(ranks, job)

    def _rank_loads(self) -> list[int]:
        """Requests each rank runs now, a helper's help counted as one (lock held)."""
        loads = [0] * self.dims.shard_size
        for rank_index, _ in self._inflight.values():
            loads[rank_index] += 1
        for rank_index in self._helping_ranks():
            loads[rank_index] += 1
        return loads

    def _keeps_up(self, order: list[int]) -> bool:
        """``lanes.queue_keeps_up`` for the queued jobs in ``order`` (lock held), each on its lean
        lane: false while the widest lane of one of them has no measured time for its work. The work
        running now delays the queue by its remaining measured seconds, spread over the group's ranks."""
        wall, now, capacity = time.time(), time.monotonic(), self.config.requests_per_rank
        queue = []
        for index in order:
            job = self._pending[index]
            if job.request.deadline is None:
                continue
            sizes = self._lane_sizes_of(job.variant)
            times = self.lane_times.estimates(sizes, job.variant.work)
            if max(sizes) not in times:
                return False
            due_s, lane = job.request.deadline - wall, as_fast(sizes, times)[0]
            if due_s >= min(times.values()):  # one that no lane makes is served behind the rest
                queue.append((due_s, times[lane], lane))
        running = {id(job): job for _, job in self._inflight.values()}.values()
        rank_s = sum(
            max(0.0, (self.lane_times.estimate(len(job.ranks), job.variant.work) or 0.0) - (now - job.taken))
            * len(job.ranks)
            for job in running
        )
        return queue_keeps_up(queue, rank_s / self.dims.shard_size / capacity, self.dims.shard_size, capacity)

    def _rank_work(self) -> list[float]:
        """Each rank's share of the forwards its denoising requests put into a tick (lock held): a
        request's ``forward_cost`` over its lane's ranks, on each rank still running it. A lane's
        leader that alone still holds a request of several ranks is decoding it and adds none."""
        work = [0.0] * self.dims.shard_size
        for job, ranks in self._running_jobs().values():
            if len(job.ranks) > 1 and len(ranks) == 1:
                continue
            if job.helpers:  # a widened request's forwards run on its wider lane, helpers included
                ranks = job.wide
            for rank_index in ranks:
                work[rank_index] += job.request.forward_cost / len(job.wide or job.ranks)
        return work

    def _load(self, lane: int) -> int:
        """Requests on ``lane``: its busiest rank's (a leader still decodes after its lane moved on)."""
        ranks = self.dims.lane_ranks(lane)
        return max(sum(1 for i, _ in self._inflight.values() if i == r) for r in ranks)

    def _schedule(self) -> None:
        """The scheduler thread: hands requests to ranks, answers them, starts sessions.

        Wakes on a submitted request, a completed offer or session, or a rank's death. If it
        crashes, the group fails (and so answers every request it holds) rather than go quiet.
        """
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._events or self._wake or self._cancels):
                        if not self._cond.wait(self._until_queue_timeout()):
                            break  # the oldest queued request's time is up
                    if self._closed:
                        return
                    self._wake = False
                    events = list(self._events)
                    self._events.clear()
                    cancels, self._cancels = self._cancels, []
                    ranks = list(self.ranks)  # (a failed group has none: it answered its requests)
                for rank_index, request_id in cancels:
                    if rank_index < len(ranks):  # the offer then fails with RequestCancelledError
                        ranks[rank_index].cancel.remote(request_id)
                for kind, ref, future in events:
                    if kind == "offer":
                        self._offer_done(ref, future)
                    elif kind == "session":
                        self._session_done(ref, future)
                    elif kind == "denoised":
                        self._denoised(ref)
                    elif isinstance(future.exception(), ray.exceptions.RayActorError):  # a rank, idle or not
                        rank_index = self._watchers.pop(ref, None)
                        if rank_index is not None:  # else a rank replaced already (``_lost``)
                            self._lost(rank_index, died(rank_index, future.exception()))
                self._expire_queued()
                with self._cond:
                    if self._failure or self._closed or self.mending:
                        continue
                    self._assign()
                    if self._inflight and self._sessions is None:
                        # Every rank ticks, with work or without, until all are idle.
                        self._sessions = {r.session.remote(): i for i, r in enumerate(self.ranks)}
                        for ref in self._sessions:
                            self._watch("session", ref)
        except BaseException as err:
            logger.exception("The shard group's scheduler crashed")
            self._fail(f"shard group failed: its scheduler crashed: {type(err).__name__}: {err}")

    def _until_queue_timeout(self) -> float | None:
        """Seconds until the first queued request's deadline passes (lock held)."""
        if not self._pending:
            return None
        return max(0.0, min(job.deadline for job in self._pending) - time.time())

    def _expire_queued(self) -> None:
        """Answers the queued requests no lane took by their deadline (504): ``queue_timeout_s``
        from their arrival, however long of it they spent waiting elsewhere first."""
        now = time.time()
        with self._cond:
            expired = [j for j in self._pending if now >= j.deadline]
            self._pending = [j for j in self._pending if j not in expired]
        for job in expired:
            waited = time.monotonic() - job.enqueued
            error = QueueTimeoutError(
                f"request {job.request.request_id!r} waited {waited:.0f}s in this group's queue, and no rank took "
                f"it by its deadline (queue_timeout_s={self.config.queue_timeout_s:g} from its arrival)"
            )
            resolve(job.future, error=error)

    def _offer_done(self, ref: ray.ObjectRef, future: Future) -> None:
        with self._cond:
            entry = self._inflight.pop(ref, None)
        if entry is None:
            return  # the group failed or shut down meanwhile, and answered the request then
        rank_index, job = entry
        with self._cond:
            self._release(job)  # a rank of its lane is done: its forwards are over
        error = future.exception()
        if isinstance(error, ray.exceptions.RayActorError):
            self._lost(rank_index, died(rank_index, error), also=job)
        elif error is not None and isinstance(remote_cause(error), SessionFailedError):
            self._session_failed(error, also=job)
        elif rank_index != job.ranks.start:
            if error is not None:  # its own error, which stopped the lane: the cause, not the leader's stop
                resolve(job.future, error=remote_cause(error))
        elif error is None:
            resolve(job.future, result=future.result())
        else:  # the request's own error (bad input, deadline): the group is fine
            resolve(job.future, error=remote_cause(error))

    def _session_done(self, ref: ray.ObjectRef, future: Future) -> None:
        error = future.exception()
        with self._cond:
            if self._sessions is None or ref not in self._sessions:
                return  # a session of a group that failed already
            rank_index = self._sessions[ref]
            if error is None:
                self._sessions_done.add(ref)
                if len(self._sessions_done) == len(self._sessions):
                    self._sessions, self._sessions_done = None, set()
                return
        if isinstance(error, ray.exceptions.RayActorError):
            self._lost(rank_index, died(rank_index, error))
        else:
            self._session_failed(error)

    def _session_failed(self, error: BaseException, also: QueuedJob | None = None) -> None:
        """A session failed: a dead peer's doing if Ray reports one within a short grace (the group
        then replaces that rank, or fails naming it), else the group fails with ``error``.

        Without the grace, a survivor's broken all-gather would name the survivor, and the
        operator would look for the fault on the wrong rank.
        """
        if self._failure is None:
            ready, _ = ray.wait(list(self._watchers), num_returns=1, timeout=_DEATH_REPORT_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as err:
                    self._lost(self._watchers[ref], died(self._watchers[ref], err), also=also)
                    return
                except Exception:  # noqa: BLE001 - a watch that ended otherwise: the rank left
                    pass
        self._fail(f"shard group failed: {remote_cause(error)}", also=also)

    def _fail(self, reason: str, also: QueuedJob | None = None) -> None:
        """Marks the group broken, fails every queued and running request (and ``also``) with
        ``reason`` and kills every rank at once: survivors would otherwise sit in a collective
        with a dead or out-of-step peer until its timeout."""
        with self._cond:
            first = self._failure is None
            self._failure = self._failure or reason
            queued = {id(j) for j in self._pending}
            jobs = [*self._pending, *(j for _, j in self._inflight.values()), *([also] if also else [])]
            self._pending, self._inflight = [], {}
            self._sessions, self._sessions_done = None, set()
            self._cond.notify_all()
        for job in jobs:
            resolve(job.future, error=GroupFailedError(self._failure, ran=id(job) not in queued))
        if first:
            logger.error("Shard group failed: %s", self._failure)
            self._kill_ranks()
