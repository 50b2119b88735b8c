"""The rank runtime: one tick thread, the request threads, the waiting calls (contract: the
package docstring)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ray_hsdp.request import LaneCollectiveError

#: States a rank brings to a tick besides a module id: nothing to do, or requests running with
#: no forward waiting (decoding, or between two forwards).
IDLE = -1
BUSY = -2

#: A rank offers at each tick a key: ``(module_id + 1) * KEY_SPACE + ticket`` for a waiting call,
#: or ``ticket`` to start a queued request (lanes of several ranks). A lane acts on a key only when
#: all its ranks offer it, so its ranks start the same requests and run the same calls together.
KEY_SPACE = 1 << 40
#: A rank that offers ``STOP - ticket`` (a negative state below ``STOP``) asks its lane to stop
#: that request at this tick; every rank that sees it applies it at the same tick.
STOP = -3

#: Stopped tickets (and cancelled request ids) a rank remembers, so that a request whose stop or
#: cancel came before its offer never starts.
_STOPPED_MEMORY = 4096

#: Longest a tick in which no rank ran a module waits for new work before the next tick, so that
#: ranks that only wait do not spin hot. A new call or request ends the wait at once.
_QUIET_TICK_S = 0.0005


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


def agreed_keys(gathered: Sequence[int], lane_size: int) -> dict[int, int]:
    """Lane index -> the key all ranks of the lane offered at this tick, for the lanes that agree.

    A lane agrees when all its ranks offer the same call key and none of the gathered states asks
    to stop that call's request. Every rank computes this from the same gathered list.
    """
    stopped = {STOP - state for state in gathered if state <= STOP}
    agreed = {}
    for lane in range(len(gathered) // lane_size):
        row = gathered[lane * lane_size : (lane + 1) * lane_size]
        key = row[0]
        if key >= 0 and all(state == key for state in row) and key % KEY_SPACE not in stopped:
            agreed[lane] = key
    return agreed


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
        #: Set when the caller gave up (deadline): the request's next step interrupts it.
        self.cancelled = False
        #: Set when its lane stopped it (lanes of several ranks): its next call raises.
        self.stopped = False

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
        self.ticket = ticket
        self.key = key_of(module_id, ticket)
        #: What the modules need to hand inputs and outputs between threads (CUDA streams, events,
        #: the CFG exchange).
        self.context: dict = dict(context or {})


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


class RankRuntime:
    """One rank's execution (see the package docstring for the contract).

    Args:
        run_request: ``run_request(request, on_step)`` computes a request on a request thread;
            ``on_step(done, total)`` after each denoising step returns True to interrupt it. A
            request has a ``request_id``, ``num_inference_steps`` and a ``batch_key`` (what its
            forwards run with besides their inputs: a forward batches only calls of one key).
        rank: This rank's index in its group (for names and messages).
        slots: Requests that run at once (each in a thread of its own).
        modules: The sharded root modules; ``None`` for an unsharded rank, which has no ticks.
        exchange: The tick's all-gather; given exactly when ``modules`` is.
        patience_s: Longest a rank whose requests will call again waits for their next call
            before it ticks without it (a request thread needs a few milliseconds between two
            forwards, and a forward ghosted for want of them is lost).
        max_batch: Most waiting calls of one module run as one batched forward (lanes of one rank).
        lane_size: Ranks of this rank's lane (consecutive in the gathered list). A lane of several
            ranks runs each of its requests on all of them: a call runs only at a tick where every
            rank of the lane offers it, and stops act at one tick on all of them.
        leads: Whether this rank leads its lane: only a leader decodes and answers; the others
            end each request after its last denoising step.
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
        lane_size: int = 1,
        leads: bool = True,
        lane_decodes: Callable[[Any], bool] | None = None,
    ) -> None:
        if (modules is None) != (exchange is None):
            raise ValueError("modules and exchange go together: both for a sharded rank, neither otherwise")
        if lane_size > 1 and (modules is None or max_batch != 1):
            raise ValueError("a lane of several ranks needs sharded modules and one call per forward")
        self._run_request = run_request
        self.rank = rank
        self.slots = slots
        self.modules = modules
        self.exchange = exchange
        self.observer = Observer()
        self.patience_s = patience_s
        self.max_batch = max_batch
        self.lane_size = lane_size
        self.leads = leads
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
        self._stopped: dict[int, None] = {}  # tickets stopped here (insertion-ordered, bounded)
        self._cancelled: dict[str, BaseException] = {}  # request id -> the error of a cancel that came first

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
                while len(self._cancelled) > _STOPPED_MEMORY:
                    del self._cancelled[next(iter(self._cancelled))]
        return any([self.cancel_job(job, error) for job in jobs])

    def cancel_job(self, job: Job, error: BaseException) -> bool:
        """Answers ``job`` with ``error`` and stops it (see ``cancel``); False when it had an answer already."""
        answered = job.cancel(error)
        if self.lane_size > 1:
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
                if self.lane_size == 1:  # a lane of several ranks starts requests at a tick
                    self._start_requests()
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
            self._cond.notify_all()
        # Jobs first: a request thread woken by its call's error must find its job answered.
        for job in jobs:
            job.complete(error=SessionFailedError(message))
        for call in calls:
            call.complete(error=SessionFailedError(message))
        return self._failure

    def _start_requests(self) -> None:
        with self._cond:
            while len(self._running) < self.slots and self._inbox:
                job = self._inbox.popleft()
                if not job.done:  # else its caller gave up while it was queued
                    self._start(job)

    def _start(self, job: Job) -> None:
        """Starts ``job``'s request thread (called with the lock held)."""
        if self.modules is not None:
            # Before the thread starts: the next tick must already wait for its first call.
            self._expecting += 1
        thread = threading.Thread(
            target=self._run_job, args=(job,), name=f"rank{self.rank}-request-{self._threads_started}", daemon=True
        )
        self._running[job] = thread
        self._threads_started += 1
        thread.start()

    def _lane_state(self, busy: bool) -> int:
        """What this rank offers at a tick: a stop it asks for, else its cheapest waiting call, else
        the oldest queued request if it has room for it, else ``BUSY`` or ``IDLE``.

        Calls come before starts: the ranks of a lane run the same requests, so their calls
        agree, while a start waits until every rank of the lane has room (a leader still decoding
        has none).
        """
        with self._cond:
            if self._stops:
                return STOP - self._stops.popleft()
            if self._waiting:
                return min(c.key for c in self._waiting)
            if self.lane_size > 1 and self._inbox and len(self._running) < self.slots:
                return min(job.ticket for job in self._inbox) % KEY_SPACE
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
        agreed = agreed_keys(gathered, self.lane_size)
        mine = agreed.get(self.rank // self.lane_size)
        if mine is not None and module_of(mine) < 0:
            self._start_agreed(mine)
        module_id = min((module_of(key) for key in agreed.values() if module_of(key) >= 0), default=None)
        batch = []
        if module_id is not None:
            batch = self._batch(mine) if mine is not None and module_of(mine) == module_id else []
            if batch:
                self._where = f"the forward of {self.modules.names[module_id]}"
                self._forward(batch)
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
                    self._cond.wait(_QUIET_TICK_S)
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
                while len(self._stopped) > _STOPPED_MEMORY:
                    del self._stopped[next(iter(self._stopped))]
                for job in [*self._inbox, *self._running]:
                    if job.ticket != ticket:
                        continue
                    job.stopped = True
                    if job in self._inbox:
                        self._inbox.remove(job)
                        dropped.append(job)
                for queue in (self._calls, self._waiting):
                    for call in [c for c in queue if c.ticket == ticket]:
                        queue.remove(call)
                        failed.append(call)
        for job in dropped:
            job.complete(error=self._stopped_error(job))
        for call in failed:
            call.complete(error=RequestStoppedError(f"the request of ticket {call.ticket} was stopped by its lane"))

    def _batch(self, key: int) -> list[ForwardCall]:
        """Takes the waiting call of ``key`` and, in a lane of one rank, up to ``max_batch - 1`` more
        calls of its module that can run in the same forward (oldest first)."""
        # Here, not at the top: the runtime's importers (a Serve replica, through the group) never
        # batch, and need not import torch.
        from ray_hsdp.batching import compatible

        module_id = module_of(key)
        batch: list[ForwardCall] = []
        with self._cond:
            first = next((c for c in self._waiting if c.key == key), None)
            if first is None:
                return []
            if self.lane_size == 1:  # the oldest call of the module leads the batch
                first = next(c for c in self._waiting if c.module_id == module_id)
            batch.append(first)
            self._waiting.remove(first)
            for call in list(self._waiting):
                if call.module_id != module_id or len(batch) == self.max_batch or call.batch_key != first.batch_key:
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

    # ---- request threads -------------------------------------------------------------------

    def _await_decode_turn(self, job: Job) -> None:
        """Waits until no request this rank started before ``job`` (a smaller ticket) still runs:
        the ranks of a lane run the same requests, so they enter its split decodes in one order.

        Raises:
            SessionFailedError: The session failed meanwhile.
        """
        with self._cond:
            while self._failure is None and any(other.ticket < job.ticket for other in self._running):
                self._cond.wait()
            if self._failure is not None:
                raise SessionFailedError(str(self._failure))

    def _run_job(self, job: Job) -> None:
        request_id = job.request.request_id
        expecting = [self.modules is not None]
        self._local.job = job
        lane = self.lane_size > 1
        follower_done = [False]
        decodes_together = False

        def stop_expecting() -> None:
            if expecting[0]:
                expecting[0] = False
                with self._cond:
                    self._expecting -= 1
                    self._cond.notify_all()

        def on_step(done: int, total: int) -> bool:
            self._progress[request_id] = (done, total)
            self.observer.request(request_id, "step")
            # A lane acts on its stops, decided at a tick; a lone rank on its own cancellation.
            halt = job.stopped if lane else job.cancelled
            if done >= total and not self.leads:
                follower_done[0] = True  # the leader answers; this rank is done once it decoded its part
                halt = not decodes_together
            if done >= total or halt:
                stop_expecting()  # decoding (or interrupted) from here: no more sharded forwards
            if done >= total and decodes_together:
                # Past the last step the lane decodes whatever stop comes: its ranks may read a
                # stop at different moments, and a decode all of them must join cannot be skipped
                # by some of them.
                self._await_decode_turn(job)
                return False
            return halt

        self._progress[request_id] = (0, job.request.num_inference_steps)
        self.observer.request(request_id, "start")
        try:
            decodes_together = lane and self.lane_decodes is not None and self.lane_decodes(job.request)
            job.complete(self._run_request(job.request, on_step))
        except LaneCollectiveError as err:
            # Its lane's other ranks may wait in the decode's collectives for this one: the
            # session fails (the tick thread raises it), and with it every request held here.
            self.fail(SessionFailedError(f"rank {self.rank}: {err}"[:400]))
        except BaseException as err:  # noqa: BLE001 - the request's own error belongs to its caller
            if follower_done[0]:
                job.complete(None)
            else:
                job.complete(error=err)
                if lane and not job.stopped:
                    # The other ranks of the lane may wait on a call this one will never make.
                    self._ask_stop(job.ticket)
        finally:
            self._local.job = None
            stop_expecting()
            self._progress.pop(request_id, None)
            self.observer.request(request_id, "end")
            with self._cond:
                self._running.pop(job, None)
                self._cond.notify_all()
