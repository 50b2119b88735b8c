"""The rank runtime: one tick thread, the request threads, the waiting calls (contract: the
package docstring)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ray_hsdp.batching import compatible

#: States a rank brings to a tick besides a module id: nothing to do, or requests running with
#: no forward waiting (decoding, or between two forwards).
IDLE = -1
BUSY = -2

#: Longest a tick in which no rank ran a module waits for new work before the next tick, so that
#: ranks that only wait do not spin hot. A new call or request ends the wait at once.
_QUIET_TICK_S = 0.0005


class SessionFailedError(RuntimeError):
    """This rank's session broke: its collectives may no longer match the other ranks', so every
    request and call it held failed, and its group must be torn down."""


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
    """One request handed to a rank."""

    def __init__(self, request: Any) -> None:
        super().__init__()
        self.request = request
        #: Set when the caller gave up (deadline): the request's next step interrupts it.
        self.cancelled = False

    def cancel(self, error: BaseException) -> bool:
        """Answers the request with ``error`` and asks its run to stop at its next step."""
        self.cancelled = True
        return self.complete(error=error)


class ForwardCall(Completion):
    """A request thread's call of a sharded root module, run by the tick thread."""

    def __init__(self, module_id: int, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.module_id = module_id
        self.args = args
        self.kwargs = kwargs
        #: What the modules need to hand inputs and outputs between threads (CUDA streams, events).
        self.context: dict = {}


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

    def tick(self, start: float, state: int, module_id: int | None, gathered_at: float, done_at: float) -> None:
        """One tick: ``time.perf_counter`` at its start, after its all-gather, at its end."""

    def request(self, request_id: str, event: str) -> None:
        """``start``, ``step`` (a denoising step ended) or ``end`` of a request."""


class RankRuntime:
    """One rank's execution (see the package docstring for the contract).

    Args:
        run_request: ``run_request(request, on_step)`` computes a request on a request thread;
            ``on_step(done, total)`` after each denoising step returns True to interrupt it.
        rank: This rank's index in its group (for names and messages).
        slots: Requests that run at once (each in a thread of its own).
        modules: The sharded root modules; ``None`` for an unsharded rank, which has no ticks.
        exchange: The tick's all-gather; given exactly when ``modules`` is.
        patience_s: Longest a rank whose requests will call again waits for their next call
            before it ticks without it (a request thread needs a few milliseconds between two
            forwards, and a forward ghosted for want of them is lost).
        max_batch: Most waiting calls of one module run as one batched forward.
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
        self.ticks = 0
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

    # ---- callers' side ---------------------------------------------------------------------

    def submit(self, request: Any) -> Job:
        """Queues a request for this rank's running or next session; a failed rank fails it at once."""
        job = Job(request)
        with self._cond:
            if self._failure is None:
                self._inbox.append(job)
                self._cond.notify_all()
                return job
            message = str(self._failure)
        job.complete(error=SessionFailedError(message))
        return job

    def call(self, module_id: int, args: tuple, kwargs: dict) -> Any:
        """A request thread's forward of sharded module ``module_id``: run by the tick thread at a tick."""
        call = ForwardCall(module_id, args, kwargs)
        modules = self.modules
        modules.before_call(call)
        with self._cond:
            failure = self._failure
            if failure is None:
                self._calls.append(call)
                self._cond.notify_all()
        if failure is not None:  # a failed rank refuses the call, which still completes once
            call.complete(error=SessionFailedError(str(failure)))
        value = call.get()
        modules.after_call(call)
        return value

    def cancel(self, request_id: str, error: BaseException) -> bool:
        """Answers the request with ``error`` and stops it: a queued one never starts, a running
        one at the end of its current step. Returns whether this rank held it."""
        with self._cond:
            jobs = [job for job in [*self._inbox, *self._running] if job.request.request_id == request_id]
        for job in jobs:
            job.cancel(error)
        return bool(jobs)

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
        started = 0
        try:
            while True:
                started += self._start_requests()
                if self.modules is None:
                    if self._wait_for_requests():
                        return started
                elif self._tick():
                    return started
        except BaseException as err:
            raise self.fail(err) from err

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

    def _start_requests(self) -> int:
        started = 0
        with self._cond:
            while len(self._running) < self.slots and self._inbox:
                job = self._inbox.popleft()
                if job.done:  # its caller gave up while it was queued
                    continue
                if self.modules is not None:
                    # Before the thread starts: the next tick must already wait for its first call.
                    self._expecting += 1
                thread = threading.Thread(
                    target=self._run_job,
                    args=(job,),
                    name=f"rank{self.rank}-request-{self._threads_started}",
                    daemon=True,
                )
                self._running[job] = thread
                self._threads_started += 1
                started += 1
                thread.start()
        return started

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
        state = min((c.module_id for c in self._waiting), default=BUSY if busy else IDLE)
        self._where = "the tick's all-gather"
        start = time.perf_counter()
        gathered = self.exchange(state)
        gathered_at = time.perf_counter()
        self.ticks += 1
        module_id = min((g for g in gathered if g >= 0), default=None)
        if module_id is not None:
            batch = self._batch(module_id)
            if batch:
                self._where = f"the forward of {self.modules.names[module_id]}"
                self._forward(batch)
            else:
                self._where = f"a ghost pass of {self.modules.names[module_id]}"
                self.modules.ghost(module_id)
                self.ghosts += 1
        self._where = "a tick"
        self.observer.tick(start, state, module_id, gathered_at, time.perf_counter())
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

    def _batch(self, module_id: int) -> list[ForwardCall]:
        """Takes the oldest waiting call of ``module_id`` and up to ``max_batch - 1`` more that can
        run in the same forward."""
        batch: list[ForwardCall] = []
        with self._cond:
            for call in list(self._waiting):
                if call.module_id != module_id or len(batch) == self.max_batch:
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
        with self._cond:
            self._current = []
        for call, result in zip(batch, results):
            call.complete(result)
        if len(batch) > 1:
            self.batched += len(batch)

    # ---- request threads -------------------------------------------------------------------

    def _run_job(self, job: Job) -> None:
        request_id = job.request.request_id
        expecting = [self.modules is not None]

        def stop_expecting() -> None:
            if expecting[0]:
                expecting[0] = False
                with self._cond:
                    self._expecting -= 1
                    self._cond.notify_all()

        def on_step(done: int, total: int) -> bool:
            self._progress[request_id] = (done, total)
            self.observer.request(request_id, "step")
            if done >= total or job.cancelled:
                stop_expecting()  # decoding (or interrupted) from here: no more sharded forwards
            return job.cancelled

        self._progress[request_id] = (0, job.request.num_inference_steps)
        self.observer.request(request_id, "start")
        try:
            job.complete(self._run_request(job.request, on_step))
        except BaseException as err:  # noqa: BLE001 - the request's own error belongs to its caller
            job.complete(error=err)
        finally:
            stop_expecting()
            self._progress.pop(request_id, None)
            self.observer.request(request_id, "end")
            with self._cond:
                self._running.pop(job, None)
                self._cond.notify_all()
