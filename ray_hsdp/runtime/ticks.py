"""The tick thread's loop of a rank runtime (``RankRuntime``): each tick all-gathers what every
rank offers, applies the stops, starts what its lane agreed on, and runs or ghosts the smallest
module some lane wants."""

from __future__ import annotations

import time

from ray_hsdp.protocol import (
    BUSY,
    HELP_MODULE,
    IDLE,
    KEY_SPACE,
    QUIET_TICK_S,
    STOP,
    STOPPED_MEMORY,
    ForwardCall,
    Job,
    RequestStoppedError,
    SessionFailedError,
    agreed_keys,
    agreed_mine,
    lane_of,
    module_of,
)
from ray_hsdp.runtime.state import RankState, stopped_error
from ray_hsdp.runtime.threads import RequestThreads
from ray_hsdp.runtime.widening import RankWidening


class TickLoop:
    """The tick thread's side of a rank runtime: its sessions.

    Args:
        state: The rank's runtime state.
        threads: Starts the requests a tick lets start.
        widening: The helps this rank gives and the wider lanes its requests run on.
    """

    def __init__(self, state: RankState, threads: RequestThreads, widening: RankWidening) -> None:
        self.state = state
        self._threads = threads
        self._widening = widening

    def session(self) -> int:
        """Runs queued requests until every rank is idle (``RankRuntime.session``).

        Returns:
            How many requests this session started.
        """
        state = self.state
        with state.cond:
            if state.failure is not None:
                raise SessionFailedError(str(state.failure))
        before = state.threads_started
        state.in_session = True
        try:
            while True:
                if state.failure is not None:  # a request thread failed it (a split decode's error)
                    raise state.failure
                self._start_requests()  # a lane of several ranks starts its requests at a tick
                if state.modules is None:
                    if self._wait_for_requests():
                        return state.threads_started - before
                elif self._tick():
                    return state.threads_started - before
        except BaseException as err:
            raise state.fail(err) from err
        finally:
            state.in_session = False

    def _start_requests(self) -> None:
        """Starts queued requests of this rank's own lane (of one rank) while it has room; a lane of
        several ranks starts its requests at a tick all of them agree on."""
        state = self.state
        with state.cond:
            for job in list(state.inbox):
                if len(state.running) >= state.slots:
                    return
                if job.lane_size > 1:
                    continue
                state.inbox.remove(job)
                if not job.done:  # else its caller gave up while it was queued
                    self._threads.start(job)

    def _lane_state(self, busy: bool) -> int:
        """What this rank offers at a tick: a stop it asks for, else the least of its waiting calls
        of lanes of several ranks that did not agree at the last tick, else (with room) the least
        of such starts, else its cheapest waiting call, else the oldest queued request if it has
        room for it, else the help key of the wider lane it helps (``runtime.widening``), else
        ``BUSY`` or ``IDLE``.

        Calls come before starts: the ranks of a lane run the same requests, so their calls
        agree, while a start waits until every rank of the lane has room (a leader still decoding
        has none). A rank in two lanes (adaptive lanes: a request of its own lane of one rank and
        one of a lane of two) would otherwise offer its older request's calls at every tick, and the
        lane of two, whose other rank offers its call, would not run until the older one ended; the
        calls left behind are the same on every rank (read from the tick's all-gather), so the
        ranks of such a lane offer the call together at the next tick. Calls left behind come
        before starts left behind: a start waits for every rank of its lane to have room, and a
        rank without room offers its calls, which the others must join for it to make room. Help
        comes last: a rank offers it only when none of its own lanes waits on it, so two ranks
        that help each other's lanes still start and run their own requests.
        """
        with self.state.cond:
            own = self._own_offer()
            help = self._widening.offer_help(free=own is None)
        if own is not None:
            return own
        if help is not None:
            return help
        return BUSY if busy else IDLE

    def _own_offer(self) -> int | None:
        """A stop, call or start of this rank's own lanes to offer (``_lane_state``; lock held)."""
        state = self.state
        if state.stops:
            return STOP - state.stops.popleft()
        self._widening.retarget_waiting()
        if behind := {c.key for c in state.waiting} & state.behind:
            return min(behind)
        # Starts of lanes of several ranks this rank has room for (a lane of one starts alone).
        starts = [j.ticket for j in state.inbox if j.lane_size > 1] if len(state.running) < state.slots else []
        if behind := {ticket % KEY_SPACE for ticket in starts} & state.behind:
            return min(behind)
        if state.waiting:
            return min(c.key for c in state.waiting)
        if starts:
            return min(starts) % KEY_SPACE
        return None

    def _start_agreed(self, key: int) -> None:
        """Starts the queued request of the start key its lane agreed on at this tick."""
        state = self.state
        with state.cond:
            job = next(j for j in state.inbox if j.ticket % KEY_SPACE == key)
            state.inbox.remove(job)
            self._threads.start(job)

    def _wait_for_requests(self) -> bool:
        """Unsharded: waits until a request ends or one can start; True when nothing is left."""
        state = self.state
        with state.cond:
            if not state.running and not state.inbox:
                return True
            if not (state.inbox and len(state.running) < state.slots):
                state.cond.wait()
            return False

    def _tick(self) -> bool:
        """One tick: the smallest module some rank wants runs here or is ghosted.

        Returns:
            True when every rank was idle at this tick (all ranks see the same answer).
        """
        state = self.state
        busy = self._take_calls()
        offer = self._lane_state(busy)
        state.where = "the tick's all-gather"
        start = time.perf_counter()
        gathered = state.exchange(offer)
        gathered_at = time.perf_counter()
        state.ticks += 1
        state.idle_ticks += offer == IDLE
        self._apply_stops(STOP - g for g in gathered if g <= STOP)
        agreed = agreed_keys(gathered)
        self._widening.note_helpers(gathered)
        offered = {g for g in gathered if g >= 0 and lane_of(g % KEY_SPACE)[1] > 1 and module_of(g) != HELP_MODULE}
        state.behind = offered - set(agreed.values())  # lanes of several ranks that did not agree
        mine = agreed_mine(agreed, offer, state.rank)
        if mine is not None and module_of(mine) < 0:
            self._start_agreed(mine)
        module_id = min((module_of(key) for key in agreed.values() if module_of(key) >= 0), default=None)
        batch = []
        if module_id is not None:
            batch = self._batch(mine) if mine is not None and module_of(mine) == module_id else []
            if batch:
                state.where = f"the forward of {state.modules.names[module_id]}"
                self._forward(batch)
            elif self._widening.helps_in(agreed, module_id):
                state.where = f"a helper's forward of {state.modules.names[module_id]}"
                self._widening.help_forward(module_id)
            else:
                state.where = f"a ghost pass of {state.modules.names[module_id]}"
                state.modules.ghost(module_id)
                state.ghosts += 1
        state.where = "a tick"
        state.observer.tick(state.ticks, start, offer, module_id, bool(batch), gathered_at, time.perf_counter())
        if module_id is None:
            if all(g == IDLE for g in gathered):
                return True
            with state.cond:
                if not state.calls:
                    state.cond.wait(QUIET_TICK_S)
        return False

    def _take_calls(self) -> bool:
        """Moves queued calls to the waiting list, first waiting up to ``patience_s`` while fewer
        wait than the requests that will call again (up to a batch).

        Returns:
            Whether this rank has requests running or waiting to start.
        """
        state = self.state
        deadline = time.monotonic() + state.patience_s
        with state.cond:
            while True:
                state.waiting.extend(state.calls)
                state.calls.clear()
                remaining = deadline - time.monotonic()
                if len(state.waiting) >= min(state.expecting, state.max_batch) or remaining <= 0:
                    return bool(state.running or state.inbox)
                state.cond.wait(remaining)

    def _apply_stops(self, tickets) -> None:
        """Stops the requests of ``tickets`` at this tick: queued ones never start, waiting calls
        fail, later calls fail at once. Every rank of the lane does this at the same tick."""
        state = self.state
        failed: list[ForwardCall] = []
        dropped: list[Job] = []
        with state.cond:
            for ticket in tickets:
                state.stopped[ticket] = None
                while len(state.stopped) > STOPPED_MEMORY:
                    del state.stopped[next(iter(state.stopped))]
                for job in [*state.inbox, *state.running]:
                    if job.ticket != ticket:
                        continue
                    job.stopped = True
                    if job in state.inbox:
                        state.inbox.remove(job)
                        dropped.append(job)
                for queue in (state.calls, state.waiting):
                    for call in [c for c in queue if c.home_ticket == ticket]:
                        queue.remove(call)
                        failed.append(call)
        for job in dropped:
            job.complete(error=stopped_error(job))
        for call in failed:
            call.complete(error=RequestStoppedError(f"the request of ticket {call.ticket} was stopped by its lane"))

    def _batch(self, key: int) -> list[ForwardCall]:
        """Takes the waiting call of ``key`` and, for a lane of this rank alone, up to ``max_batch - 1``
        more calls of its module on such lanes that can run in the same forward (oldest first)."""
        # Here, not at the top: the runtime's importers (a Serve replica, through the group) never
        # batch, and need not import torch.
        from ray_hsdp.runtime.batching import compatible

        state = self.state
        module_id = module_of(key)
        batch: list[ForwardCall] = []
        with state.cond:
            first = next((c for c in state.waiting if c.key == key), None)
            if first is None:
                return []
            alone = lane_of(first.ticket)[1] == 1
            if alone:  # the oldest call of the module on a lane of this rank alone leads the batch
                first = next(c for c in state.waiting if c.module_id == module_id and lane_of(c.ticket)[1] == 1)
            batch.append(first)
            state.waiting.remove(first)
            for call in list(state.waiting) if alone else ():  # a lane of several ranks runs one call
                if call.module_id != module_id or len(batch) == state.max_batch or call.batch_key != first.batch_key:
                    continue
                if lane_of(call.ticket)[1] != 1:
                    continue
                if batch and not compatible((batch[0].args, batch[0].kwargs), (call.args, call.kwargs)):
                    continue
                batch.append(call)
                state.waiting.remove(call)
            state.current = batch
        return batch

    def _forward(self, batch: list[ForwardCall]) -> None:
        state = self.state
        # An error here propagates: this rank may have issued part of the forward's collectives,
        # so it is out of step, and ``fail`` answers these calls with everything else.
        results = state.modules.forward(batch)
        state.forwards += 1
        with state.cond:
            state.current = []
        for call, result in zip(batch, results):
            call.complete(result)
        if len(batch) > 1:
            state.batched += len(batch)
