"""The video job table: one named actor per application that every replica reaches, so a job
created through one replica is polled, downloaded and deleted through any other.

It holds the jobs' states and their MP4s (objects a replica puts die with the replica; this
actor's do not). It is detached, so it outlives any one replica, and takes no CPU
(``num_cpus=0``), so placement groups that hold every CPU cannot starve it.
"""

from __future__ import annotations

import time
import uuid

import ray

#: Progress (0-100) at the end of denoising; decode and MP4 encoding fill the rest.
DENOISED = 90
DECODED = 95


def table_name(app_name: str) -> str:
    """The actor name of an application's job table."""
    return f"ray_hsdp-videos-{app_name}"


@ray.remote(num_cpus=0)
class VideoJobs:
    """Video jobs, newest last, with their MP4s.

    Args:
        max_jobs: Most jobs kept (any status); a create beyond it is refused.
        max_bytes: Most MP4 and thumbnail bytes kept; a create while at it is refused.
        ttl_s: How long a finished job is kept (its ``expires_at``); expired jobs are gone (404).
        stale_after_s: A running job whose replica has not reported for this long is failed: the
            replica (or its process) is gone.
    """

    def __init__(self, max_jobs: int, max_bytes: int, ttl_s: float, stale_after_s: float):
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.stale_after_s = stale_after_s
        self.jobs: dict[str, dict] = {}  # insertion order = creation order
        self.media: dict[str, dict[str, bytes]] = {}

    # ---- the table's own housekeeping ------------------------------------------------------

    def _sweep(self) -> None:
        now = time.time()
        for video_id, job in list(self.jobs.items()):
            if job["expires_at"] is not None and job["expires_at"] <= now:
                self._drop(video_id)
            elif job["status"] in ("queued", "in_progress") and now - job["_heartbeat"] > self.stale_after_s:
                self._finish(
                    video_id,
                    "failed",
                    error={
                        "code": "replica_lost",
                        "message": f"the replica running this job stopped reporting for {self.stale_after_s:g}s",
                    },
                )

    def _drop(self, video_id: str) -> None:
        self.jobs.pop(video_id, None)
        self.media.pop(video_id, None)

    def _finish(self, video_id: str, status: str, error: dict | None = None) -> None:
        job = self.jobs[video_id]
        now = time.time()
        job.update(status=status, completed_at=int(now), expires_at=now + self.ttl_s, error=error)

    @staticmethod
    def _public(job: dict) -> dict:
        out = {k: v for k, v in job.items() if not k.startswith("_")}
        if out["expires_at"] is not None:
            out["expires_at"] = int(out["expires_at"])
        return out

    def _bytes_kept(self) -> int:
        return sum(len(b) for media in self.media.values() for b in media.values())

    # ---- what replicas call ----------------------------------------------------------------

    def create(self, fields: dict) -> tuple[str, dict | str]:
        """Adds a queued job.

        Returns:
            ``("ok", video object)``, or ``("full", why)`` when a limit is reached.
        """
        self._sweep()
        if len(self.jobs) >= self.max_jobs:
            return "full", f"the video job table holds {len(self.jobs)} jobs (max_video_jobs={self.max_jobs})"
        if self._bytes_kept() >= self.max_bytes:
            return "full", f"the video job table holds {self._bytes_kept()} bytes of videos (max_video_bytes)"
        video_id = f"video_{uuid.uuid4().hex}"
        self.jobs[video_id] = {
            "id": video_id,
            "object": "video",
            "status": "queued",
            "progress": 0,
            "created_at": int(time.time()),
            "completed_at": None,
            "expires_at": None,
            "error": None,
            **fields,
            "_heartbeat": time.time(),
            "_run": None,
        }
        return "ok", self._public(self.jobs[video_id])

    def update(self, video_id: str, progress: int | None = None, run: dict | None = None) -> bool:
        """A running job's report (also its heartbeat): progress never goes down; ``run`` says
        where it runs (the rank actors and request id a cancel must reach).

        Returns:
            False when the job is gone (deleted or expired): its replica should stop it.
        """
        job = self.jobs.get(video_id)
        if job is None:
            return False
        job["_heartbeat"] = time.time()
        if job["status"] == "queued" and (run is not None or progress):
            job["status"] = "in_progress"
        if run is not None:
            job["_run"] = run
        if progress is not None and job["status"] == "in_progress":
            job["progress"] = max(job["progress"], min(int(progress), 99))
        return True

    def complete(self, video_id: str, mp4: bytes, thumbnail: bytes) -> bool:
        """Stores the MP4 and its first frame; returns False when the job is gone."""
        if video_id not in self.jobs:
            return False
        self.media[video_id] = {"video": mp4, "thumbnail": thumbnail}
        self.jobs[video_id]["progress"] = 100
        self._finish(video_id, "completed")
        return True

    def fail(self, video_id: str, code: str, message: str) -> None:
        """Marks a job failed with the reason."""
        if video_id in self.jobs and self.jobs[video_id]["status"] in ("queued", "in_progress"):
            self._finish(video_id, "failed", error={"code": code, "message": message})

    def counts(self) -> dict[str, int]:
        """Jobs kept, by status (the metrics' gauge)."""
        self._sweep()
        out: dict[str, int] = {}
        for job in self.jobs.values():
            out[job["status"]] = out.get(job["status"], 0) + 1
        return out

    def get(self, video_id: str) -> dict | None:
        """The video object, or ``None`` when there is no such job (any more)."""
        self._sweep()
        job = self.jobs.get(video_id)
        return self._public(job) if job is not None else None

    def list(self, limit: int, after: str | None, order: str) -> dict | None:
        """A page of video objects (``order`` ``desc``: newest first), or ``None`` when ``after``
        names no job."""
        self._sweep()
        ids = list(self.jobs)
        if order == "desc":
            ids.reverse()
        if after is not None:
            if after not in self.jobs:
                return None
            ids = ids[ids.index(after) + 1 :]
        page = [self._public(self.jobs[i]) for i in ids[:limit]]
        return {
            "object": "list",
            "data": page,
            "has_more": len(ids) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }

    def content(self, video_id: str, variant: str) -> tuple[str, bytes | str | None]:
        """``("ok", bytes)``, ``("missing", None)`` or ``("not_ready", status)``."""
        self._sweep()
        job = self.jobs.get(video_id)
        if job is None:
            return "missing", None
        if job["status"] != "completed":
            return "not_ready", job["status"]
        return "ok", self.media[video_id][variant]

    def delete(self, video_id: str) -> tuple[bool, dict | None]:
        """Removes a job (afterwards its id is 404).

        Returns:
            Whether it existed, and where it ran when it was still running (the caller cancels it).
        """
        self._sweep()
        job = self.jobs.get(video_id)
        if job is None:
            return False, None
        running = job["_run"] if job["status"] in ("queued", "in_progress") else None
        self._drop(video_id)
        return True, running
