"""The transitions of a video job other than its owner's reports (``jobs.reports``) and the sweep
(``jobs.sweep``), each one database transaction on the store's state (``StoreState``), guarded by
the job's owner and attempt (``records.guarded``): a job's create and delete (``JobCreation``), its
end or release by its owner (``JobEndings``), and its placement on another group once released or
kept waiting (``JobPlacement``). ``JobStore`` runs each as a store call (``database.answering``)."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import TYPE_CHECKING

from sqlalchemy import and_, delete, func, insert, or_, select, update

from ray_hsdp.serve.jobs.records import ACTIVE, guarded, job_row, jobs_table, public, unexpired

if TYPE_CHECKING:
    from ray_hsdp.serve.jobs.state import StoreState

#: Why a job may be released without its attempt counting against ``max_attempts``: a full group
#: (it waits for room) and a removed one (a downscale, a redeploy) are no fault of the job's.
UNCOUNTED_CODES = ("overloaded", "drained")


def released_values(code: str, why: str, hold_s: float, now: float) -> dict:
    """A released job's values: queued, owned by none, back at progress 0, waiting since ``now``,
    not placed again for ``hold_s``; ``restarted`` once an attempt that had started running gave it
    up (a queued job that moves is not run again); no bytes of its own counted any more."""
    c = jobs_table.c
    return dict(owner=None, status="queued", progress=0, heartbeat=now, released_at=now, released_code=code,
                released_why=why, claimed_until=now + hold_s, media_bytes=0,
                restarted=or_(c.restarted, c.status == "in_progress"))  # fmt: skip


class JobCreation:
    """A job's create, and its delete (``cancel``), which a create still on its way must not outrun."""

    def __init__(self, state: StoreState):
        self.state = state
        #: Ids deleted lately, existing or not: a create of one that was still on its way (its
        #: caller left during the create and deleted it) is refused, not run unwatched.
        self._deleted: collections.deque[str] = collections.deque(maxlen=4096)
        self._creating = threading.Lock()

    def create(
        self, endpoint: str, pool: str, fields: dict, owner: str, spec: str, video_id: str | None = None
    ) -> tuple[str, dict | str]:
        """``create``: a queued job, attempt 1, that ``owner`` (a group of ``pool``: ``pool_of``)
        runs; or, where the ingress names a job that exists (it sends a create again after its
        first replica was lost under the call), ``owner`` adopts it (its attempt + 1; ``retried``
        only where another replica had run it).

        Returns:
            ``("ok", video object)`` for a job ``owner`` runs from now (its ``attempt`` is the one to
            report with); ``("ended", video object)`` for a named job that has ended;
            ``("full", why)`` when one of the endpoint's limits is reached; ``("deleted", why)``
            for a named job deleted before this create arrived.
        """
        now = self.state.clock()
        limit = self.state.limits_of(endpoint)
        # (Under the lock a delete also takes: a create and its delete on the store's two threads
        # never interleave, so a create that started before its delete is deleted with it.)
        with self._creating, self.state.transaction() as conn:
            if video_id is not None and video_id in self._deleted:
                return "deleted", f"video {video_id!r} was deleted before its create reached the store"
            if video_id is not None and (row := job_row(conn, video_id, endpoint)) is not None:
                ran_elsewhere = row.status == "in_progress" and row.owner != owner
                values = dict(owner=owner, last_owner=owner, attempt=row.attempt + 1, progress=0, status="queued",
                              heartbeat=now, waiting_since=now, released_at=None, claimed_until=0.0,
                              restarted=row.restarted or ran_elsewhere)  # fmt: skip
                if not guarded(conn, video_id, None, row.attempt, values):
                    return "ended", public(job_row(conn, video_id))
                return "ok", public(job_row(conn, video_id))
            c = jobs_table.c
            # Jobs being written count (``renew``'s media_bytes); expired ones not yet swept do not: no read sees them.
            counted = select(func.count(), func.coalesce(func.sum(c.media_bytes), 0))
            held, kept = conn.execute(counted.where(c.endpoint == endpoint, unexpired(now))).one()
            if held >= limit["max_jobs"]:
                why = f"the video job store holds {held} jobs of this endpoint (max_video_jobs={limit['max_jobs']})"
                return "full", why
            if kept >= limit["max_bytes"]:
                return "full", f"the video job store holds {kept} bytes of this endpoint's videos (max_video_bytes)"
            video_id = video_id or f"video_{uuid.uuid4().hex}"
            conn.execute(
                insert(jobs_table).values(
                    id=video_id, endpoint=endpoint, seq=time.time_ns(), model=fields.get("model"), pool=pool,
                    status="queued", progress=0, attempt=1, owner=owner, last_owner=owner, heartbeat=now,
                    waiting_since=now, claimed_until=0.0, created_at=now, fields=fields, spec=spec, media_bytes=0,
                )
            )  # fmt: skip
            out = public(job_row(conn, video_id))
        self.state.leases.heard(owner, jobs=[video_id])
        return "ok", out

    def delete(self, endpoint: str, video_id: str) -> bool:
        """``cancel``: removes a job and its files (afterwards its id is 404); its owner stops it at
        its next report; a create of its id that arrives later is refused. Returns whether it existed."""
        with self._creating, self.state.transaction() as conn:
            self._deleted.append(video_id)
            row = job_row(conn, video_id, endpoint)
            if row is None:
                return False
            conn.execute(delete(jobs_table).where(jobs_table.c.id == video_id))
        self.state.media.remove(row.media_key)
        return True


