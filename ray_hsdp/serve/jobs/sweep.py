"""The job store's own housekeeping: ``expire`` what is past its ``expires_at`` (with its files),
fail the released jobs no group took within ``lost_wait_s``, release the jobs whose owner is known
gone (``jobs.leases``), and remove the media files no record holds (``jobs.store``).

It runs at some of the store's writes (the ingress' ``claim``, a few times a second; a create; a
takeover); never at a read, which would wait for the housekeeping of every active job; and in no
thread of its own: an owner's silence counts only while the store runs calls."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from sqlalchemy import delete, select

from ray_hsdp.serve.jobs.records import ACTIVE, jobs_table

if TYPE_CHECKING:
    from ray_hsdp.serve.jobs.state import StoreState
    from ray_hsdp.serve.jobs.transitions import JobEndings

logger = logging.getLogger("ray_hsdp")

#: How often at most the store looks for expired, stale and lost jobs (at a write, not in a thread).
SWEEP_EVERY_S = 0.5
#: How often at most it lists the media store for files no record holds.
ORPHANS_EVERY_S = 60.0


class JobSweep:
    """The store's housekeeping, on its state (``StoreState``), ending jobs through ``endings``.

    Args:
        orphan_after_s: A media file no record holds is removed once it is this old.
    """

    def __init__(self, state: StoreState, endings: JobEndings, orphan_after_s: float = 600.0):
        self.state = state
        self.endings = endings
        self.orphan_after_s = orphan_after_s
        #: When the last sweep, and the last look for orphan files, ran (the state's clock).
        self.swept_at = self.orphans_swept_at = 0.0
        self._lock = threading.Lock()

    def run(self) -> None:
        """``expire`` what is past its ``expires_at`` (with its files); fail the released jobs no
        group took within ``lost_wait_s``; release the jobs whose owner is known gone; try failed
        file removals again; now and then, remove the files no record holds."""
        now = self.state.clock()
        if now - self.swept_at < SWEEP_EVERY_S or not self._lock.acquire(blocking=False):
            return
        try:
            self.swept_at = now
            c = jobs_table.c
            with self.state.transaction() as conn:
                expired = conn.execute(select(c.id, c.media_key).where(c.expires_at <= now)).all()
                for row in expired:
                    conn.execute(delete(jobs_table).where(c.id == row.id))
                active = conn.execute(
                    select(c.id, c.endpoint, c.owner, c.attempt, c.released_at, c.released_code, c.released_why,
                           c.attempt_errors).where(c.status.in_(ACTIVE))
                ).all()  # fmt: skip
                for row in active:
                    self._sweep_one(conn, row, now)
                self.state.leases.keep_jobs({row.id for row in active})
            for row in expired:
                self.state.media.remove(row.media_key)
            self.state.media.retry_removals()
            if now - self.orphans_swept_at >= ORPHANS_EVERY_S:
                self.orphans_swept_at = now
                self._remove_orphans()
        finally:
            self._lock.release()

    def _sweep_one(self, conn, row, now: float) -> None:
        limit = self.state.limits_of(row.endpoint)
        if row.released_at is not None and row.owner is None:
            if now - row.released_at > limit["lost_wait_s"]:
                wait = f"video_lost_wait_s={limit['lost_wait_s']:g}s"
                why = f"{row.released_why}; no other group took it over within {wait}"
                self.endings.fail_in(conn, row.id, row.released_code, why, None, row.attempt)
        elif row.owner is not None and (gone := self.state.leases.gone(row.owner, limit["stale_after_s"], row.id)):
            logger.warning("Releasing video job %s of attempt %d: %s", row.id, row.attempt, gone)
            self.endings.give_up(conn, row, "replica_lost", gone)

    def _remove_orphans(self) -> None:
        """Removes the media files that no record holds (a record's files, or those an active job's
        attempt may be writing now), once ``orphan_after_s`` old."""
        c = jobs_table.c
        with self.state.engine.connect() as conn:
            rows = conn.execute(select(c.id, c.attempt, c.status, c.media_key)).all()
        kept = {row.media_key for row in rows if row.media_key}
        kept |= {f"{row.id}-{row.attempt}" for row in rows if row.status in ACTIVE}
        try:
            removed = self.state.media.remove_orphans(kept, self.orphan_after_s)
        except Exception as err:  # noqa: BLE001 - listed again at the next round
            logger.warning("Listing the media store for orphan files failed: %s", err)
            return
        if removed:
            logger.info("Removed %d media files that no video job holds", removed)
