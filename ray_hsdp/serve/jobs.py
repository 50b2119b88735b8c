"""The video job table: a deployment of the application that every replica reaches through its
handle, so a job created through one replica is polled, downloaded and deleted through any other.

It holds the jobs' states and their MP4s. It belongs to the application: ``serve delete`` and
``serve shutdown`` remove it with its MP4s; a redeploy applies its limits (they are its
``user_config``: where Serve keeps the replica, it reconfigures it in place); a replica of the group
deployment may die without it. It
takes no CPU, so placement groups that hold every CPU cannot starve it.
"""

from __future__ import annotations

import threading
import time
import uuid

from ray import serve

#: Progress (0-100) at the end of denoising; decode and MP4 encoding fill the rest.
DENOISED = 90
DECODED = 95

#: The only moves a job makes; terminal states never change. A failed job's error code says why
#: (``deployment.JOB_ERROR_CODES``: ``timeout``, ``group_failed``, ``drained``, ``replica_lost``,
#: ``internal_error``, ...); a deleted job is gone (404), and a run another replica took over is
#: not the job's to fail.
TRANSITIONS = {
    "queued": {"in_progress", "completed", "failed"},
    "in_progress": {"completed", "failed"},
    "completed": set(),
    "failed": set(),
}


def limits(config) -> dict:
    """The table's ``user_config`` from an ``AppConfig``: what a redeploy may change in place."""
    return {
        "max_jobs": config.max_video_jobs,
        "max_bytes": config.max_video_bytes,
        "ttl_s": config.video_ttl_s,
        "stale_after_s": config.video_stale_after_s,
        "lost_wait_s": config.video_lost_wait_s,
    }


class JobViews:
    """What callers read of the table (``JobTable`` holds ``jobs``, ``media``, its lock and its sweep)."""

    @staticmethod
    def _public(job: dict) -> dict:
        out = {k: v for k, v in job.items() if not k.startswith("_")}
        if out["expires_at"] is not None:
            out["expires_at"] = int(out["expires_at"])
        return out

    def counts(self) -> dict[str, int]:
        """Jobs kept, by status (the metrics' gauge)."""
        with self._lock:
            self._sweep()
            out: dict[str, int] = {}
            for job in self.jobs.values():
                out[job["status"]] = out.get(job["status"], 0) + 1
            return out

    def get(self, video_id: str) -> dict | None:
        """The video object, or ``None`` when there is no such job (any more)."""
        with self._lock:
            self._sweep()
            job = self.jobs.get(video_id)
            return self._public(job) if job is not None else None

    def list(self, limit: int, after: str | None, order: str) -> dict | None:
        """A page of video objects (``order`` ``desc``: newest first), or ``None`` when ``after``
        names no job."""
        with self._lock:
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
        with self._lock:
            self._sweep()
            job = self.jobs.get(video_id)
            if job is None:
                return "missing", None
            if job["status"] != "completed":
                return "not_ready", job["status"]
            return "ok", self.media[video_id][variant]