class JobEndings:
    """An owner's end of its attempt: a release (the job waits for another group), a completion, a
    failure; and the sweep's (``JobSweep``: a lost owner's release, a release no group took)."""

    def __init__(self, state: StoreState):
        self.state = state

    def release(self, video_id: str, owner: str, attempt: int, code: str, why: str, hold_s: float = 0.0) -> bool:
        """``release``: ``owner`` gives its attempt up (its group failed under it, its drain ended,
        its group was full when the job was placed there): the job waits queued, owned by none and
        back at progress 0, for the ingress to place it on a group of its model (``claim``,
        ``adopt``; not before ``hold_s``: a full group's room comes later); ``code`` and ``why``
        fail it if none does within ``video_lost_wait_s``, or at once where ``max_attempts`` of
        its attempts have failed (naming each)."""
        with self.state.transaction() as conn:
            row = job_row(conn, video_id)
            released = row is not None and row.owner is None and row.released_at is not None
            if released and (row.attempt, row.last_owner) == (attempt, owner):
                return row.status in ACTIVE  # released already: a call run again (the store restarted under it)
            if row is None or row.owner != owner or row.attempt != attempt:
                return False
            return self.give_up(conn, row, code, why, hold_s)

    def give_up(self, conn, row, code: str, why: str, hold_s: float = 0.0) -> bool:
        """Releases the job of ``row`` from its owner, or fails it once ``max_attempts`` failed."""
        errors = list(row.attempt_errors or [])
        if code not in UNCOUNTED_CODES:
            errors.append(f"attempt {row.attempt} ({code}): {why}")
        most = self.state.limits_of(row.endpoint)["max_attempts"]
        if len(errors) >= most:
            message = f"{len(errors)} attempts failed (video_max_attempts={most}): " + "; ".join(errors)
            return self.fail_in(conn, row.id, code, message, row.owner, row.attempt, errors)
        values = {**released_values(code, why, hold_s, self.state.clock()), "attempt_errors": errors}
        return guarded(conn, row.id, row.owner, row.attempt, values)

    def complete_stored(
        self, video_id: str, owner: str, attempt: int, key: str, stored: int, size: str | None = None
    ) -> bool:
        """``complete``: ``owner``'s ``attempt`` wrote its files under ``key`` (``stored`` bytes) in
        the media store; the job is completed (the files first: a completed record always has its
        content). Sent again (the store restarted under the call), it answers True once more.

        Returns:
            False (and the files removed) when the job has ended or is gone, or the attempt is not its own.
        """
        with self.state.transaction() as conn:
            row = job_row(conn, video_id)
            if row is not None and row.status == "completed" and (row.owner, row.attempt) == (owner, attempt):
                return True
            done = False
            if row is not None and row.owner == owner and row.attempt == attempt:
                now = self.state.clock()
                fields = {**row.fields, "size": size} if size is not None else row.fields
                values = dict(status="completed", progress=100, replica=owner, completed_at=now, spec=None,
                              expires_at=now + self.state.limits_of(row.endpoint)["ttl_s"], media_bytes=stored,
                              media_key=key, fields=fields)  # fmt: skip
                done = guarded(conn, video_id, owner, attempt, values)
        if not done:
            self.state.media.remove(key)
        return done

    def fail(
        self, video_id: str, code: str, message: str, owner: str | None = None, attempt: int | None = None
    ) -> bool:
        """``fail``: the job ends failed with the reason; False when it had ended already, or when
        ``owner``'s ``attempt`` is no longer the job's (its failure is not the job's)."""
        with self.state.transaction() as conn:
            return self.fail_in(conn, video_id, code, message, owner, attempt)

    def fail_in(self, conn, video_id: str, code: str, message: str, owner=None, attempt=None, errors=None) -> bool:
        """``fail`` within the caller's transaction (``errors``: the attempts' failures it names)."""
        row = job_row(conn, video_id)
        if row is None:
            return False
        now = self.state.clock()
        values = dict(status="failed", completed_at=now, spec=None, error_code=code, error_message=message,
                      expires_at=now + self.state.limits_of(row.endpoint)["ttl_s"], media_bytes=0)  # fmt: skip
        if errors is not None:
            values["attempt_errors"] = errors
        return guarded(conn, video_id, owner, attempt, values)


