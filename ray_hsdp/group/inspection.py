"""What a group tells about itself (``ShardGroup``, whose ranks it asks): each rank's memory and
tick counts, profile windows, a health check with a deadline, the topology."""

from __future__ import annotations

import ray

from ray_hsdp.group.errors import GroupFailedError, died


class GroupInspection:
    """The inspection side of ``ShardGroup``."""

    def memory(self, units: bool = False) -> list[dict]:
        """Each rank's memory report merged with where it runs."""
        reports = ray.get([r.memory.remote(units) for r in self.ranks], timeout=self.config.request_timeout_s)
        return [{**place, **report} for place, report in zip(self.placement, reports)]

    def tick_stats(self) -> list[dict]:
        """Each rank's counts of ticks, ghost passes and batched calls since it loaded (and, with
        compile, of the graphs it compiled)."""
        return ray.get([r.tick_stats.remote() for r in self.ranks], timeout=self.config.request_timeout_s)

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Starts every rank's profile window (tick log, request phases, GPU kernels)."""
        ray.get([r.start_profile.remote(trace_dir) for r in self.ranks], timeout=self.config.request_timeout_s)

    def stop_profile(self) -> list[dict]:
        """Ends the profile windows; each rank's summary (see ``ray_hsdp.rank.profiling``)."""
        return ray.get([r.stop_profile.remote() for r in self.ranks], timeout=self.config.request_timeout_s)

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Pings every rank with a deadline.

        Raises:
            GroupFailedError: The group is broken, or a rank died or did not answer in time (the
                group then fails, naming the rank).
        """
        ranks = list(self.ranks)
        if self._failure or not ranks:
            raise GroupFailedError(self._failure or "the shard group is shut down")
        if self.mending:  # a lost rank is being replaced: healthy meanwhile (its failure fails the group)
            return
        pings = [r.ping.remote() for r in ranks]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for rank_index, ping in enumerate(pings):
            if ping not in answered:
                self._fail(f"shard group failed: rank {rank_index} did not answer its health check in {timeout_s:g}s")
                break
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as err:
                self._lost(rank_index, died(rank_index, err))
                break
        if self._failure:
            raise GroupFailedError(self._failure)

    def describe(self) -> dict:
        """Topology of this group: sizes, mode, device, where each rank runs."""
        return {
            **self.dims.describe(),
            "group": self.group_id,
            **self.labels,
            "mode": self.config.mode,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "model": self.config.served_model_name,
            "pipeline": self.pipeline_facts,
            "ranks": self.placement,
            # Where the start went: the group's phases as it waited on them, and each rank's own.
            "start": {
                "phases_s": dict(self.phases.seconds),
                "ranks_phases_s": list(self.rank_phases),
                "warm_up": list(self.warm_up_record),
            },
        }

    def load(self) -> tuple[int, int]:
        """``(queued, running)``: requests waiting in the queue, and those the lanes run now."""
        with self._cond:
            return len(self._pending), len({id(job) for _, job in self._inflight.values()})

    def idle_lanes(self) -> int:
        """Lanes where a request would start at once and alone, less the requests waiting for one:
        lanes none of whose ranks runs a request (with adaptive lanes, ranks that run none, each a
        lane of one; a helper's rank counts as idle, as a newcomer takes it back). A rank's further
        places (``requests_per_rank``) do not count: a request there runs beside another."""
        with self._cond:
            busy = {rank_index for rank_index, _ in self._inflight.values()}
            waiting = len(self._pending)
        lanes = [range(r, r + 1) for r in range(self.dims.shard_size)] if self.dims.adaptive else [
            self.dims.lane_ranks(lane) for lane in range(self.dims.num_lanes)
        ]  # fmt: skip
        return max(0, sum(1 for lane in lanes if not busy.intersection(lane)) - waiting)

    def progress(self) -> dict[str, dict]:
        """Request id -> ``{"state": "queued"}`` or ``{"state": "running", "rank": i, "lane": l,
        "lane_size": k, "step": s, "total": n, "helpers": [h, ...]}`` (``rank`` is the lane's leader,
        which answers; ``lane`` its index among the group's lanes of ``lane_size`` ranks;
        ``helpers`` the ranks that join its forwards on a wider lane now, ``lane_widening``)."""
        with self._cond:
            out = {j.request.request_id: {"state": "queued"} for j in self._pending}
            running = {
                j.request.request_id: (i, j.lane, len(j.ranks), j.request.num_inference_steps, list(j.helpers))
                for i, j in self._inflight.values()
                if i == j.ranks.start
            }
            ranks = list(self.ranks)
        for request_id, (rank_index, lane, size, total, helpers) in running.items():
            out[request_id] = {
                "state": "running", "rank": rank_index, "lane": lane, "lane_size": size, "step": 0, "total": total,
                "helpers": helpers,
            }  # fmt: skip
        leaders = sorted({rank_index for rank_index, *_ in running.values()})
        reports = ray.get([ranks[i].progress.remote() for i in leaders], timeout=self.config.request_timeout_s)
        for report in reports:
            for request_id, (step, total) in report.items():
                if request_id in running:
                    out[request_id].update(step=step, total=total)
        return out
