"""The video job store and its one state machine.

Every change of a job's state or owner is one transition here, one database transaction, guarded
by the job's ``owner`` and ``attempt`` (a compare-and-set ``UPDATE ... WHERE``): a report of an
earlier attempt is refused, and one attempt is adopted once whichever replicas race. The records
and the MP4s outlive every deployment: they live in a database (SQLAlchemy URL: SQLite by default,
PostgreSQL for several nodes) and a media store (``jobs.media``), not in any replica's memory.

    create ──> queued ──start──> in_progress ──complete──> completed
                 │  ▲               │
                 │  └──adopt────────┤ (released: owned by none, progress back to 0)
                 │    (attempt + 1) │
                 └──release─────────┘
    fail, cancel (delete) and expire end a job from any active state; terminal states never change.

A job leaves its owner only when the owner is known gone (``jobs.leases``): a database that does
not answer delays reports (each call then raises ``StoreUnavailableError``) and never releases a
job. One store process serves the cluster (``jobs.actor``): the leases live in its memory, and
``delete``, ``expire`` and ``claim``'s hold are exact only there (the adoption is guarded in the
database whatever runs it). A store serves several endpoints (applications) of one cluster: each
job belongs to the endpoint whose ingress took it, and each endpoint has its own limits.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid

from sqlalchemy import and_, delete, event, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from ray_hsdp.config.endpoint import EndpointConfig
from ray_hsdp.serve.jobs.database import answering, engine_for
from ray_hsdp.serve.jobs.leases import JobLeases
from ray_hsdp.serve.jobs.media import JobMedia
from ray_hsdp.serve.jobs.records import (
    ACTIVE,
    add_missing_columns,
    endpoints_table,
    jobs_table,
    metadata,
    public,
    unexpired,
)
from ray_hsdp.serve.jobs.reports import Held, HeldJobs
from ray_hsdp.serve.jobs.sweep import JobSweep, released_values
from ray_hsdp.serve.jobs.views import JobViews

#: Progress (0-100) at the end of denoising; decode and MP4 encoding fill the rest.
DENOISED = 90
DECODED = 95

#: The transitions of a job, each a method of ``JobStore`` (and the only writers of a job's row).
TRANSITIONS = (
    "create", "start", "release", "claim", "unclaim", "adopt", "take_waiting", "complete", "fail", "cancel", "expire",
)  # fmt: skip
#: The transitions whose method has another name: start is a report, cancel a delete, expire the sweep's.
TRANSITION_METHODS = {"start": "renew", "cancel": "delete", "expire": "_sweep"}

#: Why a job may be released without its attempt counting against ``max_attempts``: a full group
#: (it waits for room) and a removed one (a downscale, a redeploy) are no fault of the job's.
UNCOUNTED_CODES = ("overloaded", "drained")


def limits(config) -> dict:
    """An endpoint's limits from its ``EndpointConfig`` (or an ``AppConfig``)."""
    return {
        "max_jobs": config.max_video_jobs,
        "max_bytes": config.max_video_bytes,
        "ttl_s": config.video_ttl_s,
        "stale_after_s": config.video_stale_after_s,
        "lost_wait_s": config.video_lost_wait_s,
        "max_attempts": config.video_max_attempts,
    }


#: The limits of an endpoint that has not configured its own: the endpoint fields' defaults.
DEFAULT_LIMITS = limits(EndpointConfig())