class JobPlacement:
    """A released job placed on another group (``claim`` by an ingress, then ``adopt`` by the
    group's replica), and a job kept waiting on a busy group taken by an idle one (``take_waiting``)."""

    def __init__(self, state: StoreState):
        self.state = state

    def claim(self, pools: list[str], hold_s: float) -> list[tuple[str, str, str, str, int, str]]:
        """``claim``: the released jobs of ``pools`` (``pool_of``) whose claim is free, each held for the asking
        ingress for ``hold_s`` (another ingress skips it meanwhile; the adoption is what is
        exclusive, ``adopt``).

        Returns:
            ``(video_id, model, spec, the replica its last attempt ran on, attempt, why it was
            released: its code)`` for each.
        """
        now = self.state.clock()
        c = jobs_table.c
        out = []
        with self.state.transaction() as conn:
            rows = conn.execute(
                select(c.id, c.model, c.spec, c.last_owner, c.attempt, c.released_code)
                .where(c.released_at.is_not(None), c.owner.is_(None), c.status.in_(ACTIVE), c.pool.in_(pools))
                .where(c.claimed_until <= now)
                .order_by(c.seq)
            ).all()
            for row in rows:
                free = and_(c.id == row.id, c.attempt == row.attempt, c.owner.is_(None), c.status.in_(ACTIVE),
                            c.claimed_until <= now)  # fmt: skip
                if conn.execute(update(jobs_table).where(free).values(claimed_until=now + hold_s)).rowcount == 1:
                    out.append(tuple(row))
        return out

    def unclaim(self, video_id: str, attempt: int, retry_in_s: float) -> bool:
        """A claim whose placement failed (no group answered in time, or each refused): the job may
        be claimed again after ``retry_in_s`` rather than after the claim's whole hold."""
        c = jobs_table.c
        with self.state.transaction() as conn:
            where = and_(c.id == video_id, c.attempt == attempt, c.owner.is_(None), c.status.in_(ACTIVE))
            retry_at = self.state.clock() + retry_in_s
            return conn.execute(update(jobs_table).where(where).values(claimed_until=retry_at)).rowcount == 1

    def adopt(self, video_id: str, replica: str, attempt: int) -> int | None:
        """``adopt``: ``replica`` runs the released ``attempt`` again from the start, as attempt + 1.
        Exactly one adoption of an attempt succeeds.

        Returns:
            The new attempt, or ``None`` (adopted already, ended, gone, or not released).
        """
        now = self.state.clock()
        c = jobs_table.c
        with self.state.transaction() as conn:
            moved = conn.execute(
                update(jobs_table)
                .where(c.id == video_id, c.attempt == attempt, c.owner.is_(None), c.status.in_(ACTIVE))
                .values(
                    owner=replica,
                    last_owner=replica,
                    attempt=attempt + 1,
                    progress=0,
                    status="queued",
                    heartbeat=now,
                    waiting_since=now,
                    released_at=None,
                    claimed_until=0.0,
                )  # fmt: skip
            ).rowcount
        if moved != 1:
            with self.state.reads.connect() as conn:  # a call run again (the store restarted under it)
                row = job_row(conn, video_id)
            mine = row is not None and row.status in ACTIVE and (row.owner, row.attempt) == (replica, attempt + 1)
            return attempt + 1 if mine else None
        self.state.leases.heard(replica, jobs=[video_id])
        return attempt + 1

    def take_waiting(self, replica: str, pool: str, waited_s: float) -> tuple[str, str, int] | None:
        """``adopt`` of a job that has waited queued on another, busy group of ``pool`` for
        ``waited_s``, by ``replica``, whose group has a free lane; its first owner's next report
        fails (its attempt is no longer the job's), which stops its copy.

        Returns:
            ``(video_id, spec, attempt)``, or ``None`` when no job waits so long.
        """
        now = self.state.clock()
        c = jobs_table.c
        with self.state.transaction() as conn:
            rows = conn.execute(
                select(c.id, c.spec, c.attempt, c.owner)
                .where(c.status == "queued", c.pool == pool, c.owner.is_not(None), c.owner != replica)
                .where(c.waiting_since <= now - waited_s)
                .order_by(c.seq)
            ).all()
            for row in rows:
                values = dict(owner=replica, last_owner=replica, attempt=row.attempt + 1, heartbeat=now,
                              waiting_since=now)  # fmt: skip
                if guarded(conn, row.id, row.owner, row.attempt, values):
                    self.state.leases.heard(replica, jobs=[row.id])
                    return row.id, row.spec, row.attempt + 1
        return None
