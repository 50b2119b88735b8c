"""The group's scheduler (``Scheduler``): the choice of the next queued job for a lane with room
(``pick_next``, the serving order, the adaptive lanes' policy) and its hand-over to the lane's
ranks; and what one request's record holds (``RequestRecord``). The thread that runs it, and
answers the jobs, is ``loop.SchedulerLoop``."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ray_hsdp.group.lanes import LaneAsk, LaneRoom, LockStep, Waiting, as_fast, queue_keeps_up, serving_order
from ray_hsdp.group.state import GroupState, QueuedJob, resolve
from ray_hsdp.group.widening import Widening
from ray_hsdp.protocol import lane_ticket
from ray_hsdp.request import GenerationRequest
from ray_hsdp.variant import RequestVariant

__all__ = ["QueuedJob", "RequestRecord", "Scheduler", "pick_next", "resolve"]


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


class Scheduler:
    """Hands a group's queued jobs to its lanes; its methods run on the scheduler thread, with the
    state's lock held.

    Args:
        state: The group's state (its queue, running jobs, ranks, measured times).
        widening: Widens the running requests while none waits, and takes the helpers back.
    """

    def __init__(self, state: GroupState, widening: Widening):
        self.state = state
        self.widening = widening

    def assign(self) -> None:
        """Hands queued requests to lanes with room, in the serving order (``lanes.serving_order``)."""
        state = self.state
        if state.dims.adaptive:
            self._assign_adaptive()
            return
        while state.pending:
            # The least loaded lane first, so that every lane has work before any has two.
            lane = min(range(state.dims.num_lanes), key=self._load)
            if self._load(lane) >= state.config.requests_per_rank:
                return
            others = list(
                {id(job): job.request for i, job in state.inflight.values() if state.dims.lane_of(i) != lane}.values()
            )
            order = self._serving_order()
            index = pick_next(
                [state.pending[i].request for i in order],
                time.monotonic() - state.pending[order[0]].enqueued,
                others,
                state.config.queue_lookahead,
                state.config.queue_max_skip_s,
            )
            job = self._take(order[index])
            if job is not None:
                self._offer(state.dims.lane_ranks(lane), job)

    def _take(self, index: int) -> QueuedJob | None:
        job = self.state.pending.pop(index)
        return job if job.future.set_running_or_notify_cancel() else None

    def _offer(self, ranks: range, job: QueuedJob) -> None:
        """Hands ``job`` to every rank of the lane ``ranks`` under one ticket, which names the lane."""
        state = self.state
        job.variant = job.variant.with_ticket(lane_ticket(next(state.tickets), ranks.start, len(ranks)))
        job.taken, job.lane, job.ranks = time.monotonic(), ranks.start // len(ranks), ranks
        for rank_index in ranks:
            ref = state.ranks[rank_index].offer.remote(job.variant)
            state.inflight[ref] = (rank_index, job)
            state.watch("offer", ref)

    def _lane_sizes_of(self, variant: RequestVariant) -> tuple[int, ...]:
        """The lane sizes ``variant``'s request may run on in this group."""
        dims = self.state.dims
        if not dims.adaptive:
            return (len(dims.lane_ranks(0)),)
        return (variant.request.lane_size,) if variant.request.lane_size is not None else variant.lane_sizes

    def _serving_order(self) -> list[int]:
        """Indices of the queued jobs in the order they are served."""
        now, wall = time.monotonic(), time.time()
        waiting = []
        for job in self.state.pending:
            target = job.request.deadline
            due_s = target - wall if target is not None else None
            times = self.state.lane_times.estimates(self._lane_sizes_of(job.variant), job.variant.work)
            waiting.append(Waiting(now - job.enqueued, due_s, min(times.values(), default=None)))
        return serving_order(waiting, self.state.config.queue_max_skip_s)

    def _assign_adaptive(self) -> None:
        """Adaptive lanes: the first request in the serving order, on the lane the group's
        ``LeanLanes`` gives it (it waits while there is none, and the requests behind it with it);
        with none waiting, the running requests widened (``widening``). A request that waits takes
        every helper back first, whatever lane it then gets: its ranks are free at their next tick."""
        state = self.state
        while True:
            if not state.pending:
                self.widening.widen(self._rank_loads())
                return
            self.widening.release_all()
            loads = self._rank_loads()
            order = self._serving_order()
            first = order[0]
            variant = state.pending[first].variant
            deadline = variant.request.deadline
            ask = LaneAsk(
                variant.lane_sizes,
                variant.request.lane_size,
                deadline - time.time() if deadline is not None else None,
                state.lane_times.estimates(variant.lane_sizes, variant.work),
                keeps_up=deadline is not None and self._keeps_up(order),
            )
            lock_step = LockStep(self._rank_work(), variant.request.forward_cost, state.tick_model.floor())
            ranks = state.lane_policy.lane(ask, LaneRoom(loads, len(state.pending), lock_step))
            if ranks is None:
                return
            job = self._take(first)
            if job is not None:
                job.tick_work = max(lock_step.with_lane(ranks))
                self._offer(ranks, job)

    def _rank_loads(self) -> list[int]:
        """Requests each rank runs now, a helper's help counted as one."""
        loads = [0] * self.state.dims.shard_size
        for rank_index, _ in self.state.inflight.values():
            loads[rank_index] += 1
        for rank_index in self.state.helping_ranks():
            loads[rank_index] += 1
        return loads

    def _keeps_up(self, order: list[int]) -> bool:
        """``lanes.queue_keeps_up`` for the queued jobs in ``order``, each on its lean lane: false
        while the widest lane of one of them has no measured time for its work. The work running
        now delays the queue by its remaining measured seconds, spread over the group's ranks."""
        state = self.state
        wall, now, capacity = time.time(), time.monotonic(), state.config.requests_per_rank
        queue = []
        for index in order:
            job = state.pending[index]
            if job.request.deadline is None:
                continue
            sizes = self._lane_sizes_of(job.variant)
            times = state.lane_times.estimates(sizes, job.variant.work)
            if max(sizes) not in times:
                return False
            due_s, lane = job.request.deadline - wall, as_fast(sizes, times)[0]
            if due_s >= min(times.values()):  # one that no lane makes is served behind the rest
                queue.append((due_s, times[lane], lane))
        running = {id(job): job for _, job in state.inflight.values()}.values()
        rank_s = sum(
            max(0.0, (state.lane_times.estimate(len(job.ranks), job.variant.work) or 0.0) - (now - job.taken))
            * len(job.ranks)
            for job in running
        )
        shard_size = state.dims.shard_size
        return queue_keeps_up(queue, rank_s / shard_size / capacity, shard_size, capacity)

    def _rank_work(self) -> list[float]:
        """Each rank's share of the forwards its denoising requests put into a tick: a request's
        ``forward_cost`` over its lane's ranks, on each rank still running it. A lane's leader
        that alone still holds a request of several ranks is decoding it and adds none."""
        work = [0.0] * self.state.dims.shard_size
        for job, ranks in self.state.running_jobs().values():
            if len(job.ranks) > 1 and len(ranks) == 1:
                continue
            if job.helpers:  # a widened request's forwards run on its wider lane, helpers included
                ranks = job.wide
            for rank_index in ranks:
                work[rank_index] += job.request.forward_cost / len(job.wide or job.ranks)
        return work

    def _load(self, lane: int) -> int:
        """Requests on ``lane``: its busiest rank's (a leader still decodes after its lane moved on)."""
        ranks = self.state.dims.lane_ranks(lane)
        return max(sum(1 for i, _ in self.state.inflight.values() if i == r) for r in ranks)
