"""The job reads the ingress answers (``JobReads``, a part of ``OpenAIIngress``): a page of the
jobs, a job's video object and its content, from the job store as an endpoint holds them, the
content read from the media store directly where the process reaches it."""

from __future__ import annotations

import asyncio

from ray_hsdp.serve.errors import (
    RequestLimitError,
    UnknownCursorError,
    VideoGoneError,
    VideoNotFoundError,
    VideoNotReadyError,
)
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.model_health import SHARE_SERVING, ModelWatch


class JobReads:
    """A job's object and content.

    Args:
        store: The job store, as the ingress reaches it.
        endpoint: The name the store keeps this endpoint's jobs under.
        watch: Each model's state (a queued job's model that sleeps says so).
    """

    def __init__(self, store: StoreClient, endpoint: str, watch: ModelWatch):
        self.store = store
        self.endpoint = endpoint
        self.watch = watch

    async def page(self, limit: int = 20, after: str | None = None, order: str = "desc") -> dict:
        """One page of the endpoint's jobs (``GET /v1/videos``): ``limit`` of them after the job
        ``after``, newest first (``desc``) or oldest first (``asc``)."""
        if not 1 <= limit <= 100:
            raise RequestLimitError(f"limit must be between 1 and 100, got {limit}")
        if order not in ("asc", "desc"):
            raise RequestLimitError(f"order must be 'asc' or 'desc', got {order!r}")
        page = await self.store.call("list", self.endpoint, limit, after, order)
        if page is None:
            raise UnknownCursorError(f"after={after!r} names no video")
        return page

    async def video(self, video_id: str) -> dict:
        """The video object of a job; a queued one whose model sleeps or wakes on its GPU share says
        so in ``model_state`` (``waking``: it starts once its model is awake)."""
        found = await self.store.call("get", self.endpoint, video_id)
        if found is None:
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        state = self.watch.states.get(found.get("model")) if found["status"] == "queued" else None
        return {**found, "model_state": state} if state in SHARE_SERVING else found

    async def video_content(self, video_id: str, variant: str = "video") -> bytes:
        """The MP4 of a completed job, or its first frame as PNG (``variant="thumbnail"``): read
        from the media store here where this process reaches it, else through the store."""
        if variant not in ("video", "thumbnail"):
            raise RequestLimitError(f"variant must be 'video' or 'thumbnail', got {variant!r}")
        media = await self.store.media()
        if media is not None:
            status, found = await self.store.call("locate", self.endpoint, video_id)
            if status == "ok":
                data = await asyncio.to_thread(media.read, found, variant)
                status, found = ("ok", data) if data is not None else ("gone", f"its {variant} file is missing")
        else:
            status, found = await self.store.call("content", self.endpoint, video_id, variant)
        if status == "missing":
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        if status == "not_ready":
            raise VideoNotReadyError(f"video {video_id!r} is {found}; its content exists once it is completed")
        if status == "gone":
            raise VideoGoneError(
                f"video {video_id!r} completed, but {found} from the media store (removed outside ray_hsdp, or a "
                "media_store that did not outlive its records): create it again"
            )
        return found
