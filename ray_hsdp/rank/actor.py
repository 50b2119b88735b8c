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
from ray_hsdp.deadlines import run_timeout
from ray_hsdp.phases import Phases
from ray_hsdp.rank.start import RankStart
from ray_hsdp.request import GenerationResult, RequestCancelledError
from ray_hsdp.runtime import RankRuntime, SessionFailedError
from ray_hsdp.runtime.core import RequestStoppedError
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

#: How long a sleep waits for a rank's session to end (its last request just answered).
SLEEP_IDLE_WAIT_S = 10.0

#: Faults ``inject_fault`` knows: a rank hung before its next collective, a forward that raises,
#: a split decode that raises.
FAULTS = ("stall", "forward", "decode")


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` built in this process so far: a request of a new shape (or, with
    adaptive lanes, on a new lane size) adds some once; a count that grows with every request means
    recompiles. (dynamo keeps the count in its counters; torch has no public one.)"""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_report(modules: int) -> dict:
    """What ``torch.compile`` did in this process: the modules whose forward it compiles (each
    repeated block), the graphs dynamo built for them, and the graph breaks with their most common
    reasons. A block compiled without breaks is one graph per shape; every break splits it, with
    eager Python between the pieces. (dynamo keeps these in its counters; torch has no public ones.)"""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "modules": modules,
        "graphs": compiled_graphs(),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": dict(breaks.most_common(5)),
    }


def compile_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache in this process so far: graphs found in the cache (``hit``) and
    compiled anew (``miss``). (Inductor keeps them in dynamo's counters; torch has no public ones.)"""
    from torch._dynamo.utils import counters

    return {f"fxgraph_cache_{kind}": int(counters["inductor"][f"fxgraph_cache_{kind}"]) for kind in ("hit", "miss")}


#: How dynamo's counters name a function that reached the recompile limit.
RECOMPILE_LIMIT_REASON = "Dynamo recompile limit exceeded"


def recompile_limit_hits() -> int:
    """Times a compiled function reached ``torch._dynamo.config.recompile_limit`` graphs in this
    process and so runs eagerly from then on, silently but for one warning (dynamo counts it with
    its "unimplemented" reasons; torch has no public count)."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith(RECOMPILE_LIMIT_REASON))


class Rank(RankStart):
    """One rank of a shard group; the group turns this class into a Ray actor.

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
        self.group_id = group_id
        self.rank = rank
        self.config = config
        self.dims = dims
        self.pipeline = None
        self._rendezvous = None  # rank 0's rendezvous store, bound in ``address``
        self.runtime: RankRuntime | None = None
        self.model_path = None
        self.lora_paths: dict = {}
        self.decode_groups = {}  # lane size -> the process group of this rank's lane of that size, for split decodes
        self.tick_group = None  # with tick_exchange "host": the gloo group of the tick's all-gather
        self.phases = Phases(f"rank {rank}")  # where this rank's part of the group's start went
        if spawned_at is not None:
            self.phases.seconds["actor start"] = round(max(0.0, time.time() - spawned_at), 3)
        self.load_s = 0.0
        self.load_peak_rss_bytes = 0
        self.last_request_peak_device_bytes = 0
        self._profile = None
        self._leaving = threading.Event()
        self._residence = None  # where the weights rest while the model sleeps (built at the first sleep)

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this: "(Rank(group=..., rank=...) pid=...)".
        return f"Rank(group={self.group_id}, rank={self.rank})"

    def _loaded(self) -> RankRuntime:
        if self.runtime is None:
            raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
        return self.runtime

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
            try:
                job.get()
            except SessionFailedError:
                raise
            except RequestStoppedError:
                pass  # its lane stopped it: the leader answers why
            except Exception as err:
                # An error only here stopped the lane: the caller learns its cause from this rank.
                logger.warning("Request %r failed on rank %d of its lane: %s", request.request_id, self.rank, err)
                raise
            return None
        deadline = run_timeout(request, self.config)
        if not job.wait(deadline):
            # Interrupting is safe: the tick protocol takes any number of forwards per request.
            error = TimeoutError(f"request {request.request_id!r} missed its deadline of {deadline:g}s")
            runtime.cancel_job(job, error)
        result = job.get()
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
        if self._residence is not None:
            self._residence.wake()  # at once when awake (it looks under its lock: a sleep under way ends first)

    @ray.method(concurrency_group="control")
    def warm_up_done(self) -> dict[str, int]:
        """The warm-up has run: its requests' peak is no user request's (the gauge reads 0 until
        one runs); returns ``tick_stats`` now, what the metrics count from."""
        self.last_request_peak_device_bytes = 0
        return self.tick_stats()

    @ray.method(concurrency_group="control")
    def tick_stats(self) -> dict[str, int]:
        """What this rank did since it loaded (ticks, idle ticks, real forwards, ghost passes,
        batched calls, forwards it ran as a helper of a widened lane), its device memory (allocated
        now, and the peak of its latest request), and with ``compile`` its graphs and the compile
        cache's hits and misses, and how often a compiled block reached its recompile limit."""
        from ray_hsdp.memory import device_allocated_bytes

        runtime = self.runtime
        counts = ("ticks", "idle_ticks", "forwards", "ghosts", "batched", "helped")
        caches = self.pipeline.features.step_caches if self.pipeline is not None else None
        return {
            "rank": self.rank,
            **{name: getattr(runtime, name) if runtime is not None else 0 for name in counts},
            # Forwards run with a request's step cache, and those that reused it.
            "step_cache_forwards": caches.forwards if caches is not None else 0,
            "step_cache_reused": caches.reused if caches is not None else 0,
            "device_allocated_bytes": device_allocated_bytes(self.config.device),
            "last_request_peak_device_bytes": self.last_request_peak_device_bytes,
            "compiled_graphs": compiled_graphs() if self.config.compile else 0,
            "recompile_limit_hits": recompile_limit_hits() if self.config.compile else 0,
            **(compile_cache_counts() if self.config.compile else {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 0}),
            # Exchanges of the split decodes this rank joined (rows lent, keys gathered).
            "decode_exchanges": sum(lane.exchanges for lane in self.pipeline.lane_tiles.values())
            if self.pipeline is not None
            else 0,
        }

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
        return self.runtime.progress() if self.runtime is not None else {}

    @ray.method(concurrency_group="control")
    def memory(self, units: bool = False) -> dict:
        """The memory report of this rank (see ``ShardedPipeline.memory``)."""
        from ray_hsdp.memory import device_allocated_bytes

        report = self.pipeline.memory(units=units) if self.pipeline is not None else {}
        return {
            "rank": self.rank,
            "shard_index": self.rank,
            "lane": self.dims.lane_of(self.rank),
            "device": self.config.device,
            "load_s": round(self.load_s, 3),
            "load_peak_rss_bytes": self.load_peak_rss_bytes,
            "load_bytes_read": sum(s["bytes_read"] for s in self.pipeline.load_stats.values()) if self.pipeline else 0,
            "device_allocated_bytes": device_allocated_bytes(self.config.device),
            "last_request_peak_device_bytes": self.last_request_peak_device_bytes,
            # Once the model slept: the bytes it parks, and those of them on the device now (0 asleep).
            "parked_bytes": self._residence.nbytes if self._residence is not None else 0,
            "asleep": self._residence is not None and self._residence.asleep,
            # The pipeline's tensors on the device now, collected afresh (0 asleep: none was missed).
            "resident_tensor_bytes": self._residence.resident_bytes if self._residence is not None else 0,
            **report,
            **(
                {"compile": compile_report(self.pipeline.compiled_modules)}
                if self.config.compile and self.pipeline
                else {}
            ),
        }

    @ray.method(concurrency_group="control")
    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Fault injection for tests and drills (``ray_hsdp.runtime.faults``), firing once:

        - ``"stall"``: the next tick sleeps ``seconds`` before its collective, as a hung rank
          would, so the others wait in theirs until the collective timeout;
        - ``"forward"``: the next real forward raises half way through, as an out-of-memory would;
        - ``"decode"``: the next split decode raises on this rank before it hands over its tiles.
        """
        from ray_hsdp.runtime.faults import FailNextForward, FailNextSplitDecode, StallNextTick

        runtime = self._loaded()
        if runtime.modules is None:
            raise RuntimeError("only a sharded rank ticks and runs sharded forwards")
        if kind == "stall":
            runtime.exchange = StallNextTick(runtime.exchange, seconds)
        elif kind == "forward":
            runtime.modules = FailNextForward(runtime.modules)
        elif kind == "decode":
            if not self.pipeline.lane_tiles:
                raise RuntimeError("this rank's lane does not split its decodes")
            tiles = self.pipeline.lane_tiles
            self.pipeline.lane_tiles = {size: FailNextSplitDecode(lane) for size, lane in tiles.items()}
        else:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")

    @ray.method(concurrency_group="control")
    def cancel(self, request_id: str) -> bool:
        """Cancels a request: queued, it never starts; running, it stops at the end of its current
        denoising step, without decoding; not here yet (the cancel overtook the offer), it never
        starts. Returns whether the cancel answered a request held here."""
        error = RequestCancelledError(f"request {request_id!r} was cancelled")
        return self.runtime.cancel(request_id, error) if self.runtime is not None else False

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

    def _parked(self):
        if self._residence is None:
            from ray_hsdp.pipeline.residence import pipeline_residence
            from ray_hsdp.pipeline.spill_file import SpillFile

            if self.pipeline is None:
                raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
            spill = None
            if self.config.sleep_level == 2:
                spill = SpillFile(self.config.sleep_folder, f"{self.group_id}-{self.rank}", self.config.device)
            self._residence = pipeline_residence(self.pipeline, pin=self.config.device == "cuda", spill=spill)
        return self._residence

    @ray.method(concurrency_group="residence")
    def host_need(self) -> dict:
        """What this rank's sleep needs of its node: host memory (0 once reserved; level 2: its
        staging buffers) and, at level 2, disk under ``sleep_dir``; with what the node has. The
        group checks a node's ranks together before any pins."""
        from ray_hsdp import distributed
        from ray_hsdp.memory import available_host_bytes
        from ray_hsdp.pipeline.spill_file import SpillFile

        residence = self._parked()
        need = {
            "rank": self.rank,
            "node": distributed.node_ip(),
            "bytes": residence.host_bytes if residence.spill is not None or not residence.allocated else 0,
            "available": available_host_bytes(),
        }
        if residence.spill is not None:
            folder = self.config.sleep_folder
            disk = 0 if residence.allocated else residence.nbytes
            need.update(disk_bytes=disk, disk_free=SpillFile.free_bytes(folder), folder=folder)
        return need

    @ray.method(concurrency_group="residence")
    def reserve_host(self) -> dict:
        """Allocates the host memory a sleep parks this rank's weights in (once: pinning tens of GB
        takes seconds; level 2: writes its file), so that the first sleep is as fast as the next.
        Returns its bytes and the seconds the allocation took."""
        residence = self._parked()
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
        deadline = time.monotonic() + SLEEP_IDLE_WAIT_S
        while self.runtime is not None and (self.runtime.in_session or self.runtime.progress()):
            if time.monotonic() > deadline:
                return {"rank": self.rank, "busy": True}
            time.sleep(0.005)
        return {"rank": self.rank, **self._parked().sleep().as_dict()}

    @ray.method(concurrency_group="residence")
    def wake(self) -> dict:
        """Copies this rank's weights back to the device, components in the order a request
        needs them; returns once all landed (what it moved, as ``sleep``)."""
        return {"rank": self.rank, **self._parked().wake().as_dict()}

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
        if self._residence is not None and self._residence.spill is not None:
            self._residence.spill.remove()
        if self.runtime is None or not self.runtime.in_session:
            distributed.destroy_process_group()
