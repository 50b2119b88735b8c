"""What a replica exports through Ray Serve's metrics API, beside Serve's own per-route metrics.

Ray's Prometheus endpoint serves them (each node's ``metrics_export_port``) with the prefix
``ray_`` and Serve's tags (application, deployment, replica); counters get ``_total``. Request
metrics come from the group's request records; rank, group and job metrics from a poll.
"""

from __future__ import annotations

from ray.serve import metrics

from ray_hsdp.group import RequestRecord

#: Seconds: from 10 ms to 10 minutes, for queue waits and denoising steps alike.
_SECONDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]

#: Every metric ray_hsdp exports, as Prometheus names it: name -> (type, labels beyond Serve's, meaning).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "ray_hsdp_queue_seconds": ("histogram", ("model", "status"), "time a request waited in its group's queue"),
    "ray_hsdp_step_seconds": ("histogram", ("model",), "mean time per denoising step of each finished request"),
    "ray_hsdp_lane_size": ("histogram", ("model",), "ranks of the lane each request that ran was given"),
    "ray_hsdp_requests_total": ("counter", ("model", "status"), "answered requests: ok, error, cancelled, failed"),
    "ray_hsdp_queue_depth": ("gauge", ("model",), "requests waiting in the group's queue"),
    "ray_hsdp_running_requests": ("gauge", ("model",), "requests the group's lanes run now"),
    "ray_hsdp_ticks_total": ("counter", ("model", "rank"), "ticks of the rank's lock step"),
    "ray_hsdp_ghost_passes_total": ("counter", ("model", "rank"), "forwards the rank only took part in (no compute)"),
    "ray_hsdp_idle_ticks_total": ("counter", ("model", "rank"), "ticks at which the rank had nothing to do"),
    "ray_hsdp_forwards_total": ("counter", ("model", "rank"), "real forwards the rank ran"),
    "ray_hsdp_step_cache_reused_total": (
        "counter",
        ("model", "rank"),
        "forwards of requests with a step cache that reused it instead of running every block",
    ),
    "ray_hsdp_compiled_graphs_total": (
        "counter",
        ("model", "rank"),
        "graphs compile built on the rank since its warm-up (growing while serving: unwarmed shapes)",
    ),
    "ray_hsdp_recompile_limit_hits_total": (
        "counter",
        ("model", "rank"),
        "compiled functions that reached torch's recompile limit and run eagerly since",
    ),
    "ray_hsdp_device_allocated_bytes": ("gauge", ("model", "rank"), "GPU memory allocated on the rank now"),
    "ray_hsdp_device_peak_bytes": ("gauge", ("model", "rank"), "peak GPU memory of the rank's latest request"),
    "ray_hsdp_group_failures_total": ("counter", ("model",), "shard group failures (each starts a rebuild)"),
    "ray_hsdp_group_rebuilds_total": ("counter", ("model",), "shard groups rebuilt after a failure"),
    "ray_hsdp_video_jobs": ("gauge", ("status",), "video jobs in the job store, by status"),
    "ray_hsdp_group_state": ("gauge", ("model", "state"), "1 for the state the replica's group is in, else 0"),
    "ray_hsdp_wakes_total": ("counter", ("model",), "wakes of the model's group on its GPU share"),
    "ray_hsdp_wake_seconds": (
        "histogram",
        ("model",),
        "seconds a request waited for its sleeping model to wake (the sleeps that made room, then its copy back)",
    ),
    "ray_hsdp_sleeping_bytes": (
        "gauge",
        ("model", "node"),
        "bytes of the model's weights parked while it sleeps, on its GPU share's node (0 awake): host memory at "
        "sleep_level 1, disk at 2",
    ),
    "ray_hsdp_group_load": (
        "gauge",
        ("model",),
        "requests the group holds, queued or running, video jobs included (what autoscaling sizes the pool on)",
    ),
}

#: A replica's group: building in the replica's constructor, serving, asleep or waking on its GPU
#: share, being rebuilt after a failure, failed for good (Serve replaces the replica), or draining
#: before the replica stops.
GROUP_STATES = ("starting", "serving", "sleeping", "waking", "rebuilding", "failed", "draining")

#: Rank counters: Prometheus name -> the field of ``Rank.tick_stats``.
_RANK_COUNTERS = {
    "ray_hsdp_ticks_total": "ticks",
    "ray_hsdp_ghost_passes_total": "ghosts",
    "ray_hsdp_idle_ticks_total": "idle_ticks",
    "ray_hsdp_forwards_total": "forwards",
    "ray_hsdp_step_cache_reused_total": "step_cache_reused",
    "ray_hsdp_compiled_graphs_total": "compiled_graphs",
    "ray_hsdp_recompile_limit_hits_total": "recompile_limit_hits",
}
_RANK_GAUGES = {
    "ray_hsdp_device_allocated_bytes": "device_allocated_bytes",
    "ray_hsdp_device_peak_bytes": "last_request_peak_device_bytes",
}


