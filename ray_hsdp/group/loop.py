"""The group's scheduler thread (``SchedulerLoop``): what wakes it (a submitted request, a cancel,
an offer or session that completed, a rank's death), and every way a job is answered (a result,
its own error, a queue deadline, the group's failure)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import ray

from ray_hsdp.group.errors import QueueTimeoutError, died, remote_cause
from ray_hsdp.group.failure import fail
from ray_hsdp.group.mend import Mend
from ray_hsdp.group.scheduler import Scheduler
from ray_hsdp.group.state import GroupState, QueuedJob, resolve
from ray_hsdp.group.widening import Widening
from ray_hsdp.runtime import SessionFailedError

logger = logging.getLogger("ray_hsdp")

# A survivor's collective breaks the moment a peer dies, often before Ray reports the death;
# this long a failed session waits for that report so that the reason names the dead rank.
_DEATH_REPORT_GRACE_S = 2.0


class SchedulerLoop:
    """The thread that runs a group's scheduler and answers its jobs.

    Args:
        state: The group's state, whose events it handles.
        scheduler: Hands the queued jobs to lanes.
        widening: Takes a widened job's helpers back once its loop or its lane's offers end.
        mend: Replaces a rank that died (or fails the group).
    """

    def __init__(self, state: GroupState, scheduler: Scheduler, widening: Widening, mend: Mend):
        self.state = state
        self.scheduler = scheduler
        self.widening = widening
        self.mend = mend
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="ray_hsdp-scheduler", daemon=True)
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        """Waits for the thread to end (not from the thread itself: a shutdown on a failure there)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=timeout_s)

    def _run(self) -> None:
        """Hands requests to ranks, answers them, starts sessions.

        Wakes on a submitted request, a completed offer or session, or a rank's death. If it
        crashes, the group fails (and so answers every request it holds) rather than go quiet.
        """
        state = self.state
        try:
            while True:
                with state.cond:
                    while not (state.closed or state.events or state.wake or state.cancels):
                        if not state.cond.wait(self._until_queue_timeout()):
                            break  # the oldest queued request's time is up
                    if state.closed:
                        return
                    state.wake = False
                    events = list(state.events)
                    state.events.clear()
                    cancels, state.cancels = state.cancels, []
                    ranks = list(state.ranks)  # (a failed group has none: it answered its requests)
                for rank_index, request_id in cancels:
                    if rank_index < len(ranks):  # the offer then fails with RequestCancelledError
                        ranks[rank_index].cancel.remote(request_id)
                for kind, ref, future in events:
                    self._handle(kind, ref, future)
                self._expire_queued()
                with state.cond:
                    if state.failure or state.closed or state.mending:
                        continue
                    self.scheduler.assign()
                    if state.inflight and state.sessions is None:
                        # Every rank ticks, with work or without, until all are idle.
                        state.sessions = {r.session.remote(): i for i, r in enumerate(state.ranks)}
                        for ref in state.sessions:
                            state.watch("session", ref)
        except BaseException as err:
            logger.exception("The shard group's scheduler crashed")
            fail(state, f"shard group failed: its scheduler crashed: {type(err).__name__}: {err}")

    def _handle(self, kind: str, ref: ray.ObjectRef, future: Future) -> None:
        """One completed call that Ray reported (``GroupState.watch``)."""
        if kind == "offer":
            self._offer_done(ref, future)
        elif kind == "session":
            self._session_done(ref, future)
        elif kind == "denoised":
            self.widening.denoised(ref)
        elif isinstance(future.exception(), ray.exceptions.RayActorError):  # a rank, idle or not
            rank_index = self.state.watchers.pop(ref, None)
            if rank_index is not None:  # else a rank replaced already (``Mend.lost``)
                self.mend.lost(rank_index, died(rank_index, future.exception()))

    def _until_queue_timeout(self) -> float | None:
        """Seconds until the first queued request's deadline passes (lock held)."""
        if not self.state.pending:
            return None
        return max(0.0, min(job.deadline for job in self.state.pending) - time.time())

    def _expire_queued(self) -> None:
        """Answers the queued requests no lane took by their deadline (504): ``queue_timeout_s``
        from their arrival, however long of it they spent waiting elsewhere first."""
        state, now = self.state, time.time()
        with state.cond:
            expired = [j for j in state.pending if now >= j.deadline]
            state.pending = [j for j in state.pending if j not in expired]
        for job in expired:
            waited = time.monotonic() - job.enqueued
            error = QueueTimeoutError(
                f"request {job.request.request_id!r} waited {waited:.0f}s in this group's queue, and no rank took "
                f"it by its deadline (queue_timeout_s={state.config.queue_timeout_s:g} from its arrival)"
            )
            resolve(job.future, error=error)

    def _offer_done(self, ref: ray.ObjectRef, future: Future) -> None:
        with self.state.cond:
            entry = self.state.inflight.pop(ref, None)
        if entry is None:
            return  # the group failed or shut down meanwhile, and answered the request then
        rank_index, job = entry
        with self.state.cond:
            self.widening.release(job)  # a rank of its lane is done: its forwards are over
        error = future.exception()
        if isinstance(error, ray.exceptions.RayActorError):
            self.mend.lost(rank_index, died(rank_index, error), also=job)
        elif error is not None and isinstance(remote_cause(error), SessionFailedError):
            self._session_failed(error, also=job)
        elif rank_index != job.ranks.start:
            if error is not None:  # its own error, which stopped the lane: the cause, not the leader's stop
                resolve(job.future, error=remote_cause(error))
        elif error is None:
            resolve(job.future, result=future.result())
        else:  # the request's own error (bad input, deadline): the group is fine
            resolve(job.future, error=remote_cause(error))

    def _session_done(self, ref: ray.ObjectRef, future: Future) -> None:
        state, error = self.state, future.exception()
        with state.cond:
            if state.sessions is None or ref not in state.sessions:
                return  # a session of a group that failed already
            rank_index = state.sessions[ref]
            if error is None:
                state.sessions_done.add(ref)
                if len(state.sessions_done) == len(state.sessions):
                    state.sessions, state.sessions_done = None, set()
                return
        if isinstance(error, ray.exceptions.RayActorError):
            self.mend.lost(rank_index, died(rank_index, error))
        else:
            self._session_failed(error)

    def _session_failed(self, error: BaseException, also: QueuedJob | None = None) -> None:
        """A session failed: a dead peer's doing if Ray reports one within a short grace (the group
        then replaces that rank, or fails naming it), else the group fails with ``error``.

        Without the grace, a survivor's broken all-gather would name the survivor, and the
        operator would look for the fault on the wrong rank.
        """
        state = self.state
        if state.failure is None:
            ready, _ = ray.wait(list(state.watchers), num_returns=1, timeout=_DEATH_REPORT_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as err:
                    self.mend.lost(state.watchers[ref], died(state.watchers[ref], err), also=also)
                    return
                except Exception:  # noqa: BLE001 - a watch that ended otherwise: the rank left
                    pass
        fail(state, f"shard group failed: {remote_cause(error)}", also=also)
