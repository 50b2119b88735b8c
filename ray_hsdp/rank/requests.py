"""How a rank's ``offer`` waits for the request it handed its runtime: a lane's leader under the
request's deadline, for its result; another rank of the lane for its part, learning only the errors
that its lane stopped on. And the faults ``Rank.inject_fault`` sets, firing once."""

from __future__ import annotations

import logging

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.deadlines import run_timeout
from ray_hsdp.rank.start import LoadedRank
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.runtime import RankRuntime, SessionFailedError
from ray_hsdp.runtime.core import RequestStoppedError

logger = logging.getLogger("ray_hsdp")

#: Faults ``inject_fault`` knows: a rank hung before its next collective, a forward that raises,
#: a split decode that raises.
FAULTS = ("stall", "forward", "decode")


def follow(job, request_id: str, rank: int) -> None:
    """Waits for a request this rank helps its lane's leader with; returns None once its part ended.

    Raises:
        SessionFailedError: This rank's session failed.
        Exception: An error that stopped the lane here (not one the lane stopped it with).
    """
    try:
        job.get()
    except SessionFailedError:
        raise
    except RequestStoppedError:
        pass  # its lane stopped it: the leader answers why
    except Exception as err:
        # An error only here stopped the lane: the caller learns its cause from this rank.
        logger.warning("Request %r failed on rank %d of its lane: %s", request_id, rank, err)
        raise


def lead(runtime: RankRuntime, job, request: GenerationRequest, config: GroupConfig) -> GenerationResult:
    """Waits for the result of ``request``, which this rank leads, cancelling it once it misses
    its deadline (``run_timeout``: ``TimeoutError`` at its next step)."""
    deadline = run_timeout(request, config)
    if not job.wait(deadline):
        # Interrupting is safe: the tick protocol takes any number of forwards per request.
        error = TimeoutError(f"request {request.request_id!r} missed its deadline of {deadline:g}s")
        runtime.cancel_job(job, error)
    return job.get()


def inject_fault(loaded: LoadedRank, kind: str, seconds: float = 0.0) -> None:
    """Sets the fault ``kind`` (``FAULTS``; ``Rank.inject_fault``) on a loaded sharded rank."""
    from ray_hsdp.runtime.faults import FailNextForward, FailNextSplitDecode, StallNextTick

    runtime = loaded.runtime
    if runtime.modules is None:
        raise RuntimeError("only a sharded rank ticks and runs sharded forwards")
    if kind == "stall":
        runtime.exchange = StallNextTick(runtime.exchange, seconds)
    elif kind == "forward":
        runtime.modules = FailNextForward(runtime.modules)
    elif kind == "decode":
        pipeline = loaded.pipeline
        if not pipeline.lane_tiles:
            raise RuntimeError("this rank's lane does not split its decodes")
        pipeline.lane_tiles = {size: FailNextSplitDecode(lane) for size, lane in pipeline.lane_tiles.items()}
    else:
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")
