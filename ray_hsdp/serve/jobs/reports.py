"""The owners' reports of their jobs (``OwnerReports``: a job's ``start``, its progress, its bytes
being written), and the rows of the reported jobs as the store read them since its last transition
(``HeldJobs``): an owner's steady report (nothing of its job to write) is answered from memory,
without a database round trip.

Safe because one store process makes every change to a job (``jobs.actor``): each transition other
than a report (a create, release, adoption, claim, completion, failure, delete, or the sweep)
forgets every row once its transaction has committed, and a row read before that is kept only when
no transition ended while it was read.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import select

from ray_hsdp.serve.jobs.records import ACTIVE, guarded, jobs_table

if TYPE_CHECKING:
    from ray_hsdp.serve.jobs.state import StoreState


class Held(NamedTuple):
    """What a report is checked against and may change of its job's row."""

    status: str
    owner: str | None
    attempt: int
    progress: int
    media_bytes: int


class HeldJobs:
    """The rows reports read last, as of the store's last transition. Thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0  # transitions ended so far
        self._rows: dict[str, Held] = {}

    def read(self, video_ids: list[str]) -> tuple[int, dict[str, Held]]:
        """The rows held of ``video_ids``, and the version to ``keep`` rows read from now on under."""
        with self._lock:
            return self._version, {video_id: self._rows[video_id] for video_id in video_ids if video_id in self._rows}

    def keep(self, version: int, rows: dict[str, Held]) -> None:
        """Holds ``rows``, read from the database (or written by their report) after ``read`` gave
        ``version``: dropped if a transition ended since."""
        with self._lock:
            if version == self._version:
                self._rows.update(rows)

    def forget(self, video_id: str) -> None:
        """A report's write was refused: the row changed under it."""
        with self._lock:
            self._rows.pop(video_id, None)

    def changed(self) -> None:
        """A transition's transaction ended: every row held may be stale."""
        with self._lock:
            self._version += 1
            self._rows.clear()


class OwnerReports:
    """The reports of the jobs' owners (their leases renewed in ``JobLeases``), checked against the
    rows ``HeldJobs`` holds and written each as one guarded statement (no transaction spans them)."""

    def __init__(self, state: StoreState):
        self.state = state

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
        now = self.state.clock()
        ids = [report["video_id"] for report in reports]
        version, rows = self.state.held.read(ids)
        with contextlib.ExitStack() as opened:
            conn = None
            if missing := [video_id for video_id in ids if video_id not in rows]:
                conn = opened.enter_context(self.state.reads.connect())
                c = jobs_table.c
                found = conn.execute(
                    select(c.id, c.status, c.owner, c.attempt, c.progress, c.media_bytes).where(c.id.in_(missing))
                ).all()
                read = {row.id: Held(*row[1:]) for row in found}
                self.state.held.keep(version, read)
                rows.update(read)
            kept = []
            for report in reports:
                row = rows.get(report["video_id"])
                values = report_values(owner, row, **report)
                if not values:  # refused (None), or nothing to write ({})
                    kept.append(values is not None)
                    continue
                conn = conn or opened.enter_context(self.state.reads.connect())
                kept.append(self._write(conn, version, row, report, values, now))
        self.state.leases.heard(owner, handle, [report["video_id"] for report, ok in zip(reports, kept) if ok])
        return kept

    def _write(self, conn, version: int, row: Held, report: dict, values: dict, now: float) -> bool:
        """Writes what a report changes of its job, guarded by its owner and attempt."""
        video_id = report["video_id"]
        if not guarded(conn, video_id, row.owner, row.attempt, {**values, "heartbeat": now}):
            self.state.held.forget(video_id)
            return False
        written = row._replace(**{k: v for k, v in values.items() if k in Held._fields})
        self.state.held.keep(version, {video_id: written})
        return True


def report_values(owner, row: Held | None, video_id, attempt, progress=None, running=False, media_bytes=None):
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
