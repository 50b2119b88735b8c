"""What callers read of the video job store, as functions of its state (``StoreState``): a job, a
page of jobs, where a job's files are, and the counts by status. A read never sweeps (``JobSweep``:
it would wait for the housekeeping of every active job) and never leaves out a job that has not
expired. ``JobStore`` runs each as a store call (``database.answering``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import func, select

from ray_hsdp.serve.jobs.records import job_row, jobs_table, public, unexpired

if TYPE_CHECKING:
    from ray_hsdp.serve.jobs.state import StoreState


def kept_row(state: StoreState, conn, video_id: str, endpoint: str):
    """A job's row as a read sees it: ``None`` once past its ``expires_at`` (the sweep that
    removes it, at a write, may not have run yet)."""
    return job_row(conn, video_id, endpoint, unexpired(state.clock()))


def video(state: StoreState, endpoint: str, video_id: str) -> dict | None:
    """The video object, or ``None`` when the endpoint has no such job (any more)."""
    with state.reads.connect() as conn:
        row = kept_row(state, conn, video_id, endpoint)
    return public(row) if row is not None else None


def page(state: StoreState, endpoint: str, limit: int, after: str | None, order: str) -> dict | None:
    """A page of video objects (``order`` ``desc``: newest first), or ``None`` when ``after``
    names no job."""
    c = jobs_table.c
    with state.reads.connect() as conn:
        query = select(jobs_table).where(c.endpoint == endpoint, unexpired(state.clock()))
        if after is not None:
            anchor = job_row(conn, after, endpoint)
            if anchor is None:
                return None
            query = query.where(c.seq < anchor.seq if order == "desc" else c.seq > anchor.seq)
        query = query.order_by(c.seq.desc() if order == "desc" else c.seq.asc()).limit(limit + 1)
        rows = conn.execute(query).all()
    data = [public(row) for row in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "has_more": len(rows) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def location(state: StoreState, endpoint: str, video_id: str) -> tuple[str, str | None]:
    """Where a job's files are: ``("ok", media key)``, ``("missing", None)`` or
    ``("not_ready", status)`` (for a caller that reads the media itself: ``JobMedia.reaches``)."""
    with state.reads.connect() as conn:
        row = kept_row(state, conn, video_id, endpoint)
    if row is None:
        return "missing", None
    if row.status != "completed":
        return "not_ready", row.status
    return "ok", row.media_key


def counts(state: StoreState, endpoint: str | None = None) -> dict[str, int]:
    """Jobs kept, by status (the metrics' gauge), of one endpoint or of all."""
    c = jobs_table.c
    query = select(c.status, func.count()).group_by(c.status)
    if endpoint is not None:
        query = query.where(c.endpoint == endpoint)
    with state.reads.connect() as conn:
        return {status: int(n) for status, n in conn.execute(query).all()}
