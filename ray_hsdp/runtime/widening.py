"""Lane widening on a rank (``lane_widening``): while its group has idle ranks, a running request's
forwards also run on the other ranks of a wider lane around its own. Those ranks *help*: at each
tick they offer the wider lane's help key (``protocol.help_key``), the request's own ranks offer
its calls under the wider lane's ticket once every helper offers it, each such forward takes its
inputs from one rank of the request's own lane (``ShardedModules``: a broadcast over the wider
lane), and the helpers drop its outputs. The request's loop, its decode and its answer stay on its
own lane. The switch happens between two ticks, decided from a tick's gathered states, so all the
ranks of the wider lane switch at the same tick, both ways: a helper released by its group offers
something else, and the request's ranks go back to their own lane at the next tick.
"""

from __future__ import annotations

from typing import Any

from ray_hsdp.protocol import (
    HELP_MODULE,
    KEY_SPACE,
    STOPPED_MEMORY,
    ForwardCall,
    SessionFailedError,
    help_key,
    lane_of,
    module_of,
    sequence_of,
)
from ray_hsdp.runtime.state import Help, RankState


class RankWidening:
    """A rank's side of lane widening: the helps its group gives it and the wider lanes its own
    requests run on.

    Args:
        state: The rank's runtime state, whose lock guards the help it gives (``state.help``).
    """

    def __init__(self, state: RankState) -> None:
        self.state = state
        self._offered: Help | None = None  # the help it offered at the tick that runs
        self._released: dict[int, None] = {}  # releases that came before their help (bounded)
        #: This rank's requests' tickets -> (the wider lane's ticket, the source's index in it), for
        #: the requests whose helpers all offered their help at the last tick.
        self._widened: dict[int, tuple[int, int]] = {}

    def forget(self) -> None:
        """Forgets the offers and releases of a failed session (lock held)."""
        self._offered = None
        self._released = {}
        self._widened = {}

    def help(self, request: Any, ticket: int, source: int) -> None:
        """Helps ``request`` on the wider lane ``ticket`` until ``release(ticket)``: this rank offers
        the lane's help key at every tick it has no call or start of its own waiting (so that lanes
        of its own never wait on it), and joins each forward
        of the request the lane agrees on, its inputs from the lane's rank ``source``. A help whose
        release came first is dropped. A help replaces the one this rank gives now: its group gives
        a rank one help at a time and releases it before the next, but Ray runs the two calls on
        this rank's threaded control group in either order (the late release is then dropped).

        Raises:
            SessionFailedError: This rank's session failed.
        """
        state = self.state
        with state.cond:
            if state.failure is not None:
                raise SessionFailedError(str(state.failure))
            if ticket in self._released:
                del self._released[ticket]
                return
            state.help = Help(request, ticket, source)
            state.cond.notify_all()

    def release(self, ticket: int) -> None:
        """Ends this rank's help of the wider lane ``ticket`` (before it starts, when it comes first)."""
        state = self.state
        with state.cond:
            if state.help is not None and state.help.ticket == ticket:
                state.help = None
            else:
                self._released[ticket] = None
                while len(self._released) > STOPPED_MEMORY:
                    del self._released[next(iter(self._released))]
            state.cond.notify_all()

    def note_helpers(self, gathered: list[int]) -> None:
        """From a tick's gathered states: the wider lane each request of this rank runs its next
        calls on (every other rank of that lane offered the lane's help key), or its own."""
        helps = {state % KEY_SPACE for state in gathered if state >= 0 and module_of(state) == HELP_MODULE}
        widened = {}
        if helps:
            with self.state.cond:
                jobs = [*self.state.running, *self.state.inbox]
            for job in jobs:
                home = range(self.state.rank, self.state.rank + 1) if job.lane_first is None else range(
                    job.lane_first, job.lane_first + job.lane_size
                )  # fmt: skip
                for ticket in helps:
                    first, size = lane_of(ticket)
                    lane = range(first, first + size)
                    if sequence_of(ticket) != sequence_of(job.ticket) or not set(home) < set(lane):
                        continue
                    if all(gathered[r] == help_key(ticket) for r in lane if r not in home):
                        widened[job.ticket] = (ticket, home.start - first)
        self._widened = widened

    def retarget_waiting(self) -> None:
        """Puts each waiting call on its request's lane for the next tick (lock held)."""
        for call in self.state.waiting:
            ticket, source = self._widened.get(call.home_ticket, (call.home_ticket, None))
            if ticket != call.ticket:
                call.retarget(ticket, source)

    def offer_help(self, free: bool) -> int | None:
        """The help key this rank offers at this tick, when it helps and is ``free`` (none of its own
        lanes waits on it); remembered for the tick (lock held)."""
        self._offered = self.state.help if free else None
        return help_key(self._offered.ticket) if self._offered is not None else None

    def helps_in(self, agreed: dict[int, int], module_id: int) -> bool:
        """Whether the lane this rank offered its help to agreed on a call of ``module_id``."""
        help = self._offered
        if help is None:
            return False
        key = agreed.get(lane_of(help.ticket)[0])
        return key is not None and key % KEY_SPACE == help.ticket and module_of(key) == module_id

    def help_forward(self, module_id: int) -> None:
        """Joins the wider lane's forward of ``module_id``: its inputs come from the lane's source
        rank, its outputs are dropped."""
        help = self._offered
        context = {"widened": (lane_of(help.ticket)[1], help.source)}
        self.state.modules.forward([ForwardCall(module_id, (), {}, help.ticket, context, help.request)])
        self.state.forwards += 1
        self.state.helped += 1
