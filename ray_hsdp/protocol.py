"""The tick protocol's parts: the states and keys a rank offers at a tick, the errors, what
completes exactly once (a request's job, a forward call), and the seams the runtime drives (the
modules, the exchange, the observer). Contract: ``ray_hsdp.runtime``'s docstring.

Layer: the bottom one (the standard library only), so that the runtime and a request's variant
(lanes, step caches), the pipeline, the rank and the group read the same keys and tickets."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: States a rank brings to a tick besides a module id: nothing to do, or requests running with
#: no forward waiting (decoding, or between two forwards).
IDLE = -1
BUSY = -2

#: A rank offers at each tick a key: ``(module_id + 1) * KEY_SPACE + ticket`` for a waiting call,
#: or ``ticket`` to start a queued request (lanes of several ranks). A lane acts on a key only when
#: all its ranks offer it, so its ranks start the same requests and run the same calls together.
KEY_SPACE = 1 << 48
#: A ticket carries its request's lane in its low bits (``lane_ticket``), so that every rank reads
#: from a key alone which ranks must offer it: lanes need not be fixed for a group's life.
LANE_BITS = 16
#: A rank that offers ``STOP - ticket`` (a negative state below ``STOP``) asks its lane to stop
#: that request at this tick; every rank that sees it applies it at the same tick.
STOP = -3

#: The module id of a help key (``help_key``): a rank that helps a request's lane (lane widening)
#: offers it for the wider lane's ticket, and the wider lane agrees on a call when every other rank
#: of it offers that call's key.
HELP_MODULE = (1 << 14) - 2

#: Stopped tickets (and cancelled request ids) a rank remembers, so that a request whose stop or
#: cancel came before its offer never starts.
STOPPED_MEMORY = 4096

#: Longest a tick in which no rank ran a module waits for new work before the next tick, so that
#: ranks that only wait do not spin hot. A new call or request ends the wait at once.
QUIET_TICK_S = 0.0005


class SessionFailedError(RuntimeError):
    """This rank's session broke: its collectives may no longer match the other ranks', so every
    request and call it held failed, and its group must be torn down."""


class RequestStoppedError(RuntimeError):
    """The request's lane stopped it (cancelled, past its deadline, or failed on another rank of
    the lane); raised in its request thread from its next sharded call."""


def key_of(module_id: int, ticket: int) -> int:
    """The key of a call of ``module_id`` by the request ``ticket``."""
    return (module_id + 1) * KEY_SPACE + ticket % KEY_SPACE


def module_of(key: int) -> int:
    """The module a call key runs; -1 for the key that starts a request."""
    return key // KEY_SPACE - 1


def lane_ticket(sequence: int, first: int = 0, size: int = 1) -> int:
    """The ticket of the group's ``sequence``-th request, run by the lane of ``size`` ranks from
    group rank ``first`` on. A lane of one rank is its rank's own: its ticket names no rank (a
    ticket of a runtime driven directly, ``0`` included, is one)."""
    if size == 1:
        return (sequence % (KEY_SPACE >> LANE_BITS)) << LANE_BITS
    if not (0 <= first < 256 and 1 < size < 256):
        raise ValueError(f"a lane of {size} ranks from rank {first} does not fit a ticket")
    return (sequence % (KEY_SPACE >> LANE_BITS)) << LANE_BITS | first << 8 | size


def help_key(ticket: int) -> int:
    """The key a helper offers for the wider lane ``ticket`` of a widened request: it joins any of
    that lane's calls."""
    return key_of(HELP_MODULE, ticket)


def widened(ticket: int, first: int, size: int) -> int:
    """The ticket of ``ticket``'s request on the wider lane of ``size`` ranks from ``first`` on: the
    same request (its sequence), another lane."""
    return lane_ticket(sequence_of(ticket), first, size)


def sequence_of(ticket: int) -> int:
    """The group's number of a ticket's request, without its lane."""
    return ticket >> LANE_BITS


def lane_of(ticket: int) -> tuple[int | None, int]:
    """``(first rank, size)`` of a ticket's lane; ``(None, 1)`` for a lane of one rank (its own)."""
    size = ticket & 0xFF
    return (None, 1) if size == 0 else ((ticket >> 8) & 0xFF, size)


def agreed_keys(gathered: Sequence[int]) -> dict[int, int]:
    """First rank of a lane -> the key all ranks of the lane offered at this tick, for the lanes
    that agree.

    A key's lane is its ticket's (``lane_of``). A lane agrees when all its ranks offer the same key
    (or, on a widened request's wider lane, the key's ``help_key``, as long as one rank offers the
    call itself) and none of the gathered states asks to stop that key's request (on a wider lane:
    the request's own lane's ticket); a lane of one rank agrees with itself. Lanes that agree never
    overlap: a rank offers one key. Every rank computes this from the same gathered list.
    """
    stops = [STOP - state for state in gathered if state <= STOP]
    stopped = set(stops)
    # Only lanes of several ranks send stops; their widened tickets share their sequence.
    stopped_sequences = {sequence_of(ticket) for ticket in stops if lane_of(ticket)[1] > 1}
    agreed = {}
    checked = set()  # first ranks of the lanes of several ranks read at this tick
    for rank, key in enumerate(gathered):
        if key < 0 or key % KEY_SPACE in stopped or module_of(key) == HELP_MODULE:
            continue
        first, size = lane_of(key % KEY_SPACE)
        if first is None:
            agreed[rank] = key
        elif first not in checked:  # its first rank may be a helper: read the lane at its first call
            checked.add(first)
            if sequence_of(key % KEY_SPACE) not in stopped_sequences and all(
                state in (key, help_key(key)) for state in gathered[first : first + size]
            ):
                agreed[first] = key
    return agreed


