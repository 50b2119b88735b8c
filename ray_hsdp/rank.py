"""The rank actor: one process, one device, one shard of the group's pipeline."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import ray

from ray_hsdp import distributed
from ray_hsdp.config import GroupConfig
from ray_hsdp.memory import RssSampler, device_allocated_bytes
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.topology import ParallelDims

logger = logging.getLogger("ray_hsdp")


#: Sessions (the compute) run on the default thread. ``offer`` calls wait on "intake" threads, one
#: per request handed over; ``ping``, ``memory`` and ``progress`` answer on "control" while a
#: long request runs. The torch profiler must stop on the thread that started it: "profile".
CONCURRENCY_GROUPS = {"control": 2, "intake": 8, "profile": 1}


@dataclass
class _Job:
    request: GenerationRequest
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False


class Rank:
    """One rank of a shard group; the group turns this class into a Ray actor.

    Args:
        rank: Index in the group (0..S-1), which is also its shard index.
        config: The group's configuration, with device and dtype resolved.
    """

    def __init__(self, rank: int, config: GroupConfig):
        distributed.apply_nccl_env()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s rank=" + str(rank) + " %(message)s")
        self.rank = rank
        self.config = config
        self.dims = ParallelDims(config.replicate_size, config.resolved_shard_size)
        self.pipeline = None
        self.model_path = None
        self.load_s = 0.0
        self.load_peak_rss_bytes = 0
        self.last_request_peak_device_bytes = 0
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._progress: dict[str, tuple[int, int]] = {}
        self._profile = None

    def prepare(self) -> str:
        """Finds the model folder on this node (writing the embedded tiny model if needed) and
        imports the classes of its components.

        Runs before the process group exists: model writers save only on distributed rank 0.
        """
        from ray_hsdp.loading import import_component_classes, resolve_model_path

        self.model_path = resolve_model_path(self.config.model)
        # Code first, weights later: the load's memory report then counts weights only.
        import_component_classes(self.model_path)
        return str(self.model_path)

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's answer is the group's rendezvous address."""
        ip = distributed.node_ip()
        return ip, distributed.free_port(ip)

    def join(self, master: str, port: int) -> dict:
        """Joins the process group and builds the mesh.

        Returns:
            Where this rank runs: rank, node id and IP, pid, device.
        """
        if self.dims.shard_size > 1:
            distributed.init_process_group(
                self.config.device, master, port, self.rank, self.dims.shard_size, self.config.collective_timeout_s
            )
            self.mesh = distributed.build_mesh(self.config.device, self.dims.group_mesh_shape)
        else:
            self.mesh = None
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "namespace": ray.get_runtime_context().namespace,
            "node_ip": distributed.node_ip(),
            "pid": os.getpid(),
            "device": self.config.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def load(self) -> dict:
        """Loads the pipeline, its sharded components slice by slice; returns the memory report.

        The report adds ``load_s`` and ``load_peak_rss_bytes``: the most host memory this process
        held above its level before loading, sampled while loading.
        """
        from ray_hsdp.sharded_pipeline import ShardedPipeline

        if self.model_path is None:
            raise RuntimeError("prepare() must run before load()")
        if self.rank == 0:
            logger.info(
                "HSDP Inference: replicate_size=%d, shard_size=%d", self.dims.replicate_size, self.dims.shard_size
            )
        with RssSampler() as rss:
            start = time.perf_counter()
            self.pipeline = ShardedPipeline.load(
                self.model_path,
                dtype=self.config.dtype,
                device=self.config.device,
                rank=self.rank,
                mesh=self.mesh,
                shard_components=self.config.shard_components,
                min_num_params=self.config.min_num_params,
                reshard_after_forward=self.config.reshard_after_forward,
                forward_prefetch=self.config.forward_prefetch,
                max_forward_batch=self.config.max_forward_batch,
                allow_pickle=self.config.allow_pickle,
            )
            self.pipeline.set_request_slots(self.config.requests_per_rank, self.config.shard_components)
            self.pipeline.request_streams = self.config.request_streams
            self.load_s = time.perf_counter() - start
        self.load_peak_rss_bytes = rss.peak_above_start
        return self.memory()

    @ray.method(concurrency_group="intake")
    def offer(self, request: GenerationRequest) -> GenerationResult:
        """Hands a request to this rank's running or next session and waits for its result.

        Runs on the intake threads, so the group can hand over work while a session computes.
        """
        job = _Job(request)
        self._inbox.put(job)
        deadline = request.timeout_s or self.config.request_timeout_s
        if not job.done.wait(deadline):
            # Interrupting is safe: the tick protocol takes any number of forwards per request.
            job.cancelled = True
            raise TimeoutError(f"request {request.request_id!r} missed its deadline of {deadline:g}s")
        if job.error is not None:
            raise job.error
        return job.result

    def session(self) -> dict:
        """Runs requests from the inbox, in lock step with the other ranks, until all are idle.

        Each request runs in a thread of its own (up to ``requests_per_rank`` at once); this
        thread is the tick thread: it alone issues collectives, serving the requests' sharded
        forwards at ticks and ghost-passing the other ranks' ones. The session ends at the
        first tick where every rank is idle, a decision all ranks take from the same gathered list.

        Returns:
            How many requests this session started.
        """
        if self.pipeline is None:
            raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
        ticks = self.pipeline.ticks
        started = 0
        running: list[threading.Thread] = []
        while True:
            running = [t for t in running if t.is_alive()]
            while len(running) < self.config.requests_per_rank:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if ticks is not None:
                    # Before the thread starts: the next tick must already wait for its first call.
                    ticks.expect_calls(True)
                thread = threading.Thread(target=self._run_job, args=(job,), name=f"request-{started}", daemon=True)
                thread.start()
                running.append(thread)
                started += 1
            if ticks is not None:
                if ticks.tick(busy=bool(running)):
                    break
            elif running:
                running[0].join(timeout=0.01)
            elif self._inbox.empty():
                break
        return {"rank": self.rank, "requests": started}

    def _run_job(self, job: _Job) -> None:
        request_id = job.request.request_id
        self._progress[request_id] = (0, job.request.num_inference_steps)

        profile = self._profile
        ticks = self.pipeline.ticks
        expecting = [ticks is not None]

        def done_calling() -> None:
            if expecting[0]:
                expecting[0] = False
                ticks.expect_calls(False)

        def on_step(done: int, total: int) -> bool:
            self._progress[request_id] = (done, total)
            if profile is not None:
                profile.request_event(request_id, "step")
            if done >= total or job.cancelled:
                done_calling()  # decoding (or interrupted) from here: no more sharded forwards
            return job.cancelled

        if profile is not None:
            profile.request_event(request_id, "start")
        try:
            if job.cancelled:
                raise TimeoutError(f"request {request_id!r} missed its deadline before it started")
            job.result = self.pipeline.run(job.request, on_step=on_step)
            self.last_request_peak_device_bytes = job.result.peak_device_bytes
        except Exception as err:  # noqa: BLE001 - the error belongs to the request's caller
            job.error = err
        finally:
            done_calling()
            if profile is not None:
                profile.request_event(request_id, "end")
            self._progress.pop(request_id, None)
            job.done.set()

    @ray.method(concurrency_group="control")
    def tick_stats(self) -> dict[str, int]:
        """Ticks, ghost passes and batched calls this rank has run since it loaded."""
        ticks = self.pipeline.ticks if self.pipeline is not None else None
        counts = {"ticks": ticks.ticks, "ghosts": ticks.ghosts, "batched": ticks.batched} if ticks else {}
        return {"rank": self.rank, "ticks": 0, "ghosts": 0, "batched": 0, **counts}

    @ray.method(concurrency_group="profile")
    def start_profile(self, trace_dir: str | None = None) -> None:
        """Starts recording where this rank's time goes (see ``ray_hsdp.profiling``)."""
        from ray_hsdp.profiling import RankProfile

        if self.pipeline is None:
            raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
        self._profile = RankProfile(self.config.device, self.pipeline.ticks, trace_dir)
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
        """Request id -> (denoising steps done, steps in all) of the request running here."""
        return dict(self._progress)

    @ray.method(concurrency_group="control")
    def memory(self, units: bool = False) -> dict:
        """The memory report of this rank (see ``ShardedPipeline.memory``)."""
        report = self.pipeline.memory(units=units) if self.pipeline is not None else {}
        return {
            "rank": self.rank,
            "shard_index": self.rank,
            "device": self.config.device,
            "load_s": round(self.load_s, 3),
            "load_peak_rss_bytes": self.load_peak_rss_bytes,
            "load_bytes_read": sum(s["bytes_read"] for s in self.pipeline.load_stats.values()) if self.pipeline else 0,
            "device_allocated_bytes": device_allocated_bytes(self.config.device),
            "last_request_peak_device_bytes": self.last_request_peak_device_bytes,
            **report,
        }

    @ray.method(concurrency_group="control")
    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: this rank's next tick sleeps ``seconds`` before its collective,
        as a hung rank would, so the others wait in theirs until the collective timeout."""
        if self.pipeline is None or self.pipeline.ticks is None:
            raise RuntimeError("only a sharded rank ticks")
        self.pipeline.ticks.stall_s = seconds

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        """Answers with the rank index; the group's health check."""
        return self.rank

    def leave(self) -> None:
        """Destroys the process group (the actor is killed right after)."""
        distributed.destroy_process_group()