class JobTable(JobViews):
    """Video jobs, newest last, with their MP4s (plain Python; ``VideoJobTable`` serves it).

    Args:
        max_jobs: Most jobs kept (any status); a create beyond it is refused.
        max_bytes: Most MP4 and thumbnail bytes kept; a create while at it is refused.
        ttl_s: How long a finished job is kept (its ``expires_at``); expired jobs are gone (404).
        stale_after_s: A queued or running job whose replica has not reported for this long has
            lost its replica (or its process, or its node): it is released (``_release``).
        lost_wait_s: How long a released job waits for a group of its model to adopt it (``claim``).
    """

    def __init__(
        self,
        max_jobs: int = 256,
        max_bytes: int = 2 * 1024**3,
        ttl_s: float = 3600.0,
        stale_after_s: float = 60.0,
        lost_wait_s: float = 300.0,
    ):
        self.jobs: dict[str, dict] = {}  # insertion order = creation order
        self.media: dict[str, dict[str, bytes]] = {}
        # Serve may run a deployment's sync methods on several threads.
        self._lock = threading.RLock()
        limits = {"max_jobs": max_jobs, "max_bytes": max_bytes, "ttl_s": ttl_s, "stale_after_s": stale_after_s}
        self.reconfigure({**limits, "lost_wait_s": lost_wait_s})

    def reconfigure(self, config: dict) -> None:
        """Applies new limits (Serve calls it with the ``user_config`` at start and on a redeploy)."""
        with self._lock:
            self.max_jobs = int(config["max_jobs"])
            self.max_bytes = int(config["max_bytes"])
            self.ttl_s = float(config["ttl_s"])
            self.stale_after_s = float(config["stale_after_s"])
            self.lost_wait_s = float(config["lost_wait_s"])

    # ---- the table's own housekeeping ------------------------------------------------------

    def _sweep(self) -> None:
        now = time.time()
        for video_id, job in list(self.jobs.items()):
            if job["expires_at"] is not None and job["expires_at"] <= now:
                self._drop(video_id)
            elif job["status"] not in ("queued", "in_progress"):
                continue
            elif job["_released"] is not None and now - job["_heartbeat"] > self.lost_wait_s:
                code, why = job["_released"]
                message = f"{why}; no other group took it over within video_lost_wait_s={self.lost_wait_s:g}s"
                self._move(video_id, "failed", error={"code": code, "message": message})
            elif not job["_owner"] or now - job["_heartbeat"] <= self.stale_after_s:
                continue  # reported lately, or owned by none: waits for a taker, not for a report
            else:  # its replica stopped reporting (its process or node is gone)
                why = f"the replica running this job stopped reporting for {self.stale_after_s:g}s"
                self._release(job, "replica_lost", why)

    def _release(self, job: dict, code: str, why: str) -> None:
        """The job waits, owned by none, for the ingress to run it again from its spec on another
        group of its model (``claim``); ``code`` and ``why`` fail it if none does in ``lost_wait_s``."""
        now = time.time()
        job.update(_owner="", _heartbeat=now, _waiting_since=0.0, _released=(code, why), _claimed_until=0.0)

    def _drop(self, video_id: str) -> None:
        self.jobs.pop(video_id, None)
        self.media.pop(video_id, None)

    def _move(self, video_id: str, status: str, error: dict | None = None) -> bool:
        """Moves a job to ``status`` if ``TRANSITIONS`` allows it; returns whether it moved."""
        job = self.jobs.get(video_id)
        if job is None or status not in TRANSITIONS[job["status"]]:
            return False
        job["status"] = status
        if status in ("completed", "failed"):
            now = time.time()
            # The spec (with an image-to-video job's image) is only for moving a queued job.
            job.update(completed_at=int(now), expires_at=now + self.ttl_s, error=error, _spec=None)
        return True

    def _bytes_kept(self) -> int:
        return sum(len(b) for media in self.media.values() for b in media.values())

    # ---- what replicas call ----------------------------------------------------------------

    def create(self, fields: dict, owner: str, spec: tuple, video_id: str | None = None) -> tuple[str, dict | str]:
        """Adds a queued job, or has ``owner`` adopt the one the ingress named.

        Args:
            fields: The video object's fields.
            owner: The replica whose group will run it.
            spec: What another group needs to run it instead (``take_waiting``, ``claim``): the
                prepared request and its fps.
            video_id: The job's id, picked by the ingress so that a create it sends again (its
                first replica was lost under the call) is the same job: ``owner`` adopts it.

        Returns:
            ``("ok", video object)`` for a job ``owner`` runs from now; ``("ended", video object)``
            for a named job that has finished or is gone; ``("full", why)`` when a limit is reached.
        """
        with self._lock:
            self._sweep()
            if video_id in self.jobs:
                adopted = self.adopt(video_id, owner)
                return ("ok" if adopted else "ended"), self._public(self.jobs[video_id])
            if len(self.jobs) >= self.max_jobs:
                return "full", f"the video job table holds {len(self.jobs)} jobs (max_video_jobs={self.max_jobs})"
            if self._bytes_kept() >= self.max_bytes:
                return "full", f"the video job table holds {self._bytes_kept()} bytes of videos (max_video_bytes)"
            video_id = video_id or f"video_{uuid.uuid4().hex}"
            self.jobs[video_id] = {
                "id": video_id,
                "object": "video",
                "status": "queued",
                "progress": 0,
                "created_at": int(time.time()),
                "completed_at": None,
                "expires_at": None,
                "error": None,
                "retried": False,  # True once another group took it over (its group was removed)
                "replica": None,  # the Serve replica (shard group) that runs it, once one does
                **fields,
                "_heartbeat": time.time(),
                "_waiting_since": time.time(),  # queued on its owner's group since
                "_owner": owner,
                "_spec": spec,
                # (code, why) while it waits, owned by none, for another group (``_release``).
                "_released": None,
                "_claimed_until": 0.0,  # an ingress is placing it until then (``claim``)
                "_last_owner": owner,  # the replica whose group ran it last: its next group is another
            }
            return "ok", self._public(self.jobs[video_id])

    def adopt(self, video_id: str, replica: str) -> bool:
        """``replica`` runs the job from now (the ingress placed it there after its group was
        lost, failed or removed): the owner changes, its earlier owner stops its copy at its next
        report, and a wait for a takeover (``take_waiting``) counts from now. False when the job
        is gone or finished."""
        with self._lock:
            job = self.jobs.get(video_id)
            if job is None or job["status"] not in ("queued", "in_progress"):
                return False
            now = time.time()
            job.update(retried=True, _owner=replica, _last_owner=replica, _heartbeat=now, _waiting_since=now)
            job.update(_released=None, _claimed_until=0.0)
            return True

    def update(self, video_id: str, replica: str, progress: int | None = None, running: bool = False) -> bool:
        """A job's report from the ``replica`` that runs it (also its heartbeat, queued or
        running): ``running`` once a lane took it; progress never goes down.

        Returns:
            False when the job is gone or finished (deleted, expired, failed by the sweep) or
            another replica has taken it (``take_waiting``, ``adopt``): this replica should stop it.
        """
        with self._lock:
            job = self.jobs.get(video_id)
            if job is None or job["status"] not in ("queued", "in_progress") or job["_owner"] != replica:
                return False
            job["_heartbeat"] = time.time()
            if running or progress:  # (a short job may end between two reports: progress says it ran)
                self._move(video_id, "in_progress")
                job["replica"] = replica
            if progress is not None and job["status"] == "in_progress":
                job["progress"] = max(job["progress"], min(int(progress), 99))
            return True

    def take_waiting(self, replica: str, waited_s: float, model: str | None = None) -> tuple[str, tuple] | None:
        """Hands ``replica`` (whose group of ``model`` has a free lane) the oldest job of that model
        that has waited queued for at least ``waited_s`` on another replica's busy group. Its old
        replica stops its copy at its next report, which this makes fail.

        Returns:
            ``(video_id, spec)`` (the spec ``create`` got), or None when no job waits so long.
        """
        with self._lock:
            self._sweep()
            now = time.time()
            for video_id, job in self.jobs.items():
                if (
                    job["status"] == "queued"
                    and job["_owner"] not in ("", replica)
                    and (model is None or job.get("model") == model)
                    and now - job["_waiting_since"] >= waited_s
                ):
                    job.update(_owner=replica, _last_owner=replica, _heartbeat=now, _waiting_since=now)
                    return video_id, job["_spec"]
            return None

    def release(self, video_id: str, replica: str, code: str, why: str) -> None:
        """``replica`` gives the job up (its group failed under it, its drain ended, or it took the
        job over and its group filled meanwhile): it waits, owned by none, for the ingress to place
        it on another group of its model (``claim``); ``code`` and ``why`` fail it if none does."""
        with self._lock:
            job = self.jobs.get(video_id)
            if job is not None and job["status"] in ("queued", "in_progress") and job["_owner"] == replica:
                self._release(job, code, why)

    def claim(self, models: list[str], hold_s: float) -> list[tuple[str, str, tuple, str]]:
        """The jobs of ``models`` that wait, owned by none, for a group (``_release``), each held
        for the asking ingress for ``hold_s`` (another ingress replica skips it meanwhile): it sends
        each to a group of its model (``HSDPServer.adopt_video``), which ``adopt``s it.

        Returns:
            ``(video_id, model, spec, the replica its last group belonged to)`` for each.
        """
        with self._lock:
            self._sweep()
            now = time.time()
            claimed = []
            for video_id, job in self.jobs.items():
                if job["_released"] is not None and job.get("model") in models and job["_claimed_until"] <= now:
                    job["_claimed_until"] = now + hold_s
                    claimed.append((video_id, job["model"], job["_spec"], job["_last_owner"]))
            return claimed

    def complete(self, video_id: str, mp4: bytes, thumbnail: bytes, replica: str, size: str | None = None) -> bool:
        """Stores the MP4 and its first frame from the ``replica`` that runs the job, and its
        ``size`` (``WxH``, the frames'); False (and nothing stored) when the job is gone, has failed
        meanwhile, or another replica took it over (that replica's video is the job's)."""
        with self._lock:
            job = self.jobs.get(video_id)
            if job is None or job["_owner"] != replica or not self._move(video_id, "completed"):
                return False
            self.media[video_id] = {"video": mp4, "thumbnail": thumbnail}
            self.jobs[video_id]["progress"] = 100
            if size is not None:
                self.jobs[video_id]["size"] = size
            return True

    def fail(self, video_id: str, code: str, message: str, replica: str | None = None) -> bool:
        """Marks a job failed with the reason; False when it had finished already, or when
        ``replica`` no longer runs it (another took it over: its failure is not the job's)."""
        with self._lock:
            job = self.jobs.get(video_id)
            if replica is not None and job is not None and job["_owner"] != replica:
                return False
            return self._move(video_id, "failed", error={"code": code, "message": message})

    def delete(self, video_id: str) -> bool:
        """Removes a job (afterwards its id is 404); its replica stops it at its next report.

        Returns:
            Whether it existed.
        """
        with self._lock:
            self._sweep()
            if video_id not in self.jobs:
                return False
            self._drop(video_id)
            return True


#: The table as a deployment of the application: one replica, no CPU, room for every replica's calls.
#: It lives on the head node, beside Serve's controller: a cluster that loses its head loses Serve
#: anyway, while a worker node's loss would take every video job's record with it.
VideoJobTable = serve.deployment(
    JobTable,
    name="VideoJobTable",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}},
    max_ongoing_requests=1000,
)
