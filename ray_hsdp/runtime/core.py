"""The rank runtime: one tick thread, the request threads, the waiting calls (contract: the
package docstring). ``RankRuntime`` is the callers' side; what its parts share is one
``RankState`` (``state``), which the tick loop (``ticks``), the request threads (``threads``) and
the widening (``widening``) receive; the protocol's parts are in ``ray_hsdp.protocol``."""

from __future__ import annotations

import threading
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
from ray_hsdp.runtime.state import RankState, stopped_error
from ray_hsdp.runtime.threads import RequestThreads
from ray_hsdp.runtime.ticks import TickLoop
from ray_hsdp.runtime.widening import RankWidening


class _OnState:
    """An attribute of the runtime kept on its state, where its parts read it: the seams
    (``exchange``, ``modules``, ``observer``) are replaced on the runtime (fault injection,
    profiling) and the tick thread must see the replacement."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, runtime: RankRuntime | None, owner: type | None = None) -> Any:
        return self if runtime is None else getattr(runtime.state, self.name)

    def __set__(self, runtime: RankRuntime, value: Any) -> None:
        setattr(runtime.state, self.name, value)


class RankRuntime:
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
        #: What the tick loop, the request threads and the widening share.
        self.state = RankState(
            run_request,
            rank=rank,
            slots=slots,
            modules=modules,
            exchange=exchange,
            patience_s=patience_s,
            max_batch=max_batch,
            lane_decodes=lane_decodes,
        )
        self._widening = RankWidening(self.state)
        self._tick_loop = TickLoop(self.state, RequestThreads(self.state), self._widening)

    #: The arguments and the seams, read by the parts from the state.
    rank = _OnState()
    slots = _OnState()
    modules = _OnState()
    exchange = _OnState()
    observer = _OnState()
    patience_s = _OnState()
    max_batch = _OnState()
    lane_decodes = _OnState()
    #: What this rank did: ticks, those at which it had nothing to do, real forwards, ghost
    #: passes, calls that ran batched with others, forwards it ran as a helper.
    ticks = _OnState()
    idle_ticks = _OnState()
    forwards = _OnState()
    ghosts = _OnState()
    batched = _OnState()
    helped = _OnState()
    #: Whether a session runs now (its thread may sit in a collective).
    in_session = _OnState()

    # ---- callers' side ---------------------------------------------------------------------

    def submit(self, request: Any, ticket: int = 0) -> Job:
        """Queues a request for this rank's running or next session; a failed rank fails it at once.

        Args:
            request: The request.
            ticket: The group's number for it, the same on every rank of its lane.
        """
        state = self.state
        job = Job(request, ticket)
        with state.cond:
            cancelled = state.cancelled.pop(request.request_id, None)
            if state.failure is None and ticket in state.stopped:
                # Its lane stopped it before this rank's offer arrived.
                job.stopped = True
            elif state.failure is None and cancelled is None:
                state.inbox.append(job)
                state.cond.notify_all()
                return job
            message = str(state.failure) if state.failure is not None else None
        state.note_loop_end(request.request_id)  # it never runs here
        if message is not None:
            job.complete(error=SessionFailedError(message))
        elif cancelled is not None:
            # Its cancel arrived before it did (they travel on different threads of the actor).
            self.cancel_job(job, cancelled)
        else:
            job.complete(error=stopped_error(job))
        return job

    def call(self, module_id: int, args: tuple, kwargs: dict, context: dict | None = None) -> Any:
        """A request thread's forward of sharded module ``module_id``: run by the tick thread at a tick.

        Args:
            context: Handed to the modules with the call (for example the CFG exchange's part).
        """
        state = self.state
        job: Job | None = getattr(state.local, "job", None)
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
        with state.cond:
            failure = state.failure
            stopped = job is not None and job.stopped
            if failure is None and not stopped:
                state.calls.append(call)
                state.cond.notify_all()
        if failure is not None:  # a failed rank refuses the call, which still completes once
            call.complete(error=SessionFailedError(str(failure)))
        elif stopped:
            call.complete(error=stopped_error(job))
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
        state = self.state
        with state.cond:
            jobs = [job for job in [*state.inbox, *state.running] if job.request.request_id == request_id]
            if not jobs:
                state.cancelled[request_id] = error
                while len(state.cancelled) > STOPPED_MEMORY:
                    del state.cancelled[next(iter(state.cancelled))]
        return any([self.cancel_job(job, error) for job in jobs])

    def cancel_job(self, job: Job, error: BaseException) -> bool:
        """Answers ``job`` with ``error`` and stops it (see ``cancel``); False when it had an answer already."""
        answered = job.cancel(error)
        if job.lane_size > 1:
            self.state.ask_stop(job.ticket)
        return answered

    @property
    def failure(self) -> SessionFailedError | None:
        """Why this rank's session failed, or ``None``."""
        return self.state.failure

    def current_ticket(self) -> int:
        """On a request thread: the ticket of its request (which names its lane)."""
        return self.state.local.job.ticket

    def progress(self) -> dict[str, tuple[int, int]]:
        """Request id -> (denoising steps done, steps in all) of the requests running here."""
        return dict(self.state.progress)

    def request_threads(self) -> list[threading.Thread]:
        """The threads of the requests running now."""
        with self.state.cond:
            return list(self.state.running.values())

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
        return self._tick_loop.session()

    def fail(self, cause: BaseException) -> SessionFailedError:
        """Fails the session: every request and call held here gets the error, new ones are refused.

        Called by ``session`` on its own thread (it reads the tick thread's waiting calls).
        """
        return self.state.fail(cause)

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
        with self.state.cond:
            self.state.forget_session()
            self._widening.forget()

    # ---- lane widening (``runtime.widening``) ------------------------------------------------

    def loop_end(self, request_id: str) -> Completion:
        """Completes once ``request_id``'s denoising loop ended on this rank (it decodes from there,
        or it stopped): what the group of a widened request waits for to give its helpers back, as
        its decode runs on its own lane. A request that has not come yet is waited for."""
        return self.state.loop_end(request_id)

    def help(self, request: Any, ticket: int, source: int) -> None:
        """Helps ``request`` on the wider lane ``ticket`` until ``release(ticket)`` (``RankWidening.help``).

        Raises:
            SessionFailedError: This rank's session failed.
        """
        self._widening.help(request, ticket, source)

    def release(self, ticket: int) -> None:
        """Ends this rank's help of the wider lane ``ticket`` (before it starts, when it comes first)."""
        self._widening.release(ticket)