def agreed_mine(agreed: dict[int, int], state: int, rank: int) -> int | None:
    """The key this rank offered (``state``) when its lane agreed on it, else ``None``."""
    if state < 0:
        return None
    first, _ = lane_of(state % KEY_SPACE)
    return state if agreed.get(rank if first is None else first) == state else None


class Completion:
    """Completes exactly once, with a value or an error; later attempts are ignored."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Completion], None]] = []
        self.value: Any = None
        self.error: BaseException | None = None

    def complete(self, value: Any = None, error: BaseException | None = None) -> bool:
        """Sets the outcome; returns False (and changes nothing) when it was set already."""
        with self._lock:
            if self._event.is_set():
                return False
            self.value, self.error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True

    def add_done_callback(self, callback: Callable[[Completion], None]) -> None:
        """Calls ``callback(self)`` once the outcome is set (at once when it is already)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the outcome; returns whether it is set."""
        return self._event.wait(timeout)

    def get(self) -> Any:
        """Waits for the outcome: returns the value or raises the error."""
        self._event.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Job(Completion):
    """One request handed to a rank.

    Args:
        request: The request (anything with ``request_id`` and ``num_inference_steps``).
        ticket: The group's number for it: the same on every rank of the lane that runs it.
    """

    def __init__(self, request: Any, ticket: int = 0) -> None:
        super().__init__()
        self.request = request
        self.ticket = ticket
        #: The first rank and the size of its lane (``lane_of``: ``None`` for a lane of one rank).
        self.lane_first, self.lane_size = lane_of(ticket)
        #: Set when the caller gave up (deadline): the request's next step interrupts it.
        self.cancelled = False
        #: Set when its lane stopped it (lanes of several ranks): its next call raises.
        self.stopped = False

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` leads the job's lane: only a leader decodes and answers; the others end
        the request after its last denoising step."""
        return self.lane_first is None or rank == self.lane_first

    def cancel(self, error: BaseException) -> bool:
        """Answers the request with ``error`` and asks its run to stop at its next step."""
        self.cancelled = True
        return self.complete(error=error)


class ForwardCall(Completion):
    """A request thread's call of a sharded root module, run by the tick thread."""

    def __init__(
        self,
        module_id: int,
        args: tuple,
        kwargs: dict,
        ticket: int = 0,
        context: dict | None = None,
        request: Any = None,
    ):
        super().__init__()
        self.module_id = module_id
        #: The request whose thread made the call (its variant: adapters, step cache); ``None``
        #: outside one.
        self.request = request
        #: What the forward runs with besides its inputs (the request's ``batch_key``: its
        #: adapters, a step cache of its own): calls batch only with calls of the same key.
        self.batch_key = request.batch_key if request is not None else None
        self.args = args
        self.kwargs = kwargs
        #: The ticket of the request's own lane (stops name it), and ``ticket`` the lane this call
        #: runs on: the same, or a wider one while the request is widened (``retarget``).
        self.home_ticket = ticket
        self.ticket = ticket
        self.key = key_of(module_id, ticket)
        #: What the modules need to hand inputs and outputs between threads (CUDA streams, events,
        #: the CFG exchange).
        self.context: dict = dict(context or {})

    def retarget(self, ticket: int, source: int | None = None) -> None:
        """Runs the call on the lane of ``ticket``: its own lane's, or a wider one whose forward
        takes its inputs from the rank ``source`` of that lane (``"widened"`` in its context:
        ``(lane size, source)``)."""
        self.ticket, self.key = ticket, key_of(self.module_id, ticket)
        if ticket == self.home_ticket:
            self.context.pop("widened", None)
        else:
            self.context["widened"] = (lane_of(ticket)[1], source)


class Modules(Protocol):
    """The sharded root modules of a rank, by id (smallest first, the same on every rank)."""

    names: Sequence[str]

    def before_call(self, call: ForwardCall) -> None:
        """On the request thread, before the call is queued."""

    def forward(self, calls: list[ForwardCall]) -> list:
        """On the tick thread: one forward for ``calls`` (all of one module); one result each."""

    def after_call(self, call: ForwardCall) -> None:
        """On the request thread, once the call's result is set."""

    def ghost(self, module_id: int) -> None:
        """On the tick thread: the collectives of one forward of ``module_id``, without compute."""


#: The tick's all-gather: this rank's state in, every rank's state out (in rank order).
Exchange = Callable[[int], list[int]]


class Observer:
    """Where the runtime reports what it does; this one ignores it (profiling replaces it)."""

    def tick(
        self,
        number: int,
        start: float,
        state: int,
        module_id: int | None,
        ran: bool,
        gathered_at: float,
        done_at: float,
    ) -> None:
        """One tick: its number (the same on every rank of the group), what this rank offered,
        the module the tick ran, whether it ran here for real (else as a ghost pass), and
        ``time.perf_counter`` at its start, after its all-gather and at its end."""

    def request(self, request_id: str, event: str) -> None:
        """``start``, ``step`` (a denoising step ended) or ``end`` of a request."""
