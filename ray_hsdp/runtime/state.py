"""What the parts of a rank runtime share: one ``RankState`` that the callers' side
(``RankRuntime``), the tick loop (``ticks``), the request threads (``threads``) and the widening
(``widening``) each receive. Its condition guards the queues and tables; the counters and the
seams are read and written by the tick thread alone."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_hsdp.protocol import (
    STOPPED_MEMORY,
    Completion,
    Exchange,
    ForwardCall,
    Job,
    Modules,
    Observer,
    RequestStoppedError,
    SessionFailedError,
)


@dataclass
class Help:
    """What a helping rank holds: the request, the wider lane's ticket, and the rank of that lane
    (its index there) whose inputs each forward takes."""

    request: Any
    ticket: int
    source: int


@dataclass(eq=False)
class RankState:
    """One rank's execution state (``RankRuntime``'s arguments are documented there)."""

    run_request: Callable[[Any, Callable[[int, int], bool]], Any]
    rank: int
    slots: int
    #: The seams (``ray_hsdp.runtime.faults`` and profiling replace them): read at each use.
    modules: Modules | None
    exchange: Exchange | None
    patience_s: float
    max_batch: int
    lane_decodes: Callable[[Any], bool] | None
    observer: Observer = field(default_factory=Observer)
    ticks: int = 0
    idle_ticks: int = 0  # ticks at which this rank had nothing to do
    forwards: int = 0
    ghosts: int = 0
    batched: int = 0  # calls that ran in a forward together with others
    helped: int = 0  # forwards this rank ran as a helper (a counter of the rank's life)
    cond: threading.Condition = field(default_factory=threading.Condition)
    inbox: deque[Job] = field(default_factory=deque)
    calls: deque[ForwardCall] = field(default_factory=deque)  # queued by request threads
    waiting: list[ForwardCall] = field(default_factory=list)  # taken by the tick thread, not yet run
    current: list[ForwardCall] = field(default_factory=list)  # in the forward that runs now
    running: dict[Job, threading.Thread] = field(default_factory=dict)
    expecting: int = 0  # running requests that will call a sharded module again
    failure: SessionFailedError | None = None
    where: str = "session"  # what the tick thread does now (named by a failure)
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    threads_started: int = 0
    #: Whether a session runs now (its thread may sit in a collective).
    in_session: bool = False
    local: threading.local = field(default_factory=threading.local)  # a request thread's job
    stops: deque[int] = field(default_factory=deque)  # tickets this rank asks its lane to stop
    #: Keys of lanes of several ranks that some of their ranks offered at the last tick and the
    #: lane did not agree on (the same set on every rank): offered first at the next tick.
    behind: set[int] = field(default_factory=set)
    stopped: dict[int, None] = field(default_factory=dict)  # tickets stopped here (insertion-ordered, bounded)
    cancelled: dict[str, BaseException] = field(default_factory=dict)  # request id -> a cancel that came first
    help: Help | None = None  # the request this rank helps now (``runtime.widening``)
    #: Request id -> completed once its denoising loop ended here (insertion-ordered, bounded).
    loop_ends: dict[str, Completion] = field(default_factory=dict)

    def fail(self, cause: BaseException) -> SessionFailedError:
        """Fails the session: every request and call held here gets the error, new ones are refused."""
        with self.cond:
            if self.failure is None:
                if isinstance(cause, SessionFailedError):
                    self.failure = cause
                else:
                    first = next((line for line in str(cause).splitlines() if line.strip()), "").strip()
                    self.failure = SessionFailedError(
                        f"rank {self.rank}: {self.where} failed: {type(cause).__name__}: {first}"[:400]
                    )
            message = str(self.failure)
            jobs = [*self.inbox, *self.running]
            calls = [*self.current, *self.waiting, *self.calls]
            self.inbox.clear()
            self.calls.clear()
            self.waiting, self.current = [], []
            self.help = None
            self.cond.notify_all()
        # Jobs first: a request thread woken by its call's error must find its job answered.
        for job in jobs:
            job.complete(error=SessionFailedError(message))
        for call in calls:
            call.complete(error=SessionFailedError(message))
        return self.failure

    def forget_session(self) -> None:
        """Forgets a failed session's requests, stops and helps (lock held; its threads ended)."""
        self.failure = None
        self.running.clear()
        self.expecting = 0
        self.progress.clear()
        self.stops.clear()
        self.behind.clear()
        self.stopped.clear()
        self.cancelled.clear()
        self.help = None
        self.loop_ends = {}

    def ask_stop(self, ticket: int) -> None:
        """Asks the lane of ``ticket`` to stop its request at the next tick (once)."""
        with self.cond:
            if ticket not in self.stopped and ticket not in self.stops:
                self.stops.append(ticket)
                self.cond.notify_all()

    def loop_end(self, request_id: str) -> Completion:
        """Completes once ``request_id``'s denoising loop ended here (``RankRuntime.loop_end``)."""
        with self.cond:
            end = self.loop_ends.get(request_id)
            if end is None:
                end = self.loop_ends[request_id] = Completion()
            return end

    def note_loop_end(self, request_id: str) -> None:
        """``request_id``'s loop ended here; the oldest ended loops beyond ``STOPPED_MEMORY`` are forgotten."""
        self.loop_end(request_id).complete()
        with self.cond:
            excess = len(self.loop_ends) - STOPPED_MEMORY
            if excess > 0:
                for ended in [key for key, end in self.loop_ends.items() if end.done][:excess]:
                    del self.loop_ends[ended]


def stopped_error(job: Job) -> RequestStoppedError:
    """The error of a request its lane stopped."""
    return RequestStoppedError(
        f"request {job.request.request_id!r} was stopped by its lane (cancelled, past its deadline, "
        "or failed on another rank of the lane)"
    )