def _exported(name: str) -> str:
    """The name to register: Ray adds the ``ray_`` prefix, and ``_total`` to counters."""
    return name.removeprefix("ray_").removesuffix("_total")


#: Histograms that do not count seconds: their bucket bounds.
_BOUNDARIES = {"ray_hsdp_lane_size": [1, 2, 4, 8, 16]}


def _make(name: str):
    kind, labels, description = METRICS[name]
    if kind == "histogram":
        bounds = _BOUNDARIES.get(name, _SECONDS)
        return metrics.Histogram(_exported(name), description=description, boundaries=bounds, tag_keys=labels)
    cls = metrics.Counter if kind == "counter" else metrics.Gauge
    return cls(_exported(name), description=description, tag_keys=labels)


class ReplicaMetrics:
    """One replica's metrics.

    Args:
        model: The served model name (a label of every metric but the job table's).
    """

    def __init__(self, model: str):
        self.model = model
        self._m = {name: _make(name) for name in METRICS}
        self._seen: dict[tuple[str, str, int], int] = {}  # (group, counter, rank) -> last count
        self._failures = 0
        self._rebuilds = 0

    def request_done(self, record: RequestRecord) -> None:
        """A group listener: one call per answered request."""
        tags = {"model": self.model, "status": record.status}
        self._m["ray_hsdp_requests_total"].inc(1, tags=tags)
        self._m["ray_hsdp_queue_seconds"].observe(record.queued_s, tags=tags)
        if record.step_s is not None and not record.compiled:  # a compile's steps are not the pace
            self._m["ray_hsdp_step_seconds"].observe(record.step_s, tags={"model": self.model})
        if record.lane_size is not None:
            self._m["ray_hsdp_lane_size"].observe(record.lane_size, tags={"model": self.model})

    def group(self, group_id: str, queued: int, running: int, ranks: list[dict], warm: list[dict]) -> None:
        """The group's queue and each rank's counters and memory (``Rank.tick_stats``), counted from
        ``warm``: the ranks' counts once the group's warm-up ran (``ShardGroup.warm_up_stats``)."""
        self._m["ray_hsdp_queue_depth"].set(queued, tags={"model": self.model})
        self._m["ray_hsdp_running_requests"].set(running, tags={"model": self.model})
        start = {stats["rank"]: stats for stats in warm}
        for stats in ranks:
            tags = {"model": self.model, "rank": str(stats["rank"])}
            for name, field in _RANK_COUNTERS.items():
                key = (group_id, name, stats["rank"])
                # Counts start at the warm-up's in a rebuilt group, whose id differs.
                delta = stats[field] - self._seen.get(key, start.get(stats["rank"], {}).get(field, 0))
                self._seen[key] = stats[field]
                if delta > 0:
                    self._m[name].inc(delta, tags=tags)
            for name, field in _RANK_GAUGES.items():
                self._m[name].set(stats[field], tags=tags)

    def state(self, state: str, load: int) -> None:
        """The group's state (one of ``GROUP_STATES``) and its load."""
        for name in GROUP_STATES:
            self._m["ray_hsdp_group_state"].set(int(name == state), tags={"model": self.model, "state": name})
        self._m["ray_hsdp_group_load"].set(load, tags={"model": self.model})

    def keeper(self, failures: int, rebuilds: int) -> None:
        """The replica's group failures and rebuilds so far (the counters appear at the first one)."""
        tags = {"model": self.model}
        if failures > self._failures:
            self._m["ray_hsdp_group_failures_total"].inc(failures - self._failures, tags=tags)
            self._failures = failures
        if rebuilds > self._rebuilds:
            self._m["ray_hsdp_group_rebuilds_total"].inc(rebuilds - self._rebuilds, tags=tags)
            self._rebuilds = rebuilds

    def woke(self, seconds: float) -> None:
        """The model's group woke for a request of this replica, in ``seconds``."""
        self._m["ray_hsdp_wakes_total"].inc(1, tags={"model": self.model})
        self._m["ray_hsdp_wake_seconds"].observe(seconds, tags={"model": self.model})

    def sleeping(self, node: str, parked_bytes: int) -> None:
        """The host memory the model's weights take while it sleeps (0 awake), on ``node``."""
        self._m["ray_hsdp_sleeping_bytes"].set(parked_bytes, tags={"model": self.model, "node": node})

    def video_jobs(self, counts: dict[str, int]) -> None:
        """Video jobs by status, from the job table."""
        for status in ("queued", "in_progress", "completed", "failed"):
            self._m["ray_hsdp_video_jobs"].set(counts.get(status, 0), tags={"status": status})
