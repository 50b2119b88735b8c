"""One shard group: S rank actors on one placement group, a queue, waves of requests, teardown.

Plain Python, not Serve code: a notebook or a script can own a group directly, and the Serve
deployment wraps one group per replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_hsdp.config import GroupConfig
from ray_hsdp.rank import CONCURRENCY_GROUPS, Rank
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.topology import PLACEMENT_STRATEGY, ParallelDims

logger = logging.getLogger("ray_hsdp")

_RENDEZVOUS_TRIES = 3


class IncompatibleWaveError(ValueError):
    """A wave whose requests would issue different collectives, which would hang the group."""


class GroupFailedError(RuntimeError):
    """The group can no longer run requests (a rank died, missed its deadline, or the group shut down)."""


def check_wave(requests: Sequence[GenerationRequest], capacity: int) -> None:
    """Refuses a wave that would hang or that does not fit the group.

    Raises:
        IncompatibleWaveError: The wave is empty, larger than ``capacity``, or its requests differ
            in step count, guidance on/off, size or frame count.
    """
    if not requests:
        raise IncompatibleWaveError("a wave needs at least one request")
    if len(requests) > capacity:
        raise IncompatibleWaveError(f"a wave holds at most {capacity} requests in this mode, got {len(requests)}")
    keys = {r.wave_key for r in requests}
    if len(keys) > 1:
        raise IncompatibleWaveError(
            "requests of one wave must share num_inference_steps, guidance on/off, width, height and num_frames "
            f"(ranks in lock step would otherwise issue different collectives and hang); got {sorted(keys)}"
        )


def pick_wave(pending: Sequence[GenerationRequest], capacity: int) -> list[int]:
    """Indices of the next wave: the oldest request and the oldest others that share its wave key."""
    if not pending:
        return []
    key = pending[0].wave_key
    return [i for i, r in enumerate(pending) if r.wave_key == key][:capacity]


@dataclass
class _Job:
    request: GenerationRequest
    future: Future
    enqueued: float


class ShardGroup:
    """S ranks that together hold one copy of the pipeline and run requests in waves.

    Args:
        config: Group configuration.
        placement_group: A placement group of S bundles to place the ranks in (a Serve replica's
            own); when ``None`` the group creates one and removes it at shutdown.

    Use ``start()`` (or a ``with`` block), then ``generate`` (blocking) or ``submit`` (a future).
    """

    def __init__(self, config: GroupConfig, placement_group: PlacementGroup | None = None):
        self.config = config
        self.dims = ParallelDims(config.replicate_size, config.resolved_shard_size)
        self._pg = placement_group
        self._owns_pg = placement_group is None
        self.ranks: list = []
        self.placement: list[dict] = []
        self._load_reports: list[dict] = []
        self._pending: list[_Job] = []
        self._cond = threading.Condition()
        self._wave_lock = threading.Lock()
        self._scheduler: threading.Thread | None = None
        self._failure: str | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ShardGroup:
        """Places the ranks, forms the process group, loads and shards the pipeline, starts intake."""
        if not ray.is_initialized():
            ray.init()
        self.config = self.config.resolve_device(ray.cluster_resources().get("GPU", 0) > 0)
        try:
            if self._pg is None:
                self._pg = placement_group(
                    self.dims.bundles(self.config.device, self.config.cpus_per_rank), strategy=PLACEMENT_STRATEGY
                )
            if not self._pg.wait(timeout_seconds=self.config.rendezvous_timeout_s):
                raise GroupFailedError(
                    f"could not place {self.dims.shard_size} ranks of "
                    f"{self.dims.bundles(self.config.device, self.config.cpus_per_rank)[0]} on one node within "
                    f"{self.config.rendezvous_timeout_s:.0f}s (cluster resources: {ray.available_resources()})"
                )
            self._spawn_and_join()
            self._load_reports = ray.get([r.load.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._scheduler = threading.Thread(target=self._schedule, name="ray_hsdp-scheduler", daemon=True)
        self._scheduler.start()
        logger.info(
            "Shard group ready: %d ranks on %s, mode=%s",
            self.dims.shard_size,
            sorted({p["node_ip"] for p in self.placement}),
            self.config.mode,
        )
        return self

    def _spawn_and_join(self) -> None:
        bundle = self.dims.bundles(self.config.device, self.config.cpus_per_rank)[0]
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Rank)
        for attempt in range(1, _RENDEZVOUS_TRIES + 1):
            self.ranks = [
                actor.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=i
                    ),
                ).remote(i, self.config)
                for i in range(self.dims.shard_size)
            ]
            ray.get([r.prepare.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
            master, port = ray.get(self.ranks[0].address.remote(), timeout=self.config.rendezvous_timeout_s)
            try:
                self.placement = ray.get(
                    [r.join.remote(master, port) for r in self.ranks], timeout=self.config.rendezvous_timeout_s
                )
                return
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as err:
                # The port was free when rank 0 picked it; another process may have taken it since.
                if "address already in use" not in str(err).lower() or attempt == _RENDEZVOUS_TRIES:
                    raise
                logger.warning("Rendezvous port %d taken (try %d), retrying on a new port", port, attempt)
                self._kill_ranks()

    def _kill_ranks(self) -> None:
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.ranks = []

    def shutdown(self) -> None:
        """Fails queued requests, destroys the process group, kills the ranks, removes an owned
        placement group. Safe to call more than once."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for job in pending:
            job.future.set_exception(GroupFailedError("the shard group was shut down before the request ran"))
        if self._scheduler is not None and self._scheduler is not threading.current_thread():
            self._scheduler.join(timeout=self.config.request_timeout_s)
        if self.ranks:
            try:
                ray.get([r.leave.remote() for r in self.ranks], timeout=30)
            except Exception as err:  # noqa: BLE001 - a dead rank cannot leave; it is killed below anyway
                logger.warning("Ranks did not leave cleanly: %s", err)
            self._kill_ranks()
        if self._pg is not None and self._owns_pg:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> ShardGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests one wave runs at once: S in ``batch`` mode, 1 in ``replicated`` mode."""
        return self.dims.shard_size if self.config.mode == "batch" else 1

    def submit(self, request: GenerationRequest) -> Future:
        """Queues a request; the future resolves to its ``GenerationResult``.

        Raises:
            GroupFailedError: The group is shut down or broken.
        """
        future: Future = Future()
        with self._cond:
            if self._closed or self._failure:
                raise GroupFailedError(self._failure or "the shard group is shut down")
            self._pending.append(_Job(request, future, time.monotonic()))
            self._cond.notify_all()
        return future

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Runs requests through the queue and waits for all of them, in the order given."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def run_wave(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Runs one wave now, bypassing the queue.

        In ``batch`` mode rank i runs request i; ranks without a request repeat the first one and
        their results are dropped. In ``replicated`` mode every rank runs the one request.

        Raises:
            IncompatibleWaveError: The wave would hang the group (see ``check_wave``).
            GroupFailedError: A rank died or missed the deadline; the group is then broken.
        """
        check_wave(requests, self.capacity)
        if self._failure:
            raise GroupFailedError(self._failure)
        slots = list(requests) + [requests[0]] * (self.dims.shard_size - len(requests))
        with self._wave_lock:
            refs = [rank.run.remote(slot) for rank, slot in zip(self.ranks, slots)]
            try:
                results = ray.get(refs, timeout=self.config.request_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                self._failure = f"shard group failed: {type(err).__name__}: {err}"
                raise GroupFailedError(self._failure) from err
        return results[: len(requests)]

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                # Wait briefly for companions so that a wave fills all ranks.
                deadline = self._pending[0].enqueued + self.config.batch_wait_s
                while not self._closed:
                    indices = pick_wave([j.request for j in self._pending], self.capacity)
                    left = deadline - time.monotonic()
                    if len(indices) == self.capacity or left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                jobs = [self._pending[i] for i in indices]
                self._pending = [j for i, j in enumerate(self._pending) if i not in set(indices)]
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            try:
                results = self.run_wave([j.request for j in jobs])
            except Exception as err:  # noqa: BLE001 - every error goes to the callers of the wave
                for job in jobs:
                    job.future.set_exception(err)
                if isinstance(err, GroupFailedError):
                    self._fail_pending(err)
                continue
            for job, result in zip(jobs, results):
                job.future.set_result(result)

    def _fail_pending(self, err: Exception) -> None:
        with self._cond:
            pending, self._pending = self._pending, []
        for job in pending:
            job.future.set_exception(err)

    # ---- inspection ------------------------------------------------------------------------

    def memory(self, units: bool = False) -> list[dict]:
        """Each rank's memory report merged with where it runs."""
        reports = ray.get([r.memory.remote(units) for r in self.ranks], timeout=self.config.request_timeout_s)
        return [{**place, **report} for place, report in zip(self.placement, reports)]

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Pings every rank with a deadline.

        Raises:
            GroupFailedError: The group is broken, or a rank did not answer in time.
        """
        if self._failure:
            raise GroupFailedError(self._failure)
        try:
            ray.get([r.ping.remote() for r in self.ranks], timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            self._failure = f"shard group failed its health check: {type(err).__name__}: {err}"
            raise GroupFailedError(self._failure) from err

    def describe(self) -> dict:
        """Topology of this group: sizes, mode, device, where each rank runs."""
        return {
            "replicate_size": self.dims.replicate_size,
            "shard_size": self.dims.shard_size,
            "mode": self.config.mode,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "model": self.config.served_model_name,
            "ranks": self.placement,
        }
