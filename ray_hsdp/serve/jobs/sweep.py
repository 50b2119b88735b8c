"""The job store's own housekeeping: ``expire`` what is past its ``expires_at`` (with its files),
fail the released jobs no group took within ``lost_wait_s``, release the jobs whose owner is known
gone (``jobs.leases``), and remove the media files no record holds (``jobs.store``).

It runs at some of the store's writes (the ingress' ``claim``, a few times a second; a create; a
takeover); never at a read, which would wait for the housekeeping of every active job; and in no
thread of its own: an owner's silence counts only while the store runs calls."""

from __future__ import annotations

import logging
import time

from sqlalchemy import delete, or_, select

from ray_hsdp.serve.jobs.records import ACTIVE, jobs_table

logger = logging.getLogger("ray_hsdp")

#: How often at most the store looks for expired, stale and lost jobs (at a write, not in a thread).
SWEEP_EVERY_S = 0.5
#: How often at most it lists the media store for files no record holds.
ORPHANS_EVERY_S = 60.0


def released_values(code: str, why: str, hold_s: float = 0.0) -> dict:
    """A released job's values: queued, owned by none, back at progress 0, waiting since now, not
    placed again for ``hold_s``; ``restarted`` once an attempt that had started running gave it up
    (a queued job that moves is not run again); no bytes of its own counted any more."""
    now = time.time()
    c = jobs_table.c
    return dict(owner=None, status="queued", progress=0, heartbeat=now, released_at=now, released_code=code,
                released_why=why, claimed_until=now + hold_s, media_bytes=0,
                restarted=or_(c.restarted, c.status == "in_progress"))  # fmt: skip


class JobSweep:
    """The sweep side of ``JobStore`` (its engine, media, leases, limits and guarded writes)."""

    def _sweep(self) -> None:
        """``expire`` what is past its ``expires_at`` (with its files); fail the released jobs no
        group took within ``lost_wait_s``; release the jobs whose owner is known gone; try failed
        file removals again; now and then, remove the files no record holds."""
        now = time.time()
        if now - self._swept < SWEEP_EVERY_S or not self._sweep_lock.acquire(blocking=False):
            return
        try:
            self._swept = now
            c = jobs_table.c
            with self._transaction() as conn:
                expired = conn.execute(select(c.id, c.media_key).where(c.expires_at <= now)).all()
                for row in expired:
                    conn.execute(delete(jobs_table).where(c.id == row.id))
                active = conn.execute(
                    select(c.id, c.endpoint, c.owner, c.attempt, c.released_at, c.released_code, c.released_why,
                           c.attempt_errors).where(c.status.in_(ACTIVE))
                ).all()  # fmt: skip
                for row in active:
                    self._sweep_one(conn, row, now)
                self.leases.keep_jobs({row.id for row in active})
            for row in expired:
                self.media.remove(row.media_key)
            self.media.retry_removals()
            if now - self._orphans_swept >= ORPHANS_EVERY_S:
                self._orphans_swept = now
                self._remove_orphans()
        finally:
            self._sweep_lock.release()

    def _sweep_one(self, conn, row, now: float) -> None:
        limit = self.limits_of(row.endpoint)
        if row.released_at is not None and row.owner is None:
            if now - row.released_at > limit["lost_wait_s"]:
                wait = f"video_lost_wait_s={limit['lost_wait_s']:g}s"
                why = f"{row.released_why}; no other group took it over within {wait}"
                self._fail(conn, row.id, row.released_code, why, None, row.attempt)
        elif row.owner is not None and (gone := self.leases.gone(row.owner, limit["stale_after_s"], row.id)):
            logger.warning("Releasing video job %s of attempt %d: %s", row.id, row.attempt, gone)
            self._give_up(conn, row, "replica_lost", gone)

    def _remove_orphans(self) -> None:
        """Removes the media files that no record holds (a record's files, or those an active job's
        attempt may be writing now), once ``orphan_after_s`` old."""
        c = jobs_table.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(c.id, c.attempt, c.status, c.media_key)).all()
        kept = {row.media_key for row in rows if row.media_key}
        kept |= {f"{row.id}-{row.attempt}" for row in rows if row.status in ACTIVE}
        try:
            removed = self.media.remove_orphans(kept, self.orphan_after_s)
        except Exception as err:  # noqa: BLE001 - listed again at the next round
            logger.warning("Listing the media store for orphan files failed: %s", err)
            return
        if removed:
            logger.info("Removed %d media files that no video job holds", removed)
