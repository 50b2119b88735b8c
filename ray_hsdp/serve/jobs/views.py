"""What callers read of the video job store: a job, a page of jobs, where a job's files are, its
content through the store, and the counts by status. A read never sweeps and never leaves out a
job that has not expired."""

from __future__ import annotations

import time

from sqlalchemy import func, select

from ray_hsdp.serve.jobs.database import answering
from ray_hsdp.serve.jobs.records import jobs_table, public, unexpired


class JobViews:
    """What callers read of the store (``JobStore`` holds the engine, the media and the limits).
    A read never sweeps (``JobSweep``): it would wait for the housekeeping of every active job."""

    def _row(self, conn, video_id: str, endpoint: str | None = None, *kept):
        """A job's row (of ``endpoint``, where given, and meeting ``kept``), or ``None``."""
        query = select(jobs_table).where(jobs_table.c.id == video_id, *kept)
        if endpoint is not None:
            query = query.where(jobs_table.c.endpoint == endpoint)
        return conn.execute(query).first()

    def _kept_row(self, conn, video_id: str, endpoint: str):
        """A job's row as a read sees it: ``None`` once past its ``expires_at`` (the sweep that
        removes it, at a write, may not have run yet)."""
        return self._row(conn, video_id, endpoint, unexpired(time.time()))

    @answering
    def get(self, endpoint: str, video_id: str) -> dict | None:
        """The video object, or ``None`` when the endpoint has no such job (any more)."""
        with self.reads.connect() as conn:
            row = self._kept_row(conn, video_id, endpoint)
        return public(row) if row is not None else None

    @answering
    def list(self, endpoint: str, limit: int, after: str | None, order: str) -> dict | None:
        """A page of video objects (``order`` ``desc``: newest first), or ``None`` when ``after``
        names no job."""
        c = jobs_table.c
        with self.reads.connect() as conn:
            query = select(jobs_table).where(c.endpoint == endpoint, unexpired(time.time()))
            if after is not None:
                anchor = self._row(conn, after, endpoint)
                if anchor is None:
                    return None
                query = query.where(c.seq < anchor.seq if order == "desc" else c.seq > anchor.seq)
            query = query.order_by(c.seq.desc() if order == "desc" else c.seq.asc()).limit(limit + 1)
            rows = conn.execute(query).all()
        page = [public(row) for row in rows[:limit]]
        return {
            "object": "list",
            "data": page,
            "has_more": len(rows) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }

    @answering
    def locate(self, endpoint: str, video_id: str) -> tuple[str, str | None]:
        """Where a job's files are: ``("ok", media key)``, ``("missing", None)`` or
        ``("not_ready", status)`` (for a caller that reads the media itself: ``JobMedia.reaches``)."""
        with self.reads.connect() as conn:
            row = self._kept_row(conn, video_id, endpoint)
        if row is None:
            return "missing", None
        if row.status != "completed":
            return "not_ready", row.status
        return "ok", row.media_key

    def content(self, endpoint: str, video_id: str, variant: str) -> tuple[str, bytes | str | None]:
        """``("ok", bytes)``, ``("missing", None)``, ``("not_ready", status)`` or ``("gone", why)``
        (a completed job whose file is missing from the media store), through the store's actor for a
        caller that cannot reach the media itself."""
        status, key = self.locate(endpoint, video_id)
        if status != "ok":
            return status, key
        data = self.media.read(key, variant)
        if data is None:
            return "gone", f"the {variant} file of video {video_id!r} is missing from the media store"
        return "ok", data

    @answering
    def counts(self, endpoint: str | None = None) -> dict[str, int]:
        """Jobs kept, by status (the metrics' gauge), of one endpoint or of all."""
        c = jobs_table.c
        query = select(c.status, func.count()).group_by(c.status)
        if endpoint is not None:
            query = query.where(c.endpoint == endpoint)
        with self.reads.connect() as conn:
            return {status: int(n) for status, n in conn.execute(query).all()}
