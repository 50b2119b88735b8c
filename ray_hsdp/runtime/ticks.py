"""The tick thread's loop of a rank runtime (``RankRuntime``, whose state it reads): each tick
all-gathers what every rank offers, applies the stops, starts what its lane agreed on, and runs or
ghosts the smallest module some lane wants."""

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
    agreed_keys,
    agreed_mine,
    lane_of,
    module_of,
)


class TickLoop:
    """The tick thread's side of ``RankRuntime``."""

    def _start_requests(self) -> None:
        """Starts queued requests of this rank's own lane (of one rank) while it has room; a lane of
        several ranks starts its requests at a tick all of them agree on."""
        with self._cond:
            for job in list(self._inbox):
                if len(self._running) >= self.slots:
                    return
                if job.lane_size > 1:
                    continue
                self._inbox.remove(job)
                if not job.done:  # else its caller gave up while it was queued
                    self._start(job)

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
        with self._cond:
            self._offered_help = None
            if self._stops:
                return STOP - self._stops.popleft()
            self._retarget_waiting()
            if behind := {c.key for c in self._waiting} & self._behind:
                return min(behind)
            # Starts of lanes of several ranks this rank has room for (a lane of one starts alone).
            starts = [j.ticket for j in self._inbox if j.lane_size > 1] if len(self._running) < self.slots else []
            if behind := {ticket % KEY_SPACE for ticket in starts} & self._behind:
                return min(behind)
            if self._waiting:
                return min(c.key for c in self._waiting)
            if starts:
                return min(starts) % KEY_SPACE
            if (help := self._offer_help()) is not None:
                return help
        return BUSY if busy else IDLE

    def _start_agreed(self, key: int) -> None:
        """Starts the queued request of the start key its lane agreed on at this tick."""
        with self._cond:
            job = next(j for j in self._inbox if j.ticket % KEY_SPACE == key)
            self._inbox.remove(job)
            self._start(job)

    def _wait_for_requests(self) -> bool:
        """Unsharded: waits until a request ends or one can start; True when nothing is left."""
        with self._cond:
            if not self._running and not self._inbox:
                return True
            if not (self._inbox and len(self._running) < self.slots):
                self._cond.wait()
            return False

    def _tick(self) -> bool:
        """One tick: the smallest module some rank wants runs here or is ghosted.

        Returns:
            True when every rank was idle at this tick (all ranks see the same answer).
        """
        busy = self._take_calls()
        state = self._lane_state(busy)
        self._where = "the tick's all-gather"
        start = time.perf_counter()
        gathered = self.exchange(state)
        gathered_at = time.perf_counter()
        self.ticks += 1
        self.idle_ticks += state == IDLE
        self._apply_stops(STOP - g for g in gathered if g <= STOP)
        agreed = agreed_keys(gathered)
        self._note_helpers(gathered)
        offered = {g for g in gathered if g >= 0 and lane_of(g % KEY_SPACE)[1] > 1 and module_of(g) != HELP_MODULE}
        self._behind = offered - set(agreed.values())  # lanes of several ranks that did not agree
        mine = agreed_mine(agreed, state, self.rank)
        if mine is not None and module_of(mine) < 0:
            self._start_agreed(mine)
        module_id = min((module_of(key) for key in agreed.values() if module_of(key) >= 0), default=None)
        batch = []
        if module_id is not None:
            batch = self._batch(mine) if mine is not None and module_of(mine) == module_id else []
            if batch:
                self._where = f"the forward of {self.modules.names[module_id]}"
                self._forward(batch)
            elif self._helps_in(agreed, module_id):
                self._where = f"a helper's forward of {self.modules.names[module_id]}"
                self._help_forward(module_id)
            else:
                self._where = f"a ghost pass of {self.modules.names[module_id]}"
                self.modules.ghost(module_id)
                self.ghosts += 1
        self._where = "a tick"
        self.observer.tick(self.ticks, start, state, module_id, bool(batch), gathered_at, time.perf_counter())
        if module_id is None:
            if all(g == IDLE for g in gathered):
                return True
            with self._cond:
                if not self._calls:
                    self._cond.wait(QUIET_TICK_S)
        return False

    def _take_calls(self) -> bool:
        """Moves queued calls to the waiting list, first waiting up to ``patience_s`` while fewer
        wait than the requests that will call again (up to a batch).

        Returns:
            Whether this rank has requests running or waiting to start.
        """
        deadline = time.monotonic() + self.patience_s
        with self._cond:
            while True:
                self._waiting.extend(self._calls)
                self._calls.clear()
                remaining = deadline - time.monotonic()
                if len(self._waiting) >= min(self._expecting, self.max_batch) or remaining <= 0:
                    return bool(self._running or self._inbox)
                self._cond.wait(remaining)

    def _apply_stops(self, tickets) -> None:
        """Stops the requests of ``tickets`` at this tick: queued ones never start, waiting calls
        fail, later calls fail at once. Every rank of the lane does this at the same tick."""
        failed: list[ForwardCall] = []
        dropped: list[Job] = []
        with self._cond:
            for ticket in tickets:
                self._stopped[ticket] = None
                while len(self._stopped) > STOPPED_MEMORY:
                    del self._stopped[next(iter(self._stopped))]
                for job in [*self._inbox, *self._running]:
                    if job.ticket != ticket:
                        continue
                    job.stopped = True
                    if job in self._inbox:
                        self._inbox.remove(job)
                        dropped.append(job)
                for queue in (self._calls, self._waiting):
                    for call in [c for c in queue if c.home_ticket == ticket]:
                        queue.remove(call)
                        failed.append(call)
        for job in dropped:
            job.complete(error=self._stopped_error(job))
        for call in failed:
            call.complete(error=RequestStoppedError(f"the request of ticket {call.ticket} was stopped by its lane"))

    def _batch(self, key: int) -> list[ForwardCall]:
        """Takes the waiting call of ``key`` and, for a lane of this rank alone, up to ``max_batch - 1``
        more calls of its module on such lanes that can run in the same forward (oldest first)."""
        # Here, not at the top: the runtime's importers (a Serve replica, through the group) never
        # batch, and need not import torch.
        from ray_hsdp.runtime.batching import compatible

        module_id = module_of(key)
        batch: list[ForwardCall] = []
        with self._cond:
            first = next((c for c in self._waiting if c.key == key), None)
            if first is None:
                return []
            alone = lane_of(first.ticket)[1] == 1
            if alone:  # the oldest call of the module on a lane of this rank alone leads the batch
                first = next(c for c in self._waiting if c.module_id == module_id and lane_of(c.ticket)[1] == 1)
            batch.append(first)
            self._waiting.remove(first)
            for call in list(self._waiting) if alone else ():  # a lane of several ranks runs one call
                if call.module_id != module_id or len(batch) == self.max_batch or call.batch_key != first.batch_key:
                    continue
                if lane_of(call.ticket)[1] != 1:
                    continue
                if batch and not compatible((batch[0].args, batch[0].kwargs), (call.args, call.kwargs)):
                    continue
                batch.append(call)
                self._waiting.remove(call)
            self._current = batch
        return batch

    def _forward(self, batch: list[ForwardCall]) -> None:
        # An error here propagates: this rank may have issued part of the forward's collectives,
        # so it is out of step, and ``fail`` answers these calls with everything else.
        results = self.modules.forward(batch)
        self.forwards += 1
        with self._cond:
            self._current = []
        for call, result in zip(batch, results):
            call.complete(result)
        if len(batch) > 1:
            self.batched += len(batch)