class JobStore(JobSweep, JobViews):
    """The video jobs of a cluster's endpoints, their MP4s, and their transitions.

    Args:
        url: The records' SQLAlchemy URL (``sqlite:////path/jobs.sqlite``, ``postgresql+psycopg://...``).
        media: The MP4s' folder or fsspec URL.
        node: The Ray node this store runs on (where a media folder is: ``JobMedia.reaches``).
        orphan_after_s: A media file no record holds is removed once it is this old.
    """

    def __init__(self, url: str, media: str, node: str | None = None, orphan_after_s: float = 600.0):
        self.engine = engine_for(url)
        #: The same pool without a transaction around each call: a read, and a report (whose writes
        #: are each one guarded statement), cost one round trip to the database, not three.
        self.reads = engine_for(url, isolation_level="AUTOCOMMIT")  # a pool of its own: no reset per use
        self.media = JobMedia(media, node)
        self.leases = JobLeases()
        #: The rows of the reported jobs, between two transitions: a steady report reads none.
        self.held = HeldJobs()
        # What the call running on this thread did: ``changed_rows`` (a statement of the
        # transactions' engine hit a row; the reports write through ``reads``, and keep what they
        # write) and ``reached_database`` (a statement of either engine ran).
        self._call = threading.local()
        event.listen(self.engine, "after_execute", self._note_change)
        for engine in (self.engine, self.reads):
            event.listen(engine, "before_cursor_execute", self._note_contact)
        self.orphan_after_s = orphan_after_s
        self._limits: dict[str, dict] = {}
        self._swept = self._orphans_swept = 0.0
        self._sweep_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._opened = False
        #: Ids deleted lately, existing or not: a create of one that was still on its way (its
        #: caller left during the create and deleted it) is refused, not run unwatched.
        self._deleted: collections.deque[str] = collections.deque(maxlen=4096)
        self._creating = threading.Lock()

    def _note_change(self, conn, statement, multiparams, params, options, result) -> None:
        if getattr(statement, "is_dml", False) and result.rowcount:
            self._call.changed_rows = True

    def _note_contact(self, *args) -> None:
        self._call.reached_database = True

    @contextlib.contextmanager
    def _transaction(self):
        """``engine.begin()``; once it committed, a transaction that changed a row forgets the rows
        the reports hold (before the call's slower work: removing files, a media listing)."""
        self._call.changed_rows = False
        with self.engine.begin() as conn:
            yield conn
        if self._call.changed_rows:  # (one rolled back raised instead: it changed nothing)
            self.held.changed()

    def _open(self) -> None:
        """Makes the tables (and adds the columns an earlier version lacked) once the database answers."""
        if self._opened:
            return
        with self._open_lock:
            if not self._opened:
                metadata.create_all(self.engine)
                add_missing_columns(self.engine)
                self._opened = True

    def media_location(self) -> tuple[str, str | None]:
        """The media store's URL and the node its folder is on, for a caller that reads or writes it
        itself (``JobMedia.reaches``)."""
        return self.media.url, self.media.node

    # ---- the endpoints' limits ---------------------------------------------------------------

    @answering
    def configure(self, endpoint: str, new_limits: dict) -> None:
        """Sets an endpoint's limits (its ingress at each start, so an edit applies with no restart
        of any group); kept in the database for a restarted store."""
        for again in (False, True):
            try:
                with self._transaction() as conn:
                    conn.execute(delete(endpoints_table).where(endpoints_table.c.endpoint == endpoint))
                    conn.execute(insert(endpoints_table).values(endpoint=endpoint, limits=dict(new_limits)))
                break
            except IntegrityError:  # another ingress replica's configure committed in between
                if again:
                    raise
        self._limits[endpoint] = {**DEFAULT_LIMITS, **new_limits}

    def limits_of(self, endpoint: str) -> dict:
        if endpoint not in self._limits:
            with self.engine.connect() as conn:
                row = conn.execute(select(endpoints_table).where(endpoints_table.c.endpoint == endpoint)).first()
            # (setdefault: a configure on the other thread meanwhile wins over this older read)
            self._limits.setdefault(endpoint, {**DEFAULT_LIMITS, **(row.limits if row is not None else {})})
        return self._limits[endpoint]

    # ---- transitions -------------------------------------------------------------------------

    def _guarded(self, conn, video_id: str, owner: str | None, attempt: int | None, values: dict) -> bool:
        """One compare-and-set: the job is active (and, where given, ``owner``'s ``attempt``)."""
        c = jobs_table.c
        where = [c.id == video_id, c.status.in_(ACTIVE)]
        if owner is not None:
            where.append(c.owner == owner)
        if attempt is not None:
            where.append(c.attempt == attempt)
        return conn.execute(update(jobs_table).where(and_(*where)).values(values)).rowcount == 1

    @answering
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
        self._sweep()
        now = time.time()
        limit = self.limits_of(endpoint)
        # (Under the lock a delete also takes: a create and its delete on the store's two threads
        # never interleave, so a create that started before its delete is deleted with it.)
        with self._creating, self._transaction() as conn:
            if video_id is not None and video_id in self._deleted:
                return "deleted", f"video {video_id!r} was deleted before its create reached the store"
            if video_id is not None and (row := self._row(conn, video_id, endpoint)) is not None:
                ran_elsewhere = row.status == "in_progress" and row.owner != owner
                values = dict(owner=owner, last_owner=owner, attempt=row.attempt + 1, progress=0, status="queued",
                              heartbeat=now, waiting_since=now, released_at=None, claimed_until=0.0,
                              restarted=row.restarted or ran_elsewhere)  # fmt: skip
                if not self._guarded(conn, video_id, None, row.attempt, values):
                    return "ended", public(self._row(conn, video_id))
                return "ok", public(self._row(conn, video_id))
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
            out = public(self._row(conn, video_id))
        self.leases.heard(owner, jobs=[video_id])
        return "ok", out

    @answering
    def renew(self, owner: str, reports: list[dict], handle=None) -> list[bool]:
        """``start`` and every report of one owner, in one call (its lease renewed; each write is
        one guarded statement, so no transaction spans them): each report ``{"video_id",
        "attempt"}`` plus ``progress`` (never down within an attempt), ``running`` (a lane took
        it), ``media_bytes`` (its files are being written: the byte cap counts them).

        Args:
            handle: The owner's actor, which the store pings once the owner falls silent.

        Returns:
            Per report, False when the job has ended or is gone, or ``owner``'s ``attempt`` is no
            longer the job's (released, adopted elsewhere): the owner stops its copy.
        """
        now = time.time()
        ids = [report["video_id"] for report in reports]
        version, rows = self.held.read(ids)
        with contextlib.ExitStack() as opened:
            conn = None
            if missing := [video_id for video_id in ids if video_id not in rows]:
                conn = opened.enter_context(self.reads.connect())
                c = jobs_table.c
                found = conn.execute(
                    select(c.id, c.status, c.owner, c.attempt, c.progress, c.media_bytes).where(c.id.in_(missing))
                ).all()
                read = {row.id: Held(*row[1:]) for row in found}
                self.held.keep(version, read)
                rows.update(read)
            kept = []
            for report in reports:
                row = rows.get(report["video_id"])
                values = self._report_values(owner, row, **report)
                if not values:  # refused (None), or nothing to write ({})
                    kept.append(values is not None)
                    continue
                conn = conn or opened.enter_context(self.reads.connect())
                kept.append(self._write_report(conn, version, row, report, values, now))
        self.leases.heard(owner, handle, [report["video_id"] for report, ok in zip(reports, kept) if ok])
        return kept

    def _write_report(self, conn, version: int, row: Held, report: dict, values: dict, now: float) -> bool:
        """Writes what a report changes of its job, guarded by its owner and attempt."""
        video_id = report["video_id"]
        if not self._guarded(conn, video_id, row.owner, row.attempt, {**values, "heartbeat": now}):
            self.held.forget(video_id)
            return False
        self.held.keep(version, {video_id: row._replace(**{k: v for k, v in values.items() if k in Held._fields})})
        return True

    @staticmethod
    def _report_values(owner, row: Held | None, video_id, attempt, progress=None, running=False, media_bytes=None):
        """What one report changes of its job's ``row`` (the lease itself lives in memory,
        ``JobLeases``): ``None`` when it is refused (the job ended, or is no longer ``owner``'s
        ``attempt``), ``{}`` when nothing changes: an owner's steady reports write nothing."""
        if row is None or row.status not in ACTIVE or row.owner != owner or row.attempt != attempt:
            return None
        values: dict = {}
        if (running or progress) and row.status != "in_progress":  # (a short job may end between two reports)
            values.update(status="in_progress", replica=owner)
        if progress is not None and (values.get("status", row.status) == "in_progress"):
            if (moved := max(row.progress, min(int(progress), 99))) != row.progress:
                values["progress"] = moved
        if media_bytes is not None and int(media_bytes) != row.media_bytes:
            values["media_bytes"] = int(media_bytes)
        return values

    def report(self, video_id: str, owner: str, attempt: int, progress: int | None = None, running: bool = False):
        """One report (``renew`` of one job)."""
        return self.renew(owner, [dict(video_id=video_id, attempt=attempt, progress=progress, running=running)])[0]

    @answering
    def release(self, video_id: str, owner: str, attempt: int, code: str, why: str, hold_s: float = 0.0) -> bool:
        """``release``: ``owner`` gives its attempt up (its group failed under it, its drain ended,
        its group was full when the job was placed there): the job waits queued, owned by none and
        back at progress 0, for the ingress to place it on a group of its model (``claim``,
        ``adopt``; not before ``hold_s``: a full group's room comes later); ``code`` and ``why``
        fail it if none does within ``video_lost_wait_s``, or at once where ``max_attempts`` of
        its attempts have failed (naming each)."""
        with self._transaction() as conn:
            row = self._row(conn, video_id)
            released = row is not None and row.owner is None and row.released_at is not None
            if released and (row.attempt, row.last_owner) == (attempt, owner):
                return row.status in ACTIVE  # released already: a call run again (the store restarted under it)
            if row is None or row.owner != owner or row.attempt != attempt:
                return False
            return self._give_up(conn, row, code, why, hold_s)

    def _give_up(self, conn, row, code: str, why: str, hold_s: float = 0.0) -> bool:
        """Releases the job of ``row`` from its owner, or fails it once ``max_attempts`` failed."""
        errors = list(row.attempt_errors or [])
        if code not in UNCOUNTED_CODES:
            errors.append(f"attempt {row.attempt} ({code}): {why}")
        most = self.limits_of(row.endpoint)["max_attempts"]
        if len(errors) >= most:
            message = f"{len(errors)} attempts failed (video_max_attempts={most}): " + "; ".join(errors)
            return self._fail(conn, row.id, code, message, row.owner, row.attempt, errors)
        values = {**released_values(code, why, hold_s), "attempt_errors": errors}
        return self._guarded(conn, row.id, row.owner, row.attempt, values)

    @answering
    def claim(self, pools: list[str], hold_s: float) -> list[tuple[str, str, str, str, int, str]]:
        """``claim``: the released jobs of ``pools`` (``pool_of``) whose claim is free, each held for the asking
        ingress for ``hold_s`` (another ingress skips it meanwhile; the adoption is what is
        exclusive, ``adopt``).

        Returns:
            ``(video_id, model, spec, the replica its last attempt ran on, attempt, why it was
            released: its code)`` for each.
        """
        self._sweep()
        now = time.time()
        c = jobs_table.c
        out = []
        with self._transaction() as conn:
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

    @answering
    def unclaim(self, video_id: str, attempt: int, retry_in_s: float) -> bool:
        """A claim whose placement failed (no group answered in time, or each refused): the job may
        be claimed again after ``retry_in_s`` rather than after the claim's whole hold."""
        c = jobs_table.c
        with self._transaction() as conn:
            where = and_(c.id == video_id, c.attempt == attempt, c.owner.is_(None), c.status.in_(ACTIVE))
            moved = conn.execute(update(jobs_table).where(where).values(claimed_until=time.time() + retry_in_s))
            return moved.rowcount == 1

    @answering
    def adopt(self, video_id: str, replica: str, attempt: int) -> int | None:
        """``adopt``: ``replica`` runs the released ``attempt`` again from the start, as attempt + 1.
        Exactly one adoption of an attempt succeeds.

        Returns:
            The new attempt, or ``None`` (adopted already, ended, gone, or not released).
        """
        now = time.time()
        c = jobs_table.c
        with self._transaction() as conn:
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
            with self.reads.connect() as conn:  # a call run again (the store restarted under it)
                row = self._row(conn, video_id)
            mine = row is not None and row.status in ACTIVE and (row.owner, row.attempt) == (replica, attempt + 1)
            return attempt + 1 if mine else None
        self.leases.heard(replica, jobs=[video_id])
        return attempt + 1

    @answering
    def take_waiting(self, replica: str, pool: str, waited_s: float) -> tuple[str, str, int] | None:
        """``adopt`` of a job that has waited queued on another, busy group of ``pool`` for
        ``waited_s``, by ``replica``, whose group has a free lane; its first owner's next report
        fails (its attempt is no longer the job's), which stops its copy.

        Returns:
            ``(video_id, spec, attempt)``, or ``None`` when no job waits so long.
        """
        self._sweep()
        now = time.time()
        c = jobs_table.c
        with self._transaction() as conn:
            rows = conn.execute(
                select(c.id, c.spec, c.attempt, c.owner)
                .where(c.status == "queued", c.pool == pool, c.owner.is_not(None), c.owner != replica)
                .where(c.waiting_since <= now - waited_s)
                .order_by(c.seq)
            ).all()
            for row in rows:
                values = dict(owner=replica, last_owner=replica, attempt=row.attempt + 1, heartbeat=now,
                              waiting_since=now)  # fmt: skip
                if self._guarded(conn, row.id, row.owner, row.attempt, values):
                    self.leases.heard(replica, jobs=[row.id])
                    return row.id, row.spec, row.attempt + 1
        return None

    def complete(
        self, video_id: str, owner: str, attempt: int, mp4: bytes, thumbnail: bytes, size: str | None = None
    ) -> bool:
        """``complete`` of an owner that cannot reach the media store itself: the store writes the
        MP4 and its first frame, then completes the job (``complete_stored``)."""
        key = f"{video_id}-{attempt}"
        stored = self.media.write(key, mp4, thumbnail)
        return self.complete_stored(video_id, owner, attempt, key, stored, size)

    @answering
    def complete_stored(
        self, video_id: str, owner: str, attempt: int, key: str, stored: int, size: str | None = None
    ) -> bool:
        """``complete``: ``owner``'s ``attempt`` wrote its files under ``key`` (``stored`` bytes) in
        the media store; the job is completed (the files first: a completed record always has its
        content). Sent again (the store restarted under the call), it answers True once more.

        Returns:
            False (and the files removed) when the job has ended or is gone, or the attempt is not its own.
        """
        with self._transaction() as conn:
            row = self._row(conn, video_id)
            if row is not None and row.status == "completed" and (row.owner, row.attempt) == (owner, attempt):
                return True
            done = False
            if row is not None and row.owner == owner and row.attempt == attempt:
                now = time.time()
                fields = {**row.fields, "size": size} if size is not None else row.fields
                values = dict(status="completed", progress=100, replica=owner, completed_at=now, spec=None,
                              expires_at=now + self.limits_of(row.endpoint)["ttl_s"], media_bytes=stored,
                              media_key=key, fields=fields)  # fmt: skip
                done = self._guarded(conn, video_id, owner, attempt, values)
        if not done:
            self.media.remove(key)
        return done

    @answering
    def fail(
        self, video_id: str, code: str, message: str, owner: str | None = None, attempt: int | None = None
    ) -> bool:
        """``fail``: the job ends failed with the reason; False when it had ended already, or when
        ``owner``'s ``attempt`` is no longer the job's (its failure is not the job's)."""
        with self._transaction() as conn:
            return self._fail(conn, video_id, code, message, owner, attempt)

    def _fail(self, conn, video_id: str, code: str, message: str, owner=None, attempt=None, errors=None) -> bool:
        row = self._row(conn, video_id)
        if row is None:
            return False
        now = time.time()
        values = dict(status="failed", completed_at=now, spec=None, error_code=code, error_message=message,
                      expires_at=now + self.limits_of(row.endpoint)["ttl_s"], media_bytes=0)  # fmt: skip
        if errors is not None:
            values["attempt_errors"] = errors
        return self._guarded(conn, video_id, owner, attempt, values)

    @answering
    def delete(self, endpoint: str, video_id: str) -> bool:
        """``cancel``: removes a job and its files (afterwards its id is 404); its owner stops it at
        its next report; a create of its id that arrives later is refused. Returns whether it existed."""
        with self._creating, self._transaction() as conn:
            self._deleted.append(video_id)
            row = self._row(conn, video_id, endpoint)
            if row is None:
                return False
            conn.execute(delete(jobs_table).where(jobs_table.c.id == video_id))
        self.media.remove(row.media_key)
        return True
