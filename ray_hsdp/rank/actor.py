"""The rank actor: one process, one device, one shard of the group's pipeline; its execution is
a ``RankRuntime`` (``ray_hsdp.runtime``).

Modules that import torch are imported inside the methods: they run only in the rank's own
process, while the processes that merely hold the class to create ranks (a Serve replica, the app
builder, the job table's replica, a notebook) then start without importing torch (2-3 s each).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

import ray

from ray_hsdp.config.group import MAX_REQUESTS_PER_RANK, RANK_MODULES, GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.phases import Phases
from ray_hsdp.rank.reports import compiled_graphs, memory_report, tick_stats
from ray_hsdp.rank.requests import follow, inject_fault, lead
from ray_hsdp.rank.sleep import RankSleep
from ray_hsdp.rank.start import LoadedRank, RankStart, mend_refusal, where_it_runs
from ray_hsdp.request import GenerationResult, RequestCancelledError
from ray_hsdp.runtime import RankRuntime
from ray_hsdp.variant import RequestVariant

logger = logging.getLogger("ray_hsdp")


#: Sessions (the tick thread) run on the default thread. ``offer`` calls wait on "intake" threads,
#: one per request handed over; ``ping``, ``memory``, ``progress``, ``tick_stats``, ``cancel``,
#: ``help``, ``release``, ``inject_fault`` and ``leave`` answer on "control" while a long request
#: runs. The torch profiler must stop on the thread that started it: "profile". The group's
#: ``watch`` call waits on "watch" for as long as the rank lives. A sleep or a wake copies for
#: seconds on "residence", never holding up a health check's ``ping``.
CONCURRENCY_GROUPS = {
    "control": 2, "intake": MAX_REQUESTS_PER_RANK, "loops": MAX_REQUESTS_PER_RANK, "profile": 1, "watch": 1,
    "residence": 1,
}  # fmt: skip


class Rank:
    """One rank of a shard group; the group turns this class into a Ray actor. Its start is a
    ``RankStart`` (its ``load`` gives the pipeline and runtime the actor keeps, ``loaded``), its
    sleep a ``RankSleep``, its reports functions of them (``ray_hsdp.rank.reports``).

    Args:
        rank: Index in the group (0..S-1), which is also its shard index.
        config: The group's configuration, with device and dtype resolved.
        dims: The pool's mesh arithmetic, built once by the group's creator.
        group_id: The group's id, in this rank's log lines and Ray's prefix of its logs.
        spawned_at: When the group asked Ray for this rank (``time.time()``): the start's "actor
            start" phase (Ray starts a worker process, which imports this class's modules) counts
            from it, on the clocks of the group's and the rank's nodes (one node for a replica's).
    """

    def __init__(
        self, rank: int, config: GroupConfig, dims: ParallelDims, group_id: str = "", spawned_at: float | None = None
    ):
        #: Whether this process had imported what a rank needs before it became one: Ray started it
        #: with ``RAY_preload_python_modules`` (``config.RANK_MODULES``); an idle one saves the imports.
        self.preloaded = all(module in sys.modules for module in RANK_MODULES)
        from ray_hsdp import distributed

        distributed.apply_nccl_env(config.nccl_max_ctas)
        where = f"group={group_id} rank={rank} lane={dims.lane_of(rank)}"
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(name)s {where} %(message)s")
        self.group_id, self.rank, self.config, self.dims = group_id, rank, config, dims
        phases = Phases(f"rank {rank}")  # where this rank's part of the group's start went
        if spawned_at is not None:
            phases.seconds["actor start"] = round(max(0.0, time.time() - spawned_at), 3)
        self.start = RankStart(rank, config, dims, phases)
        self.loaded: LoadedRank | None = None  # the pipeline and its runtime, once ``load`` ran
        self.sleeper = RankSleep(rank, config, f"{group_id}-{rank}")
        self.last_request_peak_device_bytes = 0
        self._profile = None
        self._leaving = threading.Event()

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this: "(Rank(group=..., rank=...) pid=...)".
        return f"Rank(group={self.group_id}, rank={self.rank})"

    def _loaded(self) -> RankRuntime:
        if self.loaded is None:
            raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
        return self.loaded.runtime

    def prepare(self) -> str:
        """Finds the model folder on this node and imports its components' classes, before the
        process group exists (``RankStart.prepare``); returns the folder."""
        return self.start.prepare()

    def address(self) -> tuple[str, int]:
        """This node's IP and the port of the rendezvous store this rank binds there: rank 0's
        answer is the group's rendezvous address (0: a group of one rank has none)."""
        return self.start.address()

    def join(self, master: str, port: int) -> dict:
        """Joins the process group and builds the meshes (``RankStart.join``); a survivor of a
        mended group keeps its shards.

        Returns:
            Where this rank runs: rank, node id and IP, pid, device.
        """
        self.start.join(master, port, survivor=self.loaded)
        return where_it_runs(self.rank, self.config, self.preloaded)

    def load(self) -> dict:
        """Loads the pipeline, its sharded components slice by slice, and builds the runtime
        (``RankStart.load``); returns the memory report, with the pipeline's facts under
        ``pipeline``, the start's phases and why a lost rank could not be replaced alone.

        The report adds ``load_s`` and ``load_peak_rss_bytes``: the most host memory this process
        held above its level before loading, sampled while loading.
        """
        self.loaded = self.start.load()
        return {
            **self.memory(),
            "pipeline": self.loaded.pipeline.facts,
            "start_phases_s": dict(self.start.phases.seconds),
            "mend_refusal": mend_refusal(self.config, self.dims, self.start.model_path),
        }

    @ray.method(concurrency_group="intake")
    def offer(self, variant: RequestVariant) -> GenerationResult | None:
        """Hands a request to this rank's running or next session and waits for its result.

        Runs on the intake threads, so the group can hand over work while a session computes.

        Args:
            variant: The request and its choices, under the ticket the group gave it (the same on
                every rank of the lane that runs it).

        Returns:
            The result on a lane's leader; ``None`` on the other ranks of a lane, which only
            help (the leader decodes and answers, and applies the deadline for the whole lane).

        Raises:
            SessionFailedError: This rank's session failed (its group must be torn down).
            TimeoutError: The request missed its deadline; it is interrupted at its next step.
            Exception: The request's own error; on a rank that is not the leader, the error that
                made it stop its lane.
        """
        runtime = self._loaded()
        request = variant.request
        self._awake()
        # A compile on this rank while the request ran (its own new shape, or a neighbour's) held
        # every forward of it back: the run is marked, so the group learns no time from it.
        graphs_before = compiled_graphs() if self.config.compile else 0
        job = runtime.submit(variant, variant.ticket)
        if not job.leads(self.rank):
            return follow(job, request.request_id, self.rank)
        result = lead(runtime, job, request, self.config)
        self.last_request_peak_device_bytes = result.peak_device_bytes
        if self.config.compile and compiled_graphs() > graphs_before:
            result = dataclasses.replace(result, compiled=True)
        return result

    @ray.method(concurrency_group="loops")
    def denoised(self, request_id: str) -> bool:
        """Returns once ``request_id``'s denoising loop ended on this rank (``RankRuntime.loop_end``):
        True, or False after ``request_timeout_s``."""
        return self._loaded().loop_end(request_id).wait(self.config.request_timeout_s)

    def session(self) -> dict:
        """Runs the requests handed over, in lock step with the other ranks, until all are idle
        (``RankRuntime.session`` on this actor's default thread, the only one that issues
        collectives).

        Returns:
            How many requests this session started.
        """
        self._awake()
        return {"rank": self.rank, "requests": self._loaded().session()}

    def _awake(self) -> None:
        """A group woken by its caller never gets here asleep. One used directly wakes at its first
        request: every rank's session and the request's own thread wake their rank first (once:
        the other waits for it), since every rank joins every forward's gathers."""
        self.sleeper.wake_if_built()

    @ray.method(concurrency_group="control")
    def warm_up_done(self) -> dict[str, int]:
        """The warm-up has run: its requests' peak is no user request's (the gauge reads 0 until
        one runs); returns ``tick_stats`` now, what the metrics count from."""
        self.last_request_peak_device_bytes = 0
        return self.tick_stats()

    @ray.method(concurrency_group="control")
    def tick_stats(self) -> dict[str, int]:
        """What this rank did since it loaded, its device memory and compile counts
        (``ray_hsdp.rank.reports.tick_stats``)."""
        return tick_stats(self.rank, self.config, self.loaded, self.last_request_peak_device_bytes)

    @ray.method(concurrency_group="profile")
    def start_profile(self, trace_dir: str | None = None) -> None:
        """Starts recording where this rank's time goes (see ``ray_hsdp.rank.profiling``)."""
        from ray_hsdp.rank.profiling import RankProfile

        self._profile = RankProfile(self.config.device, self._loaded(), trace_dir)
        self._profile.start()

    @ray.method(concurrency_group="profile")
    def stop_profile(self) -> dict:
        """Ends the recording started by ``start_profile``; returns its summary."""
        if self._profile is None:
            raise RuntimeError("start_profile() was not called")
        profile, self._profile = self._profile, None
        return profile.stop(self.rank)

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[str, tuple[int, int]]:
        """Request id -> (denoising steps done, steps in all) of the requests running here."""
        return self.loaded.runtime.progress() if self.loaded is not None else {}

    @ray.method(concurrency_group="control")
    def memory(self, units: bool = False) -> dict:
        """The memory report of this rank (``ray_hsdp.rank.reports.memory_report``; see
        ``ShardedPipeline.memory``)."""
        peak = {"last_request_peak_device_bytes": self.last_request_peak_device_bytes}
        return memory_report(self.rank, self.config, self.dims, self.loaded, {**peak, **self.sleeper.report()}, units)

    @ray.method(concurrency_group="control")
    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Fault injection for tests and drills (``ray_hsdp.runtime.faults``), firing once:

        - ``"stall"``: the next tick sleeps ``seconds`` before its collective, as a hung rank
          would, so the others wait in theirs until the collective timeout;
        - ``"forward"``: the next real forward raises half way through, as an out-of-memory would;
        - ``"decode"``: the next split decode raises on this rank before it hands over its tiles.
        """
        self._loaded()  # raises on a rank with no pipeline loaded
        inject_fault(self.loaded, kind, seconds)

    @ray.method(concurrency_group="control")
    def cancel(self, request_id: str) -> bool:
        """Cancels a request: queued, it never starts; running, it stops at the end of its current
        denoising step, without decoding; not here yet (the cancel overtook the offer), it never
        starts. Returns whether the cancel answered a request held here."""
        error = RequestCancelledError(f"request {request_id!r} was cancelled")
        return self.loaded.runtime.cancel(request_id, error) if self.loaded is not None else False

    @ray.method(concurrency_group="control")
    def help(self, variant: RequestVariant, ticket: int, source: int) -> None:
        """Helps a request of another lane on the wider lane ``ticket`` (lane widening) until
        ``release``: this rank joins the request's forwards there, their inputs from the lane's
        rank ``source`` (``RankRuntime.help``). Returns at once."""
        self._loaded().help(variant, ticket, source)

    @ray.method(concurrency_group="control")
    def release(self, ticket: int) -> None:
        """Ends this rank's help of the wider lane ``ticket`` at its next tick."""
        self._loaded().release(ticket)

    @ray.method(concurrency_group="residence")
    def host_need(self) -> dict:
        """What this rank's sleep needs of its node: host memory (0 once reserved; level 2: its
        staging buffers) and, at level 2, disk under ``sleep_dir``; with what the node has. The
        group checks a node's ranks together before any pins."""
        return self.sleeper.host_need(self.loaded)

    @ray.method(concurrency_group="residence")
    def reserve_host(self) -> dict:
        """Allocates the host memory a sleep parks this rank's weights in (once: pinning tens of GB
        takes seconds; level 2: writes its file), so that the first sleep is as fast as the next.
        Returns its bytes and the seconds the allocation took."""
        residence = self.sleeper.parked(self.loaded)
        return {"rank": self.rank, "bytes": residence.nbytes, "allocate_s": round(residence.allocate(), 3)}

    @ray.method(concurrency_group="residence")
    def sleep(self) -> dict:
        """Parks this rank's weights in host memory and gives their device memory back
        (``ray_hsdp.pipeline.residence``), once the rank holds no request: a session that its last
        request is ending is waited for (``SLEEP_IDLE_WAIT_S``).

        Returns:
            The bytes moved, the seconds, and the device's free memory before and after; or
            ``busy``: the rank still held a request, and nothing was moved.
        """
        return self.sleeper.sleep(self.loaded)

    @ray.method(concurrency_group="residence")
    def wake(self) -> dict:
        """Copies this rank's weights back to the device, components in the order a request
        needs them; returns once all landed (what it moved, as ``sleep``)."""
        return {"rank": self.rank, **self.sleeper.parked(self.loaded).wake().as_dict()}

    @ray.method(concurrency_group="control")
    def device_free(self) -> int:
        """Free bytes of this rank's device now, as the driver counts them (every process's use
        counted: a GPU share's other models' too); on a CPU rank, the host's available memory."""
        from ray_hsdp.memory import free_bytes

        return free_bytes(self.config.device)

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        """Answers with the rank index; the group's health check."""
        return self.rank

    @ray.method(concurrency_group="watch")
    def watch(self) -> int:
        """Returns only when the rank leaves. The group keeps this call open, so that Ray tells it
        at once when the rank's process dies, whether the rank holds work or not."""
        self._leaving.wait()
        return self.rank

    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        """A peer of this rank died and the group replaces it alone: on NCCL this rank's
        communicators are aborted, so that a session in a collective with the dead peer fails now
        (over gloo the dead peer's closed socket fails it). The group waits for the session's end,
        then calls ``join`` again with the new rank."""
        from ray_hsdp import distributed

        if self.config.device == "cuda":
            distributed.abort_process_groups()

    @ray.method(concurrency_group="control")
    def leave(self) -> None:
        """Leaves the group; the actor is killed right after.

        On "control", so that it answers at once even while a session runs on the default thread.
        The process group is destroyed only when no session runs: a session's thread may sit in a
        collective, and the kill that follows ends it, with the process.
        """
        from ray_hsdp import distributed

        self._leaving.set()
        self.sleeper.remove_spill()
        if self.loaded is None or not self.loaded.runtime.in_session:
            distributed.destroy_process_group()
