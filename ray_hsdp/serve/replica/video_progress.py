"""A replica's one progress poller of its video jobs (``videos.VideoJobs`` starts it): its reports
to the job store are also the jobs' heartbeat, and the store's answer stops a job that is no longer
this replica's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray

from ray_hsdp.serve.jobs.store import DENOISED
from ray_hsdp.serve.replica.state import ReplicaState

logger = logging.getLogger("ray_hsdp")

#: How often a replica reports its video jobs' progress to the table (also their heartbeat).
PROGRESS_INTERVAL_S = 0.25


def progress_reports(state: ReplicaState, video_ids: list[str], progress: dict[str, dict]) -> list[dict]:
    """One report per job (a job's request id is its video id), from the group's ``progress``:
    its attempt, whether a lane runs it, and how far its denoising got (``None``: queued)."""
    reports = []
    for video_id in video_ids:
        found = progress.get(video_id)
        running = found is not None and found["state"] == "running"
        done = DENOISED * found["step"] // max(found["total"], 1) if running else None
        attempt = state.attempts.get(video_id, 0)
        reports.append(dict(video_id=video_id, attempt=attempt, progress=done, running=running))
    return reports


async def poll_progress(state: ReplicaState, cancel: Callable[[str], None]) -> None:
    """Every ``PROGRESS_INTERVAL_S`` until the replica stops: one look at the group's progress, and
    one report of all this replica's video jobs to the store (its lease: queued or running). A job
    the store refuses (gone, ended, or its attempt no longer this replica's) is stopped with
    ``cancel``; a store that does not answer refuses nothing."""
    me = None  # this replica's actor, which the store pings once it falls silent (read once jobs run)
    while not state.stopping.is_set():
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        videos = list(state.videos)
        if not videos or state.keeper is None:
            continue
        try:
            progress = await asyncio.to_thread(state.group.progress)
        except Exception:  # noqa: BLE001 - a failed group answers its jobs itself
            progress = {}
        reports = progress_reports(state, videos, progress)
        if me is None:
            me = ray.get_runtime_context().current_actor
        try:
            kept = await state.store.call("renew", state.replica, reports, me)
        except Exception as err:  # noqa: BLE001 - reported at the next round; nothing is stopped
            logger.info("Reporting %d video jobs waits for the job store: %s", len(reports), err)
            continue
        for report, still in zip(reports, kept):
            # (A job adopted here again meanwhile runs on under its new attempt.)
            if not still and state.attempts.get(report["video_id"]) == report["attempt"]:
                cancel(report["video_id"])
