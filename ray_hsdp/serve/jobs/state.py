"""What the parts of the video job store share (``jobs.store``): its database (two engines on it,
the tables opened once), the media store, the owners' leases, the rows the reports hold, the
endpoints' limits, the wall clock of the records, and what the call running on each thread did of
the database (``database.answering`` reads it). One object, handed to each part: the transitions,
the reports, the sweep and the reads (``jobs.views``) hold no state of their own that another
part reads."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from sqlalchemy import event, select

from ray_hsdp.config.endpoint import EndpointConfig
from ray_hsdp.serve.jobs.database import engine_for
from ray_hsdp.serve.jobs.leases import JobLeases
from ray_hsdp.serve.jobs.media import JobMedia
from ray_hsdp.serve.jobs.records import add_missing_columns, endpoints_table, metadata
from ray_hsdp.serve.jobs.reports import HeldJobs


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


class StoreState:
    """The state of one store process that its parts share.

    Args:
        url: The records' SQLAlchemy URL (``sqlite:////path/jobs.sqlite``, ``postgresql+psycopg://...``).
        media: The MP4s' folder or fsspec URL.
        node: The Ray node this store runs on (where a media folder is: ``JobMedia.reaches``).
        clock: Wall-clock seconds: a record's times (created, heartbeat, expires) and the sweep's.
    """

    def __init__(self, url: str, media: str, node: str | None = None, clock: Callable[[], float] = time.time):
        self.engine = engine_for(url)
        #: The same pool without a transaction around each call: a read, and a report (whose writes
        #: are each one guarded statement), cost one round trip to the database, not three.
        self.reads = engine_for(url, isolation_level="AUTOCOMMIT")  # a pool of its own: no reset per use
        self.media = JobMedia(media, node)
        self.leases = JobLeases()
        #: The rows of the reported jobs, between two transitions: a steady report reads none.
        self.held = HeldJobs()
        self.clock = clock
        # What the call running on this thread did: ``changed_rows`` (a statement of the
        # transactions' engine hit a row; the reports write through ``reads``, and keep what they
        # write) and ``reached_database`` (a statement of either engine ran).
        self.call = threading.local()
        event.listen(self.engine, "after_execute", self._note_change)
        for engine in (self.engine, self.reads):
            event.listen(engine, "before_cursor_execute", self._note_contact)
        self._limits: dict[str, dict] = {}
        self._open_lock = threading.Lock()
        self._opened = False

    def _note_change(self, conn, statement, multiparams, params, options, result) -> None:
        if getattr(statement, "is_dml", False) and result.rowcount:
            self.call.changed_rows = True

    def _note_contact(self, *args) -> None:
        self.call.reached_database = True

    @contextlib.contextmanager
    def transaction(self):
        """``engine.begin()``; once it committed, a transaction that changed a row forgets the rows
        the reports hold (before the call's slower work: removing files, a media listing)."""
        self.call.changed_rows = False
        with self.engine.begin() as conn:
            yield conn
        if self.call.changed_rows:  # (one rolled back raised instead: it changed nothing)
            self.held.changed()

    def open(self) -> None:
        """Makes the tables (and adds the columns an earlier version lacked) once the database answers."""
        if self._opened:
            return
        with self._open_lock:
            if not self._opened:
                metadata.create_all(self.engine)
                add_missing_columns(self.engine)
                self._opened = True

    def limits_of(self, endpoint: str) -> dict:
        """An endpoint's limits: as it last configured them (read from the database by a restarted
        store), else ``DEFAULT_LIMITS``."""
        if endpoint not in self._limits:
            with self.engine.connect() as conn:
                row = conn.execute(select(endpoints_table).where(endpoints_table.c.endpoint == endpoint)).first()
            # (setdefault: a configure on the other thread meanwhile wins over this older read)
            self._limits.setdefault(endpoint, {**DEFAULT_LIMITS, **(row.limits if row is not None else {})})
        return self._limits[endpoint]

    def set_limits(self, endpoint: str, new_limits: dict) -> None:
        """An endpoint's limits from now on (once ``configure`` has written them)."""
        self._limits[endpoint] = {**DEFAULT_LIMITS, **new_limits}
