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

``JobStore`` is the store's one entry: each of its calls is a store call (``database.answering``)
run by one of its parts, which share the store's state (``jobs.state``): the transitions
(``jobs.transitions``), the owners' reports (``jobs.reports``), the sweep (``jobs.sweep``) and the
reads (``jobs.views``).
"""

from __future__ import annotations

from sqlalchemy import delete, insert
from sqlalchemy.exc import IntegrityError

from ray_hsdp.serve.jobs import views
from ray_hsdp.serve.jobs.database import answering
from ray_hsdp.serve.jobs.media import JobMedia
from ray_hsdp.serve.jobs.records import endpoints_table
from ray_hsdp.serve.jobs.reports import OwnerReports
from ray_hsdp.serve.jobs.state import DEFAULT_LIMITS, StoreState, limits  # noqa: F401 (imported from here)
from ray_hsdp.serve.jobs.sweep import JobSweep
from ray_hsdp.serve.jobs.transitions import JobCreation, JobEndings, JobPlacement

#: Progress (0-100) at the end of denoising; decode and MP4 encoding fill the rest.
DENOISED = 90
DECODED = 95

#: The transitions of a job, each a method of ``JobStore`` (and the only writers of a job's row).
TRANSITIONS = (
    "create", "start", "release", "claim", "unclaim", "adopt", "take_waiting", "complete", "fail", "cancel", "expire",
)  # fmt: skip
#: The transitions whose method has another name: start is a report, cancel a delete, expire the sweep's.
TRANSITION_METHODS = {"start": "renew", "cancel": "delete", "expire": "_sweep"}


class JobStore:
    """The video jobs of a cluster's endpoints, their MP4s, and their transitions: each call a
    store call (``answering``) that one of its parts runs on the state they share (``state``).

    Args:
        url: The records' SQLAlchemy URL (``sqlite:////path/jobs.sqlite``, ``postgresql+psycopg://...``).
        media: The MP4s' folder or fsspec URL.
        node: The Ray node this store runs on (where a media folder is: ``JobMedia.reaches``).
        orphan_after_s: A media file no record holds is removed once it is this old.
    """

    def __init__(self, url: str, media: str, node: str | None = None, orphan_after_s: float = 600.0):
        self.state = StoreState(url, media, node)
        self.creation = JobCreation(self.state)
        self.reports = OwnerReports(self.state)
        self.endings = JobEndings(self.state)
        self.placement = JobPlacement(self.state)
        self.sweeper = JobSweep(self.state, self.endings, orphan_after_s)

    @property
    def engine(self):
        """The database's engine of the transactions (``StoreState.engine``)."""
        return self.state.engine

    @property
    def reads(self):
        """The database's engine of the reads and reports (``StoreState.reads``)."""
        return self.state.reads

    @property
    def media(self) -> JobMedia:
        """The media store (``StoreState.media``)."""
        return self.state.media

    def media_location(self) -> tuple[str, str | None]:
        """The media store's URL and the node its folder is on, for a caller that reads or writes it
        itself (``JobMedia.reaches``)."""
        return self.state.media.url, self.state.media.node

    def _sweep(self) -> None:
        """``expire`` and the rest of the housekeeping (``JobSweep.run``), at some writes."""
        self.sweeper.run()

    # ---- the endpoints' limits ---------------------------------------------------------------

    @answering
    def configure(self, endpoint: str, new_limits: dict) -> None:
        """Sets an endpoint's limits (its ingress at each start, so an edit applies with no restart
        of any group); kept in the database for a restarted store."""
        for again in (False, True):
            try:
                with self.state.transaction() as conn:
                    conn.execute(delete(endpoints_table).where(endpoints_table.c.endpoint == endpoint))
                    conn.execute(insert(endpoints_table).values(endpoint=endpoint, limits=dict(new_limits)))
                break
            except IntegrityError:  # another ingress replica's configure committed in between
                if again:
                    raise
        self.state.set_limits(endpoint, new_limits)

    def limits_of(self, endpoint: str) -> dict:
        """An endpoint's limits (``StoreState.limits_of``)."""
        return self.state.limits_of(endpoint)

    # ---- transitions -------------------------------------------------------------------------

    @answering
    def create(
        self, endpoint: str, pool: str, fields: dict, owner: str, spec: str, video_id: str | None = None
    ) -> tuple[str, dict | str]:
        """A new job, or a named one adopted again, after a sweep (``JobCreation.create``)."""
        self._sweep()
        return self.creation.create(endpoint, pool, fields, owner, spec, video_id)

    @answering
    def renew(self, owner: str, reports: list[dict], handle=None) -> list[bool]:
        """``start`` and every report of one owner, in one call (``OwnerReports.renew``)."""
        return self.reports.renew(owner, reports, handle)

    def report(self, video_id: str, owner: str, attempt: int, progress: int | None = None, running: bool = False):
        """One report (``renew`` of one job)."""
        return self.renew(owner, [dict(video_id=video_id, attempt=attempt, progress=progress, running=running)])[0]

    @answering
    def release(self, video_id: str, owner: str, attempt: int, code: str, why: str, hold_s: float = 0.0) -> bool:
        """``owner`` gives its attempt up; the job waits for another group (``JobEndings.release``)."""
        return self.endings.release(video_id, owner, attempt, code, why, hold_s)

    @answering
    def claim(self, pools: list[str], hold_s: float) -> list[tuple[str, str, str, str, int, str]]:
        """The released jobs of ``pools``, held for the asking ingress, after a sweep (``JobPlacement.claim``)."""
        self._sweep()
        return self.placement.claim(pools, hold_s)

    @answering
    def unclaim(self, video_id: str, attempt: int, retry_in_s: float) -> bool:
        """A claim whose placement failed, free again after ``retry_in_s`` (``JobPlacement.unclaim``)."""
        return self.placement.unclaim(video_id, attempt, retry_in_s)

    @answering
    def adopt(self, video_id: str, replica: str, attempt: int) -> int | None:
        """``replica`` runs a released attempt again, as attempt + 1 (``JobPlacement.adopt``)."""
        return self.placement.adopt(video_id, replica, attempt)

    @answering
    def take_waiting(self, replica: str, pool: str, waited_s: float) -> tuple[str, str, int] | None:
        """A job kept waiting on a busy group, taken by ``replica``, after a sweep (``JobPlacement.take_waiting``)."""
        self._sweep()
        return self.placement.take_waiting(replica, pool, waited_s)

    def complete(
        self, video_id: str, owner: str, attempt: int, mp4: bytes, thumbnail: bytes, size: str | None = None
    ) -> bool:
        """``complete`` of an owner that cannot reach the media store itself: the store writes the
        MP4 and its first frame, then completes the job (``complete_stored``)."""
        key = f"{video_id}-{attempt}"
        stored = self.state.media.write(key, mp4, thumbnail)
        return self.complete_stored(video_id, owner, attempt, key, stored, size)

    @answering
    def complete_stored(
        self, video_id: str, owner: str, attempt: int, key: str, stored: int, size: str | None = None
    ) -> bool:
        """``owner``'s attempt wrote its files under ``key``: the job is completed (``JobEndings.complete_stored``)."""
        return self.endings.complete_stored(video_id, owner, attempt, key, stored, size)

    @answering
    def fail(
        self, video_id: str, code: str, message: str, owner: str | None = None, attempt: int | None = None
    ) -> bool:
        """The job ends failed with the reason (``JobEndings.fail``)."""
        return self.endings.fail(video_id, code, message, owner, attempt)

    @answering
    def delete(self, endpoint: str, video_id: str) -> bool:
        """``cancel``: the job and its files removed (``JobCreation.delete``)."""
        return self.creation.delete(endpoint, video_id)

    # ---- reads (``jobs.views``) --------------------------------------------------------------

    @answering
    def get(self, endpoint: str, video_id: str) -> dict | None:
        """The video object, or ``None`` when the endpoint has no such job (any more)."""
        return views.video(self.state, endpoint, video_id)

    @answering
    def list(self, endpoint: str, limit: int, after: str | None, order: str) -> dict | None:
        """A page of video objects (``order`` ``desc``: newest first), or ``None`` when ``after``
        names no job."""
        return views.page(self.state, endpoint, limit, after, order)

    @answering
    def locate(self, endpoint: str, video_id: str) -> tuple[str, str | None]:
        """Where a job's files are (``views.location``)."""
        return views.location(self.state, endpoint, video_id)

    def content(self, endpoint: str, video_id: str, variant: str) -> tuple[str, bytes | str | None]:
        """``("ok", bytes)``, ``("missing", None)``, ``("not_ready", status)`` or ``("gone", why)``
        (a completed job whose file is missing from the media store), through the store's actor for a
        caller that cannot reach the media itself."""
        status, key = self.locate(endpoint, video_id)
        if status != "ok":
            return status, key
        data = self.state.media.read(key, variant)
        if data is None:
            return "gone", f"the {variant} file of video {video_id!r} is missing from the media store"
        return "ok", data

    @answering
    def counts(self, endpoint: str | None = None) -> dict[str, int]:
        """Jobs kept, by status (the metrics' gauge), of one endpoint or of all."""
        return views.counts(self.state, endpoint)
