"""The rows of the jobs that owners report, as the store read them since its last transition: an
owner's steady report (nothing of its job to write) is answered from memory, without a database
round trip.

Safe because one store process makes every change to a job (``jobs.actor``): each transition other
than a report (a create, release, adoption, claim, completion, failure, delete, or the sweep)
forgets every row once its transaction has committed, and a row read before that is kept only when
no transition ended while it was read.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


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
