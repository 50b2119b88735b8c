"""The ingress' placement of released video jobs (``place_released_jobs``, one task per model): a
job its replica released in the job store (its replica stopped reporting, its group failed under it
or filled, its replica was removed) is sent to another group of its model, which adopts it in the
store as its next attempt."""

from __future__ import annotations

import asyncio
import logging

from ray.serve.handle import DeploymentHandle

from ray_hsdp.group import remote_cause
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.jobs.records import pool_of

logger = logging.getLogger("ray_hsdp")

#: How often an ingress replica asks the job table for released jobs to place, and how often a
#: synchronous video's caller looks at its job.
JOBS_POLL_S = 0.25

#: How long a released job the ingress is placing stays its own (another ingress replica skips it).
CLAIM_HOLD_S = 30.0

#: How soon a job whose placement failed may be placed again (by any ingress replica).
UNPLACED_RETRY_S = 1.0

#: The longest a group may take to answer one placement (``adopt_video``): a model whose groups
#: cannot answer (none runs, or all are starting) delays only its own jobs, and only this long.
PLACE_TIMEOUT_S = 10.0

#: Why a job was released, for which its next group may be any, its last included: it was full.
ROOM_CODES = ("overloaded",)


async def place_released_jobs(store: StoreClient, model: str, server: DeploymentHandle) -> None:
    """This replica's share of ``model``'s released jobs (``JobStore.claim``): each is sent to a
    group of the model (``server``, the handle of its group deployment) other than its last, unless
    it left that group for want of room (``HSDPServer.adopt_video``), which adopts it as its next
    attempt. One that no group takes within ``PLACE_TIMEOUT_S`` is claimed again after
    ``CLAIM_HOLD_S``, until the store fails it (``video_lost_wait_s``). One task per model: a model
    without groups delays no other's."""
    pool = pool_of(server.app_name, server.deployment_name)
    while True:
        await asyncio.sleep(JOBS_POLL_S)
        try:
            claimed = await store.call("claim", [pool], CLAIM_HOLD_S)
        except Exception as err:  # noqa: BLE001 - the store answers again at the next round
            logger.warning("Asking the job store for released video jobs failed: %s", err)
            continue
        for video_id, _, spec, last, attempt, code in claimed:
            avoid = None if code in ROOM_CODES else last
            call = server.adopt_video.remote(video_id, spec, attempt, avoid_replica=avoid)
            try:
                if await asyncio.wait_for(call, PLACE_TIMEOUT_S):
                    logger.info("Placed video job %s on another shard group of %s", video_id, model)
            except Exception as err:  # noqa: BLE001 - claimed again soon, or failed by the store
                call.cancel()
                logger.warning("No shard group of %s took video job %s: %r", model, video_id, remote_cause(err))
                await _unclaim(store, video_id, attempt)


async def _unclaim(store: StoreClient, video_id: str, attempt: int) -> None:
    """A placement that failed frees its claim for ``UNPLACED_RETRY_S`` (Serve's router may
    have picked a group whose replica is gone; the next pick is another), not ``CLAIM_HOLD_S``."""
    try:
        await store.call("unclaim", video_id, attempt, UNPLACED_RETRY_S)
    except Exception as err:  # noqa: BLE001 - the claim then runs out at CLAIM_HOLD_S
        logger.warning("Freeing the claim of video job %s failed: %s", video_id, err)
