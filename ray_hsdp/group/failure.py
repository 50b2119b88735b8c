"""A group's failure (``fail``): every part that finds the group broken (the scheduler thread, the
mend, a health check, a caller) ends it the same way."""

from __future__ import annotations

import logging

from ray_hsdp.group.errors import GroupFailedError
from ray_hsdp.group.ranks import kill_ranks
from ray_hsdp.group.state import GroupState, QueuedJob, resolve

logger = logging.getLogger("ray_hsdp")


def fail(state: GroupState, reason: str, also: QueuedJob | None = None) -> None:
    """Marks the group broken, fails every queued and running request (and ``also``) with
    ``reason`` and kills every rank at once: survivors would otherwise sit in a collective
    with a dead or out-of-step peer until its timeout."""
    with state.cond:
        first = state.failure is None
        state.failure = state.failure or reason
        queued = {id(j) for j in state.pending}
        jobs = [*state.pending, *(j for _, j in state.inflight.values()), *([also] if also else [])]
        state.pending, state.inflight = [], {}
        state.sessions, state.sessions_done = None, set()
        state.cond.notify_all()
    for job in jobs:
        resolve(job.future, error=GroupFailedError(state.failure, ran=id(job) not in queued))
    if first:
        logger.error("Shard group failed: %s", state.failure)
        kill_ranks(state)
