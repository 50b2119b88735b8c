"""One record per accepted request (``record``, when it is answered): its structured log line, the
group's listeners (a Serve replica's metrics), and what the group learns from its run."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future

from ray_hsdp.group.errors import GroupFailedError, describe_error
from ray_hsdp.group.scheduler import RequestRecord
from ray_hsdp.group.state import GroupState, QueuedJob
from ray_hsdp.request import GenerationResult, RequestCancelledError

logger = logging.getLogger("ray_hsdp")


def record(state: GroupState, job: QueuedJob, future: Future) -> None:
    """Logs the request's one structured line and tells the listeners."""
    now = time.monotonic()
    error = None if future.cancelled() else future.exception()
    result = future.result() if not future.cancelled() and error is None else None
    if result is not None:
        status = "ok"
    elif future.cancelled() or isinstance(error, RequestCancelledError):
        status = "cancelled"
    else:
        status = "failed" if isinstance(error, GroupFailedError) else "error"
    request_record = RequestRecord(
        request_id=job.request.request_id,
        status=status,
        steps=job.request.num_inference_steps,
        queued_s=round((job.taken or now) - job.enqueued, 4),
        run_s=round(now - job.taken, 4) if job.taken is not None else None,
        lane=job.lane,
        lane_size=len(job.ranks) if job.taken is not None else None,
        widened_to=job.widened_to,
        rank=result.rank if result is not None else None,
        step_s=result.step_s if result is not None else None,
        before_loop_s=result.before_loop_s if result is not None else None,
        after_loop_s=result.after_loop_s if result is not None else None,
        error=describe_error(error) if error is not None else None,
        compiled=result is not None and result.compiled,
    )
    if status == "ok":
        learn_time(state, job, now - job.taken, result)
    event = "warm-up" if job.warm_up else "request"
    line = {"event": event, "group": state.group_id, **state.labels, **dataclasses.asdict(request_record)}
    logger.info("%s %s", event, json.dumps(line))
    for listener in [] if job.warm_up else list(state.listeners):
        try:
            listener(request_record)
        except Exception:  # noqa: BLE001 - a listener's bug must not break the answer path
            logger.exception("A request listener failed")


def learn_time(state: GroupState, job: QueuedJob, run_s: float, result: GenerationResult) -> None:
    """Folds a finished request's run into the group's measured times (``lane_times``, and its
    mean step against the work it ran beside: ``tick_model``; under the lock, as the scheduler
    reads them there). The warm-up, a run that compiled (``result.compiled``: a new shape) and
    a widened one (it mixed two lane sizes) teach nothing."""
    step_s = result.step_s
    if job.variant.work and job.widened_to is None and not (job.warm_up or result.compiled):
        with state.cond:
            state.lane_times.learn(len(job.ranks), job.variant.work, run_s)
            if step_s is not None:
                state.tick_model.learn(job.tick_work, step_s)
