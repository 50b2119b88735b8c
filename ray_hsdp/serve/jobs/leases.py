"""Who still owns its video jobs: the store's leases of their owners (the replicas running them).

A job leaves its owner only when the owner is known gone, never because the store could not hear
it. Two ways to know (``JobLeases.gone``):

- the owner's replica actor is dead (Ray says so when the store pings it: ``ActorDiedError``);
- the owner sent no report for ``stale_after_s`` while the store was up, ran calls and its
  database answered, counted on the store process' monotonic clock. A store outage (its database
  down, the store's process restarted or stalled, a step of the wall clock) therefore delays a
  release; it never causes one: the silence of an owner counts only from the moment the store
  could hear it again.

Held in the store process' memory: the cluster has one store actor (``jobs.actor``). A restarted
store starts every owner's lease afresh and learns each owner's handle at its next report.
"""

from __future__ import annotations

import threading
import time

import ray

#: An owner silent this long is pinged (its actor asked whether it lives), at most this often.
PING_AFTER_S = 2.0
#: A store that ran no call for this long was stalled (owners report 4 times a second while they
#: hold jobs): what its owners said meanwhile could not reach it, so their silence counts anew.
STALLED_AFTER_S = 2.0


class JobLeases:
    """The owners' leases of one store process.

    Args:
        clock: Monotonic seconds (a test may step it).
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        #: Since when the database has answered without a break (None: it does not answer now).
        self._reachable_since: float | None = self._started
        self._last_call = self._started
        self._heard: dict[str, float] = {}  # owner -> the store's clock at its last report
        self._jobs: dict[str, float] = {}  # video id -> the store's clock when its owner last named it
        self._handles: dict[str, object] = {}  # owner -> its replica's actor handle
        self._pings: dict[str, tuple[float, object]] = {}  # owner -> (sent at, the ping's ref)
        self._dead: set[str] = set()

    def called(self) -> None:
        """The store runs a call (at each, before its sweep)."""
        with self._lock:
            now = self._clock()
            if now - self._last_call > STALLED_AFTER_S and self._reachable_since is not None:
                self._reachable_since = now
            self._last_call = now

    def heard(self, owner: str, handle=None, jobs=()) -> None:
        """``owner`` reported (its reports reached the database), naming ``jobs``."""
        with self._lock:
            now = self._clock()
            self._heard[owner] = now
            self._jobs.update(dict.fromkeys(jobs, now))
            if handle is not None:
                self._handles[owner] = handle

    def keep_jobs(self, active: set[str]) -> None:
        """Forgets the jobs that are no longer active (the sweep's)."""
        with self._lock:
            for video_id in set(self._jobs) - active:
                del self._jobs[video_id]

    def reachable(self) -> None:
        """The database answered."""
        with self._lock:
            if self._reachable_since is None:
                self._reachable_since = self._clock()

    def unreachable(self) -> None:
        """The database did not answer: no owner's silence counts until it does again."""
        with self._lock:
            self._reachable_since = None

    def silent_for(self, owner: str, video_id: str | None = None) -> float:
        """How long ``owner`` (or its report of ``video_id``) has been silent while the store could
        have heard it (0 in an outage)."""
        with self._lock:
            if self._reachable_since is None:
                return 0.0
            heard = self._heard if video_id is None else self._jobs
            since = max(heard.get(owner if video_id is None else video_id, self._started), self._reachable_since)
            return max(0.0, self._clock() - since)

    def gone(self, owner: str, stale_after_s: float, video_id: str | None = None) -> str | None:
        """Why ``owner`` no longer runs ``video_id`` (it is known gone, or it has not named the
        job for ``stale_after_s`` while the store could hear it: a replica that lives but dropped
        the job), or ``None`` while it may (never during an outage)."""
        if owner in self._dead:
            return "the replica running this job is gone (its actor died)"
        why = "while the job store could hear it"
        silent = self.silent_for(owner)
        if silent > stale_after_s:
            return f"the replica running this job sent no report for {stale_after_s:g}s {why}"
        if video_id is not None and self.silent_for(owner, video_id) > stale_after_s:
            return f"the replica that owns this job has not reported it for {stale_after_s:g}s {why}"
        if silent > PING_AFTER_S:
            self._ping(owner)
        return "the replica running this job is gone (its actor died)" if owner in self._dead else None

    def _ping(self, owner: str) -> None:
        """Asks Ray whether ``owner``'s actor lives, without waiting: a ping sent earlier is read
        when it has answered (a dead actor answers at once with ``ActorDiedError``)."""
        handle = self._handles.get(owner)
        if handle is None:
            return
        now = self._clock()
        sent = self._pings.get(owner)
        if sent is not None:
            ready, _ = ray.wait([sent[1]], timeout=0)
            if not ready:
                return  # a busy owner answers late: that says nothing against it
            try:
                ray.get(sent[1], timeout=0)
            except ray.exceptions.ActorDiedError:
                self._dead.add(owner)
                return
            except Exception:  # noqa: BLE001 - unreachable for now is not dead
                pass
            if now - sent[0] < PING_AFTER_S:
                return
        self._pings[owner] = (now, handle.__ray_ready__.remote())
