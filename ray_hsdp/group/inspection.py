"""What a group tells about itself, as functions of its state (``ShardGroup``'s inspection methods
call them): each rank's memory and tick counts, profile windows, a health check with a deadline,
the topology, the load and each request's progress."""

from __future__ import annotations

from collections.abc import Callable

import ray

from ray_hsdp.group.errors import GroupFailedError, died
from ray_hsdp.group.failure import fail
from ray_hsdp.group.state import GroupState


def memory(state: GroupState, units: bool = False) -> list[dict]:
    """Each rank's memory report merged with where it runs."""
    reports = ray.get([r.memory.remote(units) for r in state.ranks], timeout=state.config.request_timeout_s)
    return [{**place, **report} for place, report in zip(state.placement, reports)]


def tick_stats(state: GroupState) -> list[dict]:
    """Each rank's counts of ticks, ghost passes and batched calls since it loaded (and, with
    compile, of the graphs it compiled)."""
    return ray.get([r.tick_stats.remote() for r in state.ranks], timeout=state.config.request_timeout_s)


def start_profile(state: GroupState, trace_dir: str | None = None) -> None:
    """Starts every rank's profile window (tick log, request phases, GPU kernels)."""
    ray.get([r.start_profile.remote(trace_dir) for r in state.ranks], timeout=state.config.request_timeout_s)


def stop_profile(state: GroupState) -> list[dict]:
    """Ends the profile windows; each rank's summary (see ``ray_hsdp.rank.profiling``)."""
    return ray.get([r.stop_profile.remote() for r in state.ranks], timeout=state.config.request_timeout_s)


def check_health(state: GroupState, lost: Callable[[int, str], None], timeout_s: float = 30.0) -> None:
    """Pings every rank with a deadline; a rank that died is ``lost`` (``Mend.lost``).

    Raises:
        GroupFailedError: The group is broken, or a rank died or did not answer in time (the
            group then fails, naming the rank).
    """
    ranks = list(state.ranks)
    if state.failure or not ranks:
        raise GroupFailedError(state.failure or "the shard group is shut down")
    if state.mending:  # a lost rank is being replaced: healthy meanwhile (its failure fails the group)
        return
    pings = [r.ping.remote() for r in ranks]
    answered, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
    for rank_index, ping in enumerate(pings):
        if ping not in answered:
            fail(state, f"shard group failed: rank {rank_index} did not answer its health check in {timeout_s:g}s")
            break
        try:
            ray.get(ping)
        except ray.exceptions.RayActorError as err:
            lost(rank_index, died(rank_index, err))
            break
    if state.failure:
        raise GroupFailedError(state.failure)


def describe(state: GroupState) -> dict:
    """Topology of this group: sizes, mode, device, where each rank runs."""
    config = state.config
    return {
        **state.dims.describe(),
        "group": state.group_id,
        **state.labels,
        "mode": config.mode,
        "device": config.device,
        "dtype": config.dtype,
        "model": config.served_model_name,
        "pipeline": state.pipeline_facts,
        "ranks": state.placement,
        # Where the start went: the group's phases as it waited on them, and each rank's own.
        "start": {
            "phases_s": dict(state.phases.seconds),
            "ranks_phases_s": list(state.rank_phases),
            "warm_up": list(state.warm_up_record),
        },
    }


def load(state: GroupState) -> tuple[int, int]:
    """``(queued, running)``: requests waiting in the queue, and those the lanes run now."""
    with state.cond:
        return len(state.pending), len({id(job) for _, job in state.inflight.values()})


def idle_lanes(state: GroupState) -> int:
    """Lanes where a request would start at once and alone, less the requests waiting for one:
    lanes none of whose ranks runs a request (with adaptive lanes, ranks that run none, each a
    lane of one; a helper's rank counts as idle, as a newcomer takes it back). A rank's further
    places (``requests_per_rank``) do not count: a request there runs beside another."""
    dims = state.dims
    with state.cond:
        busy = {rank_index for rank_index, _ in state.inflight.values()}
        waiting = len(state.pending)
    lanes = [range(r, r + 1) for r in range(dims.shard_size)] if dims.adaptive else [
        dims.lane_ranks(lane) for lane in range(dims.num_lanes)
    ]  # fmt: skip
    return max(0, sum(1 for lane in lanes if not busy.intersection(lane)) - waiting)


def progress(state: GroupState) -> dict[str, dict]:
    """Request id -> ``{"state": "queued"}`` or ``{"state": "running", "rank": i, "lane": l,
    "lane_size": k, "step": s, "total": n, "helpers": [h, ...]}`` (``rank`` is the lane's leader,
    which answers; ``lane`` its index among the group's lanes of ``lane_size`` ranks;
    ``helpers`` the ranks that join its forwards on a wider lane now, ``lane_widening``)."""
    with state.cond:
        out = {j.request.request_id: {"state": "queued"} for j in state.pending}
        running = {
            j.request.request_id: (i, j.lane, len(j.ranks), j.request.num_inference_steps, list(j.helpers))
            for i, j in state.inflight.values()
            if i == j.ranks.start
        }
        ranks = list(state.ranks)
    for request_id, (rank_index, lane, size, total, helpers) in running.items():
        out[request_id] = {
            "state": "running", "rank": rank_index, "lane": lane, "lane_size": size, "step": 0, "total": total,
            "helpers": helpers,
        }  # fmt: skip
    leaders = sorted({rank_index for rank_index, *_ in running.values()})
    reports = ray.get([ranks[i].progress.remote() for i in leaders], timeout=state.config.request_timeout_s)
    for report in reports:
        for request_id, (step, total) in report.items():
            if request_id in running:
                out[request_id].update(step=step, total=total)
    return out
