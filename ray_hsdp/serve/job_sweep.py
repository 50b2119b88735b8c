"""The job store's own housekeeping, at its calls (no thread): ``expire`` what is past its
``expires_at`` (with its files), fail the released jobs no group took within ``lost_wait_s``, and
release the jobs whose owner stopped reporting for ``stale_after_s`` (``job_store``)."""

from __future__ import annotations

import time

from sqlalchemy import delete, or_, select

from ray_hsdp.serve.job_records import ACTIVE, jobs_table

#: How often at most the store looks for expired, stale and lost jobs (at a call, not in a thread).
SWEEP_EVERY_S = 0.2


def released_values(code: str, why: str, hold_s: float = 0.0) -> dict:
    """A released job's values: queued, owned by none, back at progress 0, waiting since now, not
    placed again for ``hold_s``; ``restarted`` once an attempt that had started running gave it up
    (a queued job that moves is not run again)."""
    now = time.time()
    c = jobs_table.c
    return dict(owner=None, status="queued", progress=0, heartbeat=now, released_at=now, released_code=code,
                released_why=why, claimed_until=now + hold_s,
                restarted=or_(c.restarted, c.status == "in_progress"))  # fmt: skip


class JobSweep:
    """The sweep side of ``JobStore`` (its engine, media, limits and guarded writes)."""

    def _sweep(self) -> None:
        """``expire`` what is past its ``expires_at`` (with its files); fail the released jobs no
        group took within ``lost_wait_s``; release the jobs whose owner stopped reporting for
        ``stale_after_s`` (its process or node is gone)."""
        now = time.time()
        if now - self._swept < SWEEP_EVERY_S or not self._sweep_lock.acquire(blocking=False):
            return
        try:
            self._swept = now
            c = jobs_table.c
            with self.engine.begin() as conn:
                expired = conn.execute(select(c.id, c.media_key).where(c.expires_at <= now)).all()
                for row in expired:
                    conn.execute(delete(jobs_table).where(c.id == row.id))
                active = conn.execute(
                    select(
                        c.id,
                        c.endpoint,
                        c.owner,
                        c.attempt,
                        c.heartbeat,
                        c.released_at,
                        c.released_code,
                        c.released_why,
                    ).where(c.status.in_(ACTIVE))  # fmt: skip
                ).all()
                for row in active:
                    self._sweep_one(conn, row, now)
            for row in expired:
                self.media.remove(row.media_key)
        finally:
            self._sweep_lock.release()

    def _sweep_one(self, conn, row, now: float) -> None:
        limit = self.limits_of(row.endpoint)
        if row.released_at is not None and row.owner is None:
            if now - row.released_at > limit["lost_wait_s"]:
                wait = f"video_lost_wait_s={limit['lost_wait_s']:g}s"
                why = f"{row.released_why}; no other group took it over within {wait}"
                self._fail(conn, row.id, row.released_code, why, None, row.attempt)
        elif row.owner is not None and now - row.heartbeat > limit["stale_after_s"]:
            why = f"the replica running this job stopped reporting for {limit['stale_after_s']:g}s"
            self._guarded(conn, row.id, row.owner, row.attempt, released_values("replica_lost", why))
