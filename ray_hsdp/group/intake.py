"""What enters a group's queue and leaves it at a caller's word: a request checked into its
variant (``check``), queued with its deadline (``enqueue``), cancelled (``cancel``)."""

from __future__ import annotations

import time
from concurrent.futures import Future

from ray_hsdp import deadlines
from ray_hsdp.group.errors import GroupFailedError, GroupOverloadedError
from ray_hsdp.group.records import record
from ray_hsdp.group.state import GroupState, QueuedJob, resolve
from ray_hsdp.request import GenerationRequest, RequestCancelledError
from ray_hsdp.variant import RequestVariant


def check(state: GroupState, request: GenerationRequest) -> RequestVariant:
    """The request's variant (``ShardGroup.check``)."""
    return RequestVariant.build(request, state.config, state.pipeline_facts)


def enqueue(state: GroupState, ask: GenerationRequest | RequestVariant, warm_up: bool = False) -> Future:
    """Queues a request or its variant (``ShardGroup.submit``); a ``warm_up`` request (the compile
    warm-up) is logged, but no listener hears of it."""
    variant = ask if isinstance(ask, RequestVariant) else check(state, ask)
    request = variant.request
    future: Future = Future()
    with state.cond:
        if state.closed or state.failure:
            raise GroupFailedError(state.failure or "the shard group is shut down")
        running = len({id(job) for _, job in state.inflight.values()})
        if len(state.pending) + running >= state.running_capacity + state.config.max_queue:
            raise GroupOverloadedError(
                f"the shard group's queue is full: {running} requests running, {len(state.pending)} waiting "
                f"(max_queue={state.config.max_queue}); retry later"
            )
        deadline = deadlines.queue_deadline(request, state.config)
        job = QueuedJob(variant, future, time.monotonic(), deadline, warm_up=warm_up)
        state.pending.append(job)
        state.wake = True
        state.cond.notify_all()
    future.add_done_callback(lambda done: record(state, job, done))
    return future


def cancel(state: GroupState, request_id: str) -> bool:
    """Cancels a request (``ShardGroup.cancel``); whether the group held it."""
    with state.cond:
        queued = [j for j in state.pending if j.request.request_id == request_id]
        state.pending = [j for j in state.pending if j.request.request_id != request_id]
        # The leader decides for its lane: it stops the request on all the lane's ranks at one tick.
        holders = {i for i, j in state.inflight.values() if j.request.request_id == request_id and i == j.ranks.start}
        if holders:
            state.cancels.extend((rank_index, request_id) for rank_index in holders)
            state.cond.notify_all()
    for job in queued:
        resolve(job.future, error=RequestCancelledError(f"request {request_id!r} was cancelled while queued"))
    return bool(queued or holders)
