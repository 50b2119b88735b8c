"""A replica's one path of a request to its group (``GroupRequests``): handed to the group once
ready (a group being rebuilt is waited for, a sleeping model of a GPU share woken), awaited, and
cancelled when its caller goes; the images route and the video jobs (``videos``) both take it."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

from ray_hsdp import deadlines
from ray_hsdp.group import Engine, GroupFailedError, QueueTimeoutError
from ray_hsdp.request import GenerationRequest, GenerationResult, RequestCancelledError
from ray_hsdp.serve.replica.gpu_share import WakeFailedError
from ray_hsdp.serve.replica.state import ReplicaState

logger = logging.getLogger("ray_hsdp")


class GroupRequests:
    """The requests a replica hands its group.

    Args:
        state: The replica's state (its keeper, its GPU share, the ids it cancelled).
    """

    def __init__(self, state: ReplicaState):
        self.state = state
        #: Request id -> the group's future of a request running here (a retry of it joins it).
        self.held: dict[str, Future] = {}

    def ready_group(self) -> Engine:
        """The group, or a 503 while a failed one is rebuilt (the rebuild starts here if needed)."""
        current = self.state.keeper.current()
        if not current.done():
            raise GroupFailedError("the shard group failed and is being rebuilt; retry shortly")
        return current.result()

    async def submit(self, job: GenerationRequest, variant=None):
        """Hands ``job`` (and its ``variant``) to the group; a group being rebuilt is waited for, as a
        queued request waits, until the job's ``queue_deadline`` (what is left is the group queue's).

        Returns:
            The group's future of the result.
        """
        config = self.state.config
        deadline = deadlines.queue_deadline(job, config)
        wait_s = max(0.0, deadline - time.time())
        try:
            # Not wait_for: on Python 3.11 it swallows a cancel that lands once the group is ready,
            # and the cancelled request would then be submitted and run all its steps.
            async with asyncio.timeout(wait_s):
                group = await asyncio.shield(asyncio.wrap_future(self.state.keeper.current()))
        except TimeoutError:
            raise QueueTimeoutError(
                "the shard group was still being rebuilt at the request's deadline "
                f"(queue_timeout_s={config.queue_timeout_s:g} from its arrival)"
            ) from None
        if job.request_id in self.state.cancelled:
            # Cancelled while it waited for the rebuild (the failed group held no record of it).
            raise RequestCancelledError(f"request {job.request_id!r} was cancelled before its group took it")
        if self.state.share is None:
            return group.submit(variant or job)
        return await self._submit_awake(group, job, deadline, variant)

    async def _submit_awake(self, group: Engine, job: GenerationRequest, deadline: float, variant=None):
        """``group.submit`` once the model is awake on its GPU share (woken here if it slept),
        holding it awake until the request is answered. A wake that fails fails the group, whose
        rebuild the request then waits for, within its deadline."""
        share = self.state.share
        try:
            lease, entered = await share.enter(deadline)
        except WakeFailedError as err:
            group.fail(str(err))  # its keeper rebuilds it
            rebuilt = await self._rebuilt(deadline)
            lease, entered = await share.enter(deadline)
            group = rebuilt
        if job.request_id in self.state.cancelled:  # cancelled while its model woke
            share.leave(lease)
            raise RequestCancelledError(f"request {job.request_id!r} was cancelled while its model woke")
        if entered.get("woke"):
            self.state.metrics.woke(entered["wake_s"])
        try:
            future = group.submit(variant or job)
        except BaseException:
            share.leave(lease)
            raise
        future.add_done_callback(lambda _: share.leave(lease))
        return future

    async def _rebuilt(self, deadline: float) -> Engine:
        """The group once its rebuild ended (``QueueTimeoutError`` at ``deadline``)."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                return await asyncio.shield(asyncio.wrap_future(self.state.keeper.current()))
        except TimeoutError:
            raise QueueTimeoutError("the shard group was still being rebuilt at the request's deadline") from None

    def cancel(self, request_id: str) -> None:
        """The one cancel path of a request this replica runs (DELETE, its client gone, a job taken
        over): ``ShardGroup.cancel``, which drops it from the queue or stops it on its lane. The id
        is remembered too, so that a request waiting for its group's rebuild is never handed to the
        rebuilt group."""
        self.state.cancelled.append(request_id)
        try:
            self.state.group.cancel(request_id)
        except Exception as err:  # noqa: BLE001 - a failed group answers the request itself
            logger.warning("Cancelling %s failed: %s", request_id, err)

    async def result(self, job: GenerationRequest, future=None, variant=None) -> GenerationResult:
        """The result of ``job`` (awaiting ``future``, or submitting it and its ``variant``). A caller
        that goes away (the ingress' call is cancelled: its client disconnected, or a retry elsewhere
        won) stops it here. (A group failing under it raises ``GroupFailedError``: the ingress
        retries the call on another group, ``OpenAIIngress._call``.)"""
        try:
            if future is None:
                future = await self.submit(job, variant)
                self.held[job.request_id] = future
                future.add_done_callback(lambda _: self.held.pop(job.request_id, None))
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.cancel(job.request_id)
            raise
