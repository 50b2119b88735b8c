"""Lane widening, the group's side (``lane_widening``): while no request waits, a running request's
forwards also run on the idle ranks of a wider aligned lane around its own (they help:
``runtime.widening``), and a request that arrives takes those ranks back. A request is widened
at most once, to the widest such lane its tokens split over, unless the group's measured times
say that lane is no faster for its work (``lanes.as_fast``)."""

from __future__ import annotations

import ray

from ray_hsdp.group.lanes import as_fast
from ray_hsdp.group.state import GroupState, QueuedJob
from ray_hsdp.protocol import widened


class Widening:
    """A group's widening of its running requests: its methods run on the scheduler thread, under
    the state's lock."""

    def __init__(self, state: GroupState):
        self.state = state

    def widen(self, loads: list[int]) -> None:
        """Widens the running requests whose lane has a wider aligned lane around it with every
        other rank idle (``loads``: requests per rank, helpers counted), oldest first."""
        if not self.state.config.lane_widening:
            return
        running = sorted(self.state.running_jobs().values(), key=lambda held: held[0].taken)
        for job, holders in running:
            if job.widened_to is not None or job.request.lane_size is not None:
                continue  # widened once already, or on the lane it asked for
            if sorted(holders) != list(job.ranks) or any(loads[r] != 1 for r in job.ranks):
                continue  # part of its lane is done (decoding), or its ranks run others too
            for size in sorted(job.variant.lane_sizes, reverse=True):
                if size <= len(job.ranks):
                    break
                start = job.ranks.start // size * size
                lane = range(start, start + size)
                if all(loads[r] == 0 for r in lane if r not in job.ranks) and self._pays(job, size):
                    self._help(job, lane)
                    for rank in job.helpers:
                        loads[rank] += 1
                    break

    def _pays(self, job: QueuedJob, size: int) -> bool:
        """Whether ``size`` ranks run ``job``'s work faster than its own lane by the measured
        times (``as_fast``: not when within 10% of it); unmeasured sizes are tried."""
        sizes = (len(job.ranks), size)
        times = self.state.lane_times.estimates(sizes, job.variant.work)
        return len(times) < 2 or as_fast(sizes, times)[0] == size

    def _help(self, job: QueuedJob, lane: range) -> None:
        """Asks the ranks of ``lane`` outside ``job``'s own to help it there."""
        ranks = self.state.ranks
        ticket = widened(job.variant.ticket, lane.start, len(lane))
        job.wide, job.widened_to = lane, len(lane)
        job.helpers = tuple(r for r in lane if r not in job.ranks)
        for rank in job.helpers:
            ranks[rank].help.remote(job.variant, ticket, job.ranks.start - lane.start)
        # Its decode runs on its own lane: the helpers go back once its loop ends on its leader
        # (a lane of several ranks also says so when its other ranks' offers end).
        ended = ranks[job.ranks.start].denoised.remote(job.request.request_id)
        self.state.loop_watches[ended] = job
        self.state.watch("denoised", ended)

    def denoised(self, ended: ray.ObjectRef) -> None:
        """A widened request's loop ended on its leader (``Rank.denoised``): its helpers go back."""
        with self.state.cond:
            job = self.state.loop_watches.pop(ended, None)
            if job is not None:
                self.release(job)

    def release(self, job: QueuedJob) -> bool:
        """Gives ``job``'s helpers back (they leave its lane at their next tick); whether it had any."""
        if not job.helpers:
            return False
        ticket = widened(job.variant.ticket, job.wide.start, len(job.wide))
        for rank in job.helpers:
            self.state.ranks[rank].release.remote(ticket)
        job.helpers, job.wide = (), range(0)
        return True

    def release_all(self) -> bool:
        """Gives every helper back (a request waits for ranks); whether there were any."""
        return any([self.release(job) for job, _ in self.state.running_jobs().values()])
