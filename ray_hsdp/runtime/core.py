"""The rank runtime: one tick thread, the request threads, the waiting calls (contract: the
package docstring). The tick loop lives in ``ticks``, the request threads in ``threads``; the
protocol's parts in ``ray_hsdp.protocol``."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ray_hsdp.protocol import (  # noqa: F401 (the runtime's names, imported from here)
    BUSY,
    IDLE,
    KEY_SPACE,
    STOP,
    STOPPED_MEMORY,
    Completion,
    Exchange,
    ForwardCall,
    Job,
    Modules,
    Observer,
    RequestStoppedError,
    SessionFailedError,
    agreed_keys,
    key_of,
    module_of,
)
from ray_hsdp.runtime.threads import RequestThreads
from ray_hsdp.runtime.ticks import TickLoop
from ray_hsdp.runtime.widening import RankWidening


class RankRuntime(TickLoop, RequestThreads, RankWidening):
    """One rank's execution (see the package docstring for the contract).

    A request runs on the lane its ticket names (``lane_ticket``): its rank alone, or a block of
    consecutive ranks that runs it on all of them: a call runs only at a tick where every rank of
    the lane offers it, stops act at one tick on all of them, and only the lane's first rank
    decodes and answers. Requests on lanes of different sizes run side by side, and a request's
    forwards may run on a wider lane while its other ranks help (``runtime.widening``).

    Args:
        run_request: ``run_request(request, on_step)`` computes a request on a request thread;
            ``on_step(done, total)`` after each denoising step returns True to interrupt it. A
            request has a ``request_id``, ``num_inference_steps`` and a ``batch_key`` (what its
            forwards run with besides their inputs: a forward batches only calls of one key).
        rank: This rank's index in its group (where it sits in every tick's gathered list).
        slots: Requests that run at once (each in a thread of its own).
        modules: The sharded root modules; ``None`` for an unsharded rank, which has no ticks.
        exchange: The tick's all-gather; given exactly when ``modules`` is.
        patience_s: Longest a rank whose requests will call again waits for their next call
            before it ticks without it (a request thread needs a few milliseconds between two
            forwards, and a forward ghosted for want of them is lost).
        max_batch: Most waiting calls of one module run as one batched forward (lanes of one rank).
        lane_decodes: ``lane_decodes(request)``: whether all ranks of the lane decode the request
            together after its last step (a split decode, whose collectives run on the lane's own
            process group from the request threads). The ranks then go on past the last step, and
            each rank runs its lane's decodes one at a time in ticket order, the same order on
            every rank of the lane.
    """

    def __init__(
        self,
        run_request: Callable[[Any, Callable[[int, int], bool]], Any],
        *,
        rank: int = 0,
        slots: int = 1,
        modules: Modules | None = None,
        exchange: Exchange | None = None,
        patience_s: float = 0.1,
        max_batch: int = 1,
        lane_decodes: Callable[[Any], bool] | None = None,
    ) -> None:
        if (modules is None) != (exchange is None):
            raise ValueError("modules and exchange go together: both for a sharded rank, neither otherwise")
        self._run_request = run_request
        self.rank = rank
        self.slots = slots
        self.modules = modules
        self.exchange = exchange
        self.observer = Observer()
        self.patience_s = patience_s
        self.max_batch = max_batch
        self.lane_decodes = lane_decodes
        self.ticks = 0
        self.idle_ticks = 0  # ticks at which this rank had nothing to do
        self.forwards = 0
        self.ghosts = 0
        self.batched = 0  # calls that ran in a forward together with others
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._calls: deque[ForwardCall] = deque()  # queued by request threads
        self._waiting: list[ForwardCall] = []  # taken by the tick thread, not yet run
        self._current: list[ForwardCall] = []  # in the forward that runs now
        self._running: dict[Job, threading.Thread] = {}
        self._expecting = 0  # running requests that will call a sharded module again
        self._failure: SessionFailedError | None = None
        self._where = "session"
        self._progress: dict[str, tuple[int, int]] = {}
        self._threads_started = 0
        #: Whether a session runs now (its thread may sit in a collective).
        self.in_session = False
        self._local = threading.local()  # a request thread's job
        self._stops: deque[int] = deque()  # tickets this rank asks its lane to stop
        # Keys of lanes of several ranks that some of their ranks offered at the last tick and the
        # lane did not agree on (the same set on every rank): offered first at the next tick.
        self._behind: set[int] = set()
        self._stopped: dict[int, None] = {}  # tickets stopped here (insertion-ordered, bounded)
        self._cancelled: dict[str, BaseException] = {}  # request id -> the error of a cancel that came first
        self._init_widening()

    # ---- callers' side ---------------------------------------------------------------------

    def submit(self, request: Any, ticket: int = 0) -> Job:
        """Queues a request for this rank's running or next session; a failed rank fails it at once.

        Args:
            request: The request.
            ticket: The group's number for it, the same on every rank of its lane.
        """
        job = Job(request, ticket)
        with self._cond:
            cancelled = self._cancelled.pop(request.request_id, None)
            if self._failure is None and ticket in self._stopped:
                # Its lane stopped it before this rank's offer arrived.
                job.stopped = True
            elif self._failure is None and cancelled is None:
                self._inbox.append(job)
                self._cond.notify_all()
                return job
            message = str(self._failure) if self._failure is not None else None
        self._note_loop_end(request.request_id)  # it never runs here
        if message is not None:
            job.complete(error=SessionFailedError(message))
        elif cancelled is not None:
            # Its cancel arrived before it did (they travel on different threads of the actor).
            self.cancel_job(job, cancelled)
        else:
            job.complete(error=self._stopped_error(job))
        return job

    def call(self, module_id: int, args: tuple, kwargs: dict, context: dict | None = None) -> Any:
        """A request thread's forward of sharded module ``module_id``: run by the tick thread at a tick.

        Args:
            context: Handed to the modules with the call (for example the CFG exchange's part).
        """
        job: Job | None = getattr(self._local, "job", None)
        call = ForwardCall(
            module_id,
            args,
            kwargs,
            job.ticket if job is not None else 0,
            context,
            job.request if job is not None else None,
        )
        modules = self.modules
        modules.before_call(call)
        with self._cond:
            failure = self._failure
            stopped = job is not None and job.stopped
            if failure is None and not stopped:
                self._calls.append(call)
                self._cond.notify_all()
        if failure is not None:  # a failed rank refuses the call, which still completes once
            call.complete(error=SessionFailedError(str(failure)))
        elif stopped:
            call.complete(error=self._stopped_error(job))
        value = call.get()
        modules.after_call(call)
        return value

    def cancel(self, request_id: str, error: BaseException) -> bool:
        """Answers the request with ``error`` and stops it: a queued one never starts, a running
        one at the end of its current step (in a lane of several ranks: at the next tick, on all
        of them). A cancel of a request not handed to this rank yet is remembered: when it comes,
        it is answered with ``error`` at once and never starts.

        Returns:
            Whether the cancel answered a request held here (False for one that had already ended).
        """
        with self._cond:
            jobs = [job for job in [*self._inbox, *self._running] if job.request.request_id == request_id]
            if not jobs:
                self._cancelled[request_id] = error
                while len(self._cancelled) > STOPPED_MEMORY:
                    del self._cancelled[next(iter(self._cancelled))]
        return any([self.cancel_job(job, error) for job in jobs])

    def cancel_job(self, job: Job, error: BaseException) -> bool:
        """Answers ``job`` with ``error`` and stops it (see ``cancel``); False when it had an answer already."""
        answered = job.cancel(error)
        if job.lane_size > 1:
            self._ask_stop(job.ticket)
        return answered

    def _ask_stop(self, ticket: int) -> None:
        with self._cond:
            if ticket not in self._stopped and ticket not in self._stops:
                self._stops.append(ticket)
                self._cond.notify_all()

    @staticmethod
    def _stopped_error(job: Job) -> RequestStoppedError:
        return RequestStoppedError(
            f"request {job.request.request_id!r} was stopped by its lane (cancelled, past its deadline, "
            "or failed on another rank of the lane)"
        )

    @property
    def failure(self) -> SessionFailedError | None:
        """Why this rank's session failed, or ``None``."""
        return self._failure

    def current_ticket(self) -> int:
        """On a request thread: the ticket of its request (which names its lane)."""
        return self._local.job.ticket

    def progress(self) -> dict[str, tuple[int, int]]:
        """Request id -> (denoising steps done, steps in all) of the requests running here."""
        return dict(self._progress)

    def request_threads(self) -> list[threading.Thread]:
        """The threads of the requests running now."""
        with self._cond:
            return list(self._running.values())

    # ---- the tick thread -------------------------------------------------------------------

    def session(self) -> int:
        """Runs queued requests, in lock step with the other ranks, until every rank is idle.

        Call it on every rank of the group at once, from the thread that alone issues this
        rank's collectives. All ranks end at the same tick: the first where all were idle.

        Returns:
            How many requests this session started.

        Raises:
            SessionFailedError: A forward, ghost pass or tick failed here (or did earlier); every
                request and call this rank held has been failed with it.
        """
        with self._cond:
            if self._failure is not None:
                raise SessionFailedError(str(self._failure))
        before = self._threads_started
        self.in_session = True
        try:
            while True:
                if self._failure is not None:  # a request thread failed it (a split decode's error)
                    raise self._failure
                self._start_requests()  # a lane of several ranks starts its requests at a tick
                if self.modules is None:
                    if self._wait_for_requests():
                        return self._threads_started - before
                elif self._tick():
                    return self._threads_started - before
        except BaseException as err:
            raise self.fail(err) from err
        finally:
            self.in_session = False

    def fail(self, cause: BaseException) -> SessionFailedError:
        """Fails the session: every request and call held here gets the error, new ones are refused.

        Called by ``session`` on its own thread (it reads the tick thread's waiting calls).
        """
        with self._cond:
            if self._failure is None:
                if isinstance(cause, SessionFailedError):
                    self._failure = cause
                else:
                    first = next((line for line in str(cause).splitlines() if line.strip()), "").strip()
                    self._failure = SessionFailedError(
                        f"rank {self.rank}: {self._where} failed: {type(cause).__name__}: {first}"[:400]
                    )
            message = str(self._failure)
            jobs = [*self._inbox, *self._running]
            calls = [*self._current, *self._waiting, *self._calls]
            self._inbox.clear()
            self._calls.clear()
            self._waiting, self._current = [], []
            self._help = None
            self._cond.notify_all()
        # Jobs first: a request thread woken by its call's error must find its job answered.
        for job in jobs:
            job.complete(error=SessionFailedError(message))
        for call in calls:
            call.complete(error=SessionFailedError(message))
        return self._failure

    def recover(self, timeout_s: float) -> None:
        """Takes requests again after a failed session, once the group formed its process groups
        anew (a mended group): the failed requests' threads have ended (they were answered when the
        session failed), and nothing of the lost session's lock step is left.

        Raises:
            RuntimeError: A session still runs here, or a request thread outlived ``timeout_s``.
        """
        if self.in_session:
            raise RuntimeError(f"rank {self.rank}: a session still runs; it cannot recover")
        for thread in self.request_threads():
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"rank {self.rank}: a failed request's thread did not end within {timeout_s:g}s")
        with self._cond:
            self._failure = None
            self._running.clear()
            self._expecting = 0
            self._progress.clear()
            self._stops.clear()
            self._behind.clear()
            self._stopped.clear()
            self._cancelled.clear()
            helped = self.helped  # a counter of the rank's life, not of the session
            self._init_widening()
            self.helped = helped

    # ---- request threads -------------------------------------------------------------------
