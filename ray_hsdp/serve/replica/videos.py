"""The video jobs of a replica (``VideoJobs``, a part of ``HSDPServer``, whose group runs them):
create, run to an MP4 in the cluster's job store, take over jobs waiting on busy groups, run the
jobs the ingress places here, and release the jobs whose group failed, filled or was removed (the
ingress places them on another group: ``OpenAIIngress``); their progress is reported by one poller
per replica (``video_progress``). Every change of a job's owner is a transition of the store
(``jobs.store``), guarded by the job's attempt, which every report here carries."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from ray import serve

from ray_hsdp import deadlines
from ray_hsdp.group import GroupFailedError, GroupOverloadedError, remote_cause
from ray_hsdp.request import GenerationRequest, RequestCancelledError
from ray_hsdp.serve.detached import Detached
from ray_hsdp.serve.errors import (
    JobTableFullError,
    RequestLimitError,
    job_error_code,
)
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.jobs.records import decode_spec, encode_spec
from ray_hsdp.serve.jobs.store import DECODED
from ray_hsdp.serve.media import encode_mp4, encode_png
from ray_hsdp.serve.replica.requests import GroupRequests
from ray_hsdp.serve.replica.state import ReplicaState, check_model, forget_stop, refusal
from ray_hsdp.serve.replica.video_progress import poll_progress
from ray_hsdp.serve.schema import VideoCreateRequest, to_video_request, what_ran

logger = logging.getLogger("ray_hsdp")


def _application_going() -> bool:
    """Whether this replica's whole application is being deleted (or Serve shut down)."""
    try:
        app = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception:  # noqa: BLE001 - no controller to ask: Serve itself is going
        return True
    return app is None or app.status == "DELETING"


async def runnable(store: StoreClient, video_id: str, spec: str, owner: str | None, attempt: int):
    """A stored request as ``(job, fps)``; one this version cannot read (an earlier version's, or a
    broken one) fails its job at once in ``store`` with the reason, and gives ``None``: nothing loops."""
    try:
        return decode_spec(spec)
    except Exception as err:  # noqa: BLE001 - the job says why it failed
        why = f"its stored request cannot be read by this version ({type(err).__name__}: {err})"
    logger.warning("Failing video job %s: %s", video_id, why)
    await store.call("fail", video_id, "internal_error", why, owner, attempt)
    return None


def video_fields(model_name: str, job: GenerationRequest, fps: int) -> dict:
    """What the store keeps of a new job's request for its video object."""
    return {
        "model": model_name,
        "prompt": job.prompt,
        "size": f"{job.width}x{job.height}",
        "seconds": f"{job.num_frames / fps:g}",
        "num_frames": job.num_frames,
        "fps": fps,
        "seed": job.seed,
        **what_ran(job),
    }


