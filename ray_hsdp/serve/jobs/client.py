"""How the ingress and the group replicas reach the cluster's job store (``jobs.actor``): the actor
found again after it died (and, for an ingress, started again with the same locations), calls that
must land retried through a store outage, and the media store read and written directly where this
process reaches it (``jobs.media``), so MP4 bytes never cross the store's actor there."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

from ray_hsdp.serve.jobs.media import JobMedia, media_reaches
from ray_hsdp.serve.jobs.records import StoreUnavailableError

logger = logging.getLogger("ray_hsdp")

#: What a call to the store may end with while the store is away: its database does not answer,
#: its actor restarts or is gone (found again at the next call), or it did not answer in time.
STORE_AWAY = (StoreUnavailableError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, TimeoutError)

#: The longest one store call may take (a database that hangs on an open connection answers 503).
CALL_TIMEOUT_S = 30.0

#: The backoff of a call that must land (``StoreClient.landed``): first and longest wait.
RETRY_FIRST_S, RETRY_MOST_S = 0.25, 5.0


class StoreClient:
    """One process' way to the job store.

    Args:
        opener: Returns the store's actor handle (blocking; run off the event loop): for an ingress,
            ``open_store`` with its endpoint's locations (it starts a store that is gone); for a
            group replica, ``find_store``.
    """

    def __init__(self, opener: Callable[[], object]):
        self._opener = opener
        self._handle = None
        self._media: JobMedia | None | bool = False  # False: not asked yet

    async def handle(self):
        """The store's actor, opened (or found) once and again after it died."""
        if self._handle is None:
            self._handle = await asyncio.to_thread(self._opener)
        return self._handle

    def cached(self):
        """The handle last found, or ``None`` (for a thread that must not wait: the metrics)."""
        return self._handle

    async def call(self, method: str, *args, **kwargs):
        """``method`` of the store; a store whose actor died is found (or started) again and asked
        once more.

        Raises:
            StoreUnavailableError: The store's database does not answer now (a 503 to a client).
        """
        for again in (False, True):
            handle = await self.handle()
            call = getattr(handle, method).remote(*args, **kwargs)
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    return await call
            except TimeoutError:
                why = f"the video job store did not answer {method} within {CALL_TIMEOUT_S:g}s"
                raise StoreUnavailableError(why) from None
            except ray.exceptions.ActorDiedError as err:
                if self._handle is handle:
                    self._handle = None
                if again:
                    raise StoreUnavailableError(f"the video job store is gone and was not found again: {err}") from None
                logger.warning("The video job store's actor died; finding it again")
        raise AssertionError("unreachable")

    async def landed(self, method: str, *args, until_s: float, **kwargs):
        """``method`` of the store, tried again with a growing wait while the store is away, for
        up to ``until_s``: an owner's report, release, completion or failure waits out an outage
        rather than being lost.

        Raises:
            StoreUnavailableError: The store was still away after ``until_s``.
        """
        deadline, wait = time.monotonic() + until_s, RETRY_FIRST_S
        while True:
            try:
                return await self.call(method, *args, **kwargs)
            except STORE_AWAY as err:
                if time.monotonic() + wait > deadline:
                    raise StoreUnavailableError(f"the video job store was away for {until_s:g}s: {err}") from None
                if isinstance(err, (ray.exceptions.RayActorError, TimeoutError)):
                    self._handle = None  # find it again: it may have been started anew
                logger.info("The video job store is away (%s); %s waits %.2gs", type(err).__name__, method, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_MOST_S)

    async def media(self) -> JobMedia | None:
        """The media store, where this process reaches it; ``None``: through the store's actor."""
        if self._media is False:
            url, node = await self.call("media_location")
            here = ray.get_runtime_context().get_node_id()
            reach = await asyncio.to_thread(media_reaches, url, node, here)
            self._media = JobMedia(url, node) if reach else None
        return self._media