class VideoJobs:
    """A replica's video jobs, run by its group through its request path.

    Serve runs the replica's constructor on its event loop, where this one starts the replica's
    progress poller and, with ``video_takeover_after_s``, its takeover of waiting jobs (held here:
    the loop keeps only a weak reference to its tasks).

    Args:
        state: The replica's state (its store, its keeper, the jobs that run here and their attempts).
        requests: The replica's request path to its group (a job's run and its cancel).
    """

    def __init__(self, state: ReplicaState, requests: GroupRequests):
        self.state = state
        self.requests = requests
        loop = asyncio.get_running_loop()
        #: Where a request's work that outlives its cancel runs (a job's create and start, an adoption).
        self._detached = Detached()
        self._poller = loop.create_task(poll_progress(state, requests.cancel))
        # (A model of a GPU share has one group: no other group of its pool could take a job over.)
        if state.config.video_takeover_after_s is not None and not state.share:
            self._takeover = loop.create_task(self._take_waiting_jobs(state.config.video_takeover_after_s))

    async def _landed(self, method: str, *args, **kwargs):
        """An owner's store call that must land (a release, a completion, a failure): it waits out a
        store outage for up to ``video_lost_wait_s`` (the job stays this replica's meanwhile)."""
        return await self.state.store.landed(method, *args, until_s=self.state.config.video_lost_wait_s, **kwargs)

    async def drain(self) -> None:
        """The replica is removed: its video jobs get ``drain_timeout_s`` to finish; then each is
        released in the store for the ingress to place on another group (its seed makes the same
        video there), and stopped here. When the whole application goes (serve delete), no group
        of it will take them: they fail at once, with that reason."""
        tasks = dict(self.state.videos)
        if not tasks:
            return
        state, drain_s = self.state, self.state.config.drain_timeout_s
        if await asyncio.to_thread(_application_going):
            why = f"the application serving {state.model_name} was deleted"
            await asyncio.gather(
                *(self._landed("fail", v, "group_failed", why, state.replica, state.attempts[v]) for v in tasks),
                return_exceptions=True,
            )
        else:
            logger.info("Draining %d video jobs (drain_timeout_s=%g)", len(tasks), drain_s)
            await asyncio.wait(tasks.values(), timeout=drain_s)
            why = f"the shard group running it was removed and drain_timeout_s={drain_s:g} passed"
            for video_id, task in tasks.items():
                if not task.done():
                    await self._release(video_id, "drained", why)
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def create(
        self,
        request: dict | VideoCreateRequest,
        endpoint: str,
        video_id: str | None = None,
        avoid_replica: str | None = None,
    ) -> dict:
        """Creates a video job (``POST /v1/videos``) and starts it; returns the video object at
        once, in every state of the group: while the group is rebuilt, the job waits queued (and
        another group with a free lane may take it over: ``video_takeover_after_s``).

        Args:
            request: The body, its seed drawn.
            endpoint: The application whose ingress took it (the store keeps its jobs apart).
            video_id: The job's id, picked by the ingress: a create it sends again after its first
                replica was lost under the call adopts the job that call may have created.
            avoid_replica: The replica whose group failed the first call (it refuses the retry).
        """
        if avoid_replica == self.state.replica or self.state.draining:
            raise refusal(self.state, "this shard group is failed or being removed; it cannot take the job")
        body = VideoCreateRequest.model_validate(request)
        check_model(self.state, body.model)
        facts = self.state.group.pipeline_facts
        if not facts.get("video"):
            raise RequestLimitError(f"{self.state.model_name} makes images, not videos; use /v1/images/generations")
        job, fps = to_video_request(body, self.state.config, facts["temporal_compression"], request_id="")
        variant = self.state.group.check(job)
        fields = video_fields(self.state.model_name, job, fps)
        # The store's create and the job's start are one step that the caller's cancel (a client
        # gone) cannot split, run as the replica's own work (``serve.detached`` says why): a
        # created job always runs here (a caller that left deletes it).
        return await self._detached.start(self._create_and_start(endpoint, fields, variant, fps, video_id))

    async def _create_and_start(self, endpoint: str, fields: dict, variant, fps: int, video_id) -> dict:
        """The job's record in the store (``create``), then its run here; its video object."""
        state = self.state
        status, created = await state.store.call(
            "create", endpoint, state.pool, fields, state.replica, encode_spec(variant.request, fps), video_id
        )
        if status == "full":
            raise JobTableFullError(created)
        if status == "deleted":
            raise RequestCancelledError(created)
        if status == "ended":
            return created  # the first call's job: it ran to its end meanwhile
        variant = dataclasses.replace(variant, request=dataclasses.replace(variant.request, request_id=created["id"]))
        future = None
        current = state.keeper.current()
        # (A model of a GPU share submits from the job's task: it may have to wake first.)
        if created["id"] not in state.videos and current.done() and current.exception() is None and not state.share:
            try:
                future = current.result().submit(variant)
            except GroupOverloadedError:
                await state.store.call("delete", endpoint, created["id"])
                raise
            except GroupFailedError:
                pass  # it failed just now: the job's task waits for the rebuild, or is released
        self._start_video(created["id"], created["attempt"], variant.request, fps, future, variant)
        return created

    def _start_video(
        self, video_id: str, attempt: int, job: GenerationRequest, fps: int, future=None, variant=None
    ) -> None:
        """Runs ``attempt`` of a video job in the background on this replica's group, to its MP4 in
        the store (its first submit hands the group the ``variant`` its create checked, if any). Where
        a copy of the job runs here already (not stopped), it runs on as this attempt; a stop of an
        earlier copy here no longer applies."""
        self.state.attempts[video_id] = attempt
        if video_id in self.state.videos and video_id not in self.state.cancelled:
            return
        forget_stop(self.state, video_id)
        task = asyncio.create_task(self._run_video(video_id, job, fps, future, variant))
        self.state.videos[video_id] = task
        task.add_done_callback(lambda done: self._forget_video(video_id, done))

    def _forget_video(self, video_id: str, task: asyncio.Task) -> None:
        if self.state.videos.get(video_id) is task:
            del self.state.videos[video_id]
            self.state.attempts.pop(video_id, None)

    async def adopt(self, video_id: str, spec: str, attempt: int, avoid_replica: str | None = None) -> bool:
        """Runs a job the ingress placed here (``OpenAIIngress``) as the next attempt of the
        released ``attempt``: its group was lost, failed under it, filled, or was removed; its
        seed makes the same video here. It waits its turn anew. Returns once the job runs here
        (False: another replica adopted that attempt, the job is gone or ended, or its request
        cannot run: then the job fails at once, with the reason).

        The adoption and the job's start are one step that the caller's cancel (its deadline)
        cannot split (the replica's own work, ``serve.detached``): an adopted job always runs here.

        Raises:
            GroupFailedError: This is the replica to avoid, or it is being removed too.
        """
        if avoid_replica == self.state.replica or self.state.draining:
            why = "this shard group is the one the job left, or is being removed; it cannot take it"
            raise refusal(self.state, why)
        return await self._detached.start(self._adopt(video_id, spec, attempt))

    async def _adopt(self, video_id: str, spec: str, attempt: int) -> bool:
        decoded = await runnable(self.state.store, video_id, spec, None, attempt)
        if decoded is None:
            return False
        new_attempt = await self.state.store.call("adopt", video_id, self.state.replica, attempt)
        if new_attempt is None:
            return False
        job, fps = decoded
        job = dataclasses.replace(deadlines.waits_anew(job, self.state.config), request_id=video_id)
        try:
            self._start_video(video_id, new_attempt, job, fps)
        except Exception as err:  # an adoption that does not start is undone, never left owned and idle
            self.state.attempts[video_id] = new_attempt
            await self._release(video_id, "group_failed", f"the group that adopted it could not start it ({err})")
            raise
        return True

    async def _take_waiting_jobs(self, waited_s: float) -> None:
        """While this group has idle lanes (``ShardGroup.idle_lanes``: nothing runs there, and
        nothing waits for them): adopts the video jobs that have waited queued for ``waited_s``
        on other, busy groups, one per idle lane (the store picks the oldest; their first
        replicas stop their copies at their next report, refused for its old attempt). No error
        ends it: a round that fails is tried again at the next."""
        while not self.state.stopping.is_set():
            await asyncio.sleep(waited_s / 2)
            if self.state.draining or self.state.keeper is None or not self.state.keeper.ready:
                continue
            try:
                for _ in range(self.state.keeper.group.idle_lanes()):
                    if not await self._take_one_waiting(waited_s):
                        break
            except Exception as err:  # noqa: BLE001 - the store or the group answers again at the next round
                logger.warning("Taking over waiting video jobs failed: %s", err)

    async def _take_one_waiting(self, waited_s: float) -> bool:
        """Takes over one waiting job; whether to look for another."""
        taken = await self.state.store.call("take_waiting", self.state.replica, self.state.pool, waited_s)
        if taken is None:
            return False
        video_id, spec, attempt = taken
        decoded = await runnable(self.state.store, video_id, spec, self.state.replica, attempt)
        if decoded is None:
            return True
        job, fps = decoded
        job = dataclasses.replace(job, request_id=video_id)
        try:  # requests that came in while the store answered may have filled the group
            future = self.state.keeper.group.submit(job) if video_id not in self.state.videos else None
        except (GroupOverloadedError, GroupFailedError) as err:
            logger.info("Could not take over video job %s: %s", video_id, err)
            why = f"a group that took it over could not run it ({err})"
            await self._landed("release", video_id, self.state.replica, attempt, job_error_code(err), why)
            return False
        logger.info("Took over video job %s, which waited queued on a busy shard group", video_id)
        self._start_video(video_id, attempt, job, fps, future)
        return True

    async def _release(self, video_id: str, code: str, why: str, hold_s: float = 0.0) -> None:
        """Gives this replica's attempt of a job up, for the ingress to place it on another group."""
        await self._landed("release", video_id, self.state.replica, self.state.attempts[video_id], code, why, hold_s)

    async def _run_video(
        self, video_id: str, job: GenerationRequest, fps: int, future, variant=None
    ) -> BaseException | None:
        """Runs a job to its MP4 in the store; returns the error that failed it, if any. A job
        whose group fails under it is released for the ingress to place on another group; in a
        pool of one group, it runs again here as its next attempt once the group is mended or
        rebuilt (both bounded by ``video_max_attempts``); a replica being removed releases it.
        One placed here while the group is full is released to wait for room. Its MP4 is stored
        only if this replica's attempt is still the job's. A store outage delays its reports,
        never its run."""
        try:
            while True:
                try:
                    result = await self.requests.result(job, future, variant)
                    break
                except GroupOverloadedError as err:
                    why, hold = f"placed on a full shard group ({err})", self.state.config.retry_after_s
                    await self._release(video_id, "overloaded", why, hold)
                    return None
                except GroupFailedError as err:
                    if not await self._after_group_failure(video_id, err):
                        return None
                    # A new deadline makes a new request: the group checks it again (variant None).
                    job, future, variant = deadlines.waits_anew(job, self.state.config), None, None
            frames = result.frames[0]
            mp4 = await asyncio.to_thread(encode_mp4, frames, fps)  # off the event loop, far from any tick
            size = f"{frames.shape[2]}x{frames.shape[1]}"  # the output's: a pipeline may pick it from the image
            await self._store_video(video_id, mp4, encode_png(frames[0]), size)
            return None
        except RequestCancelledError as err:
            return err  # deleted or moved: nothing is kept
        except Exception as err:  # noqa: BLE001 - the job says why it failed
            err = remote_cause(err)
            logger.warning("Video job %s failed: %s", video_id, err)
            code = job_error_code(err)
            await self._landed("fail", video_id, code, str(err), self.state.replica, self.state.attempts[video_id])
            return err

    async def _after_group_failure(self, video_id: str, err: GroupFailedError) -> bool:
        """Gives a job whose group failed under it up to another group; where no other group can
        take it (one group in the pool), adopts it again here. Whether it runs again here."""
        if self.state.draining:  # (its drain would release it too: whichever comes first does)
            await self._release(video_id, "drained", f"its shard group failed while it was removed ({err})")
            return False
        logger.warning("Releasing video job %s after: %s", video_id, err)
        attempt = self.state.attempts[video_id]
        if not await self._landed("release", video_id, self.state.replica, attempt, "group_failed", str(err)):
            return False  # failed at its last attempt, deleted, or no longer this replica's
        if serve.get_replica_context().world_size >= 2:
            return False  # the ingress places it on another group
        new_attempt = await self._landed("adopt", video_id, self.state.replica, attempt)
        if new_attempt is None:
            return False
        self.state.attempts[video_id] = new_attempt
        # The poller's report of the released attempt was refused meanwhile and stopped the old
        # copy: that stop is not the new attempt's (a later refusal of it stops it again).
        forget_stop(self.state, video_id)
        return True

    async def _store_video(self, video_id: str, mp4: bytes, thumbnail: bytes, size: str) -> None:
        """Writes this attempt's files to the media store (directly where this process reaches it;
        the store's byte cap counts them from the report before) and completes the job."""
        attempt = self.state.attempts[video_id]
        stored = len(mp4) + len(thumbnail)
        report = dict(video_id=video_id, attempt=attempt, progress=DECODED, media_bytes=stored)
        if not (await self._landed("renew", self.state.replica, [report]))[0]:
            return  # deleted, or its attempt is another replica's: its video is not this run's
        media = await self.state.store.media()
        if media is None:
            await self._landed("complete", video_id, self.state.replica, attempt, mp4, thumbnail, size)
            return
        key = f"{video_id}-{attempt}"
        await asyncio.to_thread(media.write, key, mp4, thumbnail)
        await self._landed("complete_stored", video_id, self.state.replica, attempt, key, stored, size)
