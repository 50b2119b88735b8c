"""A model's group deployment: one replica owns one shard group (the engine, kept by
``GroupKeeper``) and answers handle calls from the application's ingress (``ingress.server``), never
HTTP; its video jobs run in ``videos``; every error is answered by ``errors``' one table, there."""

import asyncio
import collections
import functools
import logging
import threading
import time
import uuid
from concurrent.futures import Future

import ray
from ray import serve

from ray_hsdp import deadlines
from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import Engine, GroupFailedError, QueueTimeoutError, ShardGroup
from ray_hsdp.request import GenerationRequest, GenerationResult, RequestCancelledError
from ray_hsdp.serve.autoscaling import LOAD_METRIC
from ray_hsdp.serve.errors import RequestLimitError, UnknownModelError
from ray_hsdp.serve.jobs.actor import find_store
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.jobs.records import pool_of
from ray_hsdp.serve.logs import show_logs
from ray_hsdp.serve.replica.gpu_share import WakeFailedError
from ray_hsdp.serve.replica.keeper import GroupKeeper
from ray_hsdp.serve.replica.metrics import ReplicaMetrics
from ray_hsdp.serve.replica.model_facts import ModelFacts
from ray_hsdp.serve.replica.share_member import ShareMember
from ray_hsdp.serve.replica.videos import VideoJobs
from ray_hsdp.serve.replica.warm_up import check_shapes, start_warm
from ray_hsdp.serve.routing import GROUP_LOAD, GROUP_OK
from ray_hsdp.serve.schema import ImageGenerationRequest, image_response, to_generation_request, what_ran

logger = logging.getLogger("ray_hsdp")

#: How long a replica looks for the job store at one call (an ingress starts it, or starts it again).
STORE_FIND_S = 10.0


@serve.deployment
class HSDPServer(VideoJobs, ModelFacts):
    """One Serve replica = one shard group of one model, placed in the replica's own placement group.

    Args:
        config: ``AppConfig`` fields as a dict (what the app builder passes).
        dims: The pool's mesh arithmetic, as the app builder computed it.
        shapes_checked: Whether the app builder checked the warm-up shapes (it held the model's
            folder); else the replica does, before its group reads a weight.
    """

    def __init__(self, config: dict, dims: ParallelDims, shapes_checked: bool = False):
        show_logs()
        self.config = AppConfig(**config)
        self.dims = dims
        self.model_name = self.config.served_model_name
        self._placement = ray.util.get_current_placement_group()
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        #: The job store's name of this deployment: its released and waiting jobs move only among its groups.
        self._pool = pool_of(context.app_name, context.deployment)
        self.metrics = ReplicaMetrics(self.model_name)
        #: The cluster's video job store, found at its first use (an ingress starts it).
        self.store = StoreClient(functools.partial(find_store, STORE_FIND_S))
        #: Video id -> the task that runs it here (a drain releases those left), and the attempt it runs.
        self._videos: dict[str, asyncio.Task] = {}
        self._attempts: dict[str, int] = {}
        #: Ids this replica cancelled lately (ids are unique: a bounded memory is enough).
        self._cancelled: collections.deque[str] = collections.deque(maxlen=4096)
        #: Request id -> the group's future of a request running here (a retry of it joins it).
        self._held: dict[str, Future] = {}
        self._draining = False
        self._stopping = threading.Event()
        self.keeper: GroupKeeper | None = None  # while None, the group is starting
        #: The model's place in its GPU share (``gpu_share``): its ranks go in the share's placement
        #: group, its load waits for room and each request holds it awake; None: GPUs of its own.
        self.share: ShareMember | None = None
        # Before the group's start, so that the metrics show it starting.
        threading.Thread(target=self._report_metrics, name="ray_hsdp-metrics", daemon=True).start()
        try:
            if not shapes_checked:  # the check imports torch, which a replica otherwise never does
                check_shapes(self.config)
            if self.config.gpu_share is not None:
                self.share = ShareMember(self.config, self.dims)
                self._placement = self.share.placement
            self.keeper = GroupKeeper(self._build_group)
        except BaseException:
            self._stopping.set()
            raise
        self._start_video_tasks()

    def _build_group(self) -> Engine:
        if self.share is not None:
            return self.share.start(self._start_group)
        return self._start_group()

    def _start_group(self) -> Engine:
        labels = {"replica": self._replica}
        group = ShardGroup(
            self.config,
            placement_group=self._placement,
            dims=self.dims,
            labels=labels,
            shares_gpus=self.share is not None,
        )
        group.listeners.append(self.metrics.request_done)
        return start_warm(group, self.config)

    def _report_metrics(self) -> None:
        """Every ``metrics_interval_s``: the group's queue and ranks, its failures, the job table."""
        while not self._stopping.wait(self.config.metrics_interval_s):
            try:
                self.metrics.state(self._state(), self._load())
                if self.keeper is None:
                    continue
                if self.keeper.ready:
                    group = self.keeper.group
                    self.metrics.group(group.group_id, *group.load(), group.tick_stats(), group.warm_up_stats)
                self.metrics.keeper(self.keeper.failures, self.keeper.rebuilds)
                if self.share is not None:
                    shared = self.share.state()
                    self.metrics.sleeping(shared.get("node") or "", shared.get("parked_bytes", 0))
                if (store := self.store.cached()) is not None:
                    counts = ray.get(store.counts.remote(), timeout=self.config.metrics_interval_s)
                    self.metrics.video_jobs(counts)
            except Exception as err:  # noqa: BLE001 - a missed poll is reported again at the next one
                logger.warning("Metrics poll failed: %s", err)

    @property
    def group(self) -> Engine:
        """The replica's current shard group (failed or not)."""
        return self.keeper.group

    def _ready_group(self) -> Engine:
        """The group, or a 503 while a failed one is rebuilt (the rebuild starts here if needed)."""
        current = self.keeper.current()
        if not current.done():
            raise GroupFailedError("the shard group failed and is being rebuilt; retry shortly")
        return current.result()

    async def _submit(self, job: GenerationRequest, variant=None):
        """Hands ``job`` (and its ``variant``) to the group; a group being rebuilt is waited for, as a
        queued request waits, until the job's ``queue_deadline`` (what is left is the group queue's).

        Returns:
            The group's future of the result.
        """
        deadline = deadlines.queue_deadline(job, self.config)
        wait_s = max(0.0, deadline - time.time())
        try:
            # Not wait_for: on Python 3.11 it swallows a cancel that lands once the group is ready,
            # and the cancelled request would then be submitted and run all its steps.
            async with asyncio.timeout(wait_s):
                group = await asyncio.shield(asyncio.wrap_future(self.keeper.current()))
        except TimeoutError:
            raise QueueTimeoutError(
                "the shard group was still being rebuilt at the request's deadline "
                f"(queue_timeout_s={self.config.queue_timeout_s:g} from its arrival)"
            ) from None
        if job.request_id in self._cancelled:
            # Cancelled while it waited for the rebuild (the failed group held no record of it).
            raise RequestCancelledError(f"request {job.request_id!r} was cancelled before its group took it")
        if self.share is None:
            return group.submit(variant or job)
        return await self._submit_awake(group, job, deadline, variant)

    async def _submit_awake(self, group: Engine, job: GenerationRequest, deadline: float, variant=None):
        """``group.submit`` once the model is awake on its GPU share (woken here if it slept),
        holding it awake until the request is answered. A wake that fails fails the group, whose
        rebuild the request then waits for, within its deadline."""
        try:
            lease, entered = await self.share.enter(deadline)
        except WakeFailedError as err:
            group.fail(str(err))  # its keeper rebuilds it
            rebuilt = await self._rebuilt(deadline)
            lease, entered = await self.share.enter(deadline)
            group = rebuilt
        if job.request_id in self._cancelled:  # cancelled while its model woke
            self.share.leave(lease)
            raise RequestCancelledError(f"request {job.request_id!r} was cancelled while its model woke")
        if entered.get("woke"):
            self.metrics.woke(entered["wake_s"])
        try:
            future = group.submit(variant or job)
        except BaseException:
            self.share.leave(lease)
            raise
        future.add_done_callback(lambda _: self.share.leave(lease))
        return future

    async def _rebuilt(self, deadline: float) -> Engine:
        """The group once its rebuild ended (``QueueTimeoutError`` at ``deadline``)."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                return await asyncio.shield(asyncio.wrap_future(self.keeper.current()))
        except TimeoutError:
            raise QueueTimeoutError("the shard group was still being rebuilt at the request's deadline") from None

    def _cancel(self, request_id: str) -> None:
        """The one cancel path of a request this replica runs (DELETE, its client gone, a job taken
        over): ``ShardGroup.cancel``, which drops it from the queue or stops it on its lane. The id
        is remembered too, so that a request waiting for its group's rebuild is never handed to the
        rebuilt group."""
        self._cancelled.append(request_id)
        try:
            self.group.cancel(request_id)
        except Exception as err:  # noqa: BLE001 - a failed group answers the request itself
            logger.warning("Cancelling %s failed: %s", request_id, err)

    async def _result(self, job: GenerationRequest, future=None, variant=None) -> GenerationResult:
        """The result of ``job`` (awaiting ``future``, or submitting it and its ``variant``). A caller
        that goes away (the ingress' call is cancelled: its client disconnected, or a retry elsewhere
        won) stops it here. (A group failing under it raises ``GroupFailedError``: the ingress
        retries the call on another group, ``OpenAIIngress._call``.)"""
        try:
            if future is None:
                future = await self._submit(job, variant)
                self._held[job.request_id] = future
                future.add_done_callback(lambda _: self._held.pop(job.request_id, None))
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self._cancel(job.request_id)
            raise

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise UnknownModelError(f"model {model!r} is not served here; available: [{self.model_name!r}]")

    async def generate(
        self, request: dict | ImageGenerationRequest, avoid_replica: str | None = None, request_id: str | None = None
    ) -> dict:
        """Generates images for one request (the ingress' call).

        Args:
            request: The ``/v1/images/generations`` body, as a dict or the schema object, its seed drawn.
            avoid_replica: The replica whose group failed the request's first run: the router sends
                the retry elsewhere when it can; where it cannot, this replica refuses it at once.
            request_id: The group's id of the request, picked by the ingress: a retry sent after Ray
                lost sight of this replica for a while joins the run it may still hold here, so one
                run answers and one cancel stops it.

        Returns:
            The OpenAI images response: ``created``, ``data[i].b64_json``, plus ``seed``, ``rank``
            and the steps and guidance it ran with.

        Raises:
            GroupFailedError: The group failed under it; ``replica`` names this replica.
        """
        if avoid_replica == self._replica:
            raise GroupFailedError("no other shard group could take the retry")
        body = ImageGenerationRequest.model_validate(request)
        self._check_model(body.model)
        if self.group.pipeline_facts.get("image_input"):
            raise RequestLimitError(
                f"{self.model_name} is an image-to-video model: POST /v1/videos with the first frame as input_reference"
            )
        job = to_generation_request(body, self.config, request_id=request_id or uuid.uuid4().hex)
        variant = self.group.check(job)  # built once: the group takes it with the job
        try:
            result = await self._result(job, self._held.get(job.request_id), variant)
        except GroupFailedError as err:
            err.replica = self._replica  # what the ingress' retry avoids
            raise
        # Off the event loop: a large PNG takes hundreds of ms, and the loop serves every other call.
        encoded = await asyncio.to_thread(
            image_response, result, self.model_name, body.output_format, body.output_compression
        )
        return {
            **encoded,
            "id": job.request_id,
            **what_ran(job),
        }

    # ---- video jobs ------------------------------------------------------------------------

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaling policy sizes the pool on (``ray_hsdp.serve.autoscaling``):
        requests the group holds, queued or running, video jobs included; a group being rebuilt
        counts its waiting video jobs."""
        return {LOAD_METRIC: float(self._load())}

    def _state(self) -> str:
        """The group's state, one of ``GROUP_STATES``."""
        if self._draining:
            return "draining"
        if self.keeper is None:
            return "starting"
        if self.keeper.broken:
            return "failed"
        if not self.keeper.ready:
            return "rebuilding"
        if self.share is not None and (state := self.share.state()["state"]) in ("sleeping", "waking"):
            return state
        return "serving"

    def _load(self) -> int:
        """Requests the group holds, queued or running, video jobs included; while the group is
        rebuilt, the video jobs waiting for it."""
        load = len(self._videos)
        if self.keeper is not None and self.keeper.ready:
            load = max(load, sum(self.keeper.group.load()))
        return load

    def pool(self) -> dict:
        """Topology of this replica's group, each rank's memory report, and the requests it holds
        (queued, or running with their denoising step: ``ShardGroup.progress``)."""
        group = self._ready_group()
        replica = serve.get_replica_context().replica_id.unique_id
        return {
            **group.describe(),
            "replica": replica,
            "state": self._state(),
            "ranks": group.memory(),
            "requests": group.progress(),
            # What requests may ask of the step cache ('cache'), and what they get by default.
            "cache": self.config.cache.model_dump(),
        }

    def health(self) -> str:
        """Every rank of the group answers within the deadline (the ingress' ``/health``); raises
        while the group is rebuilt (503) or could not be. Returns the model's state: ``ready``, or
        on a GPU share its state there (``sleeping``, ``waking``...)."""
        self._ready_group().check_health()
        if self.share is None:
            return "ready"
        state = self.share.state()["state"]
        if state == "failed":
            raise GroupFailedError(f"{self.model_name}'s group failed on its GPU share and is being rebuilt")
        return state

    def progress(self) -> dict:
        """Request id -> state (queued, or running with its denoising step) of this replica's requests."""
        return self.group.progress()

    def record_routing_stats(self) -> dict:
        """What the router reads (``GroupAwareRouter``): whether this replica's group can serve now.

        Serve asks every ``request_routing_stats_period_s``, so a failed group also starts its
        rebuild here without waiting for a request or the health check.
        """
        self.keeper.current()
        return {GROUP_OK: self.keeper.ready, GROUP_LOAD: self._load()}

    def check_health(self) -> None:
        """Serve's replica health check: every rank must answer within the deadline.

        A failed group is rebuilt in place, and counts as healthy meanwhile; one that could not
        be rebuilt does not, and Serve then replaces the replica.
        """
        current = self.keeper.current()
        if current.done():
            current.result().check_health()  # raises for a group that could not be rebuilt

    async def __del__(self) -> None:
        """Serve removes this replica (a downscale, a redeploy): its video jobs get
        ``drain_timeout_s`` to finish; then each is released for the ingress to place on another
        group (one that none takes within ``video_lost_wait_s`` fails with the reason). Only then
        does the group shut down. (Serve has stopped routing requests here and waited for the
        ongoing ones before it calls this.) When the whole application goes, the group shuts down
        at once."""
        if getattr(self, "_draining", False):  # once: Serve calls it, the garbage collector may again
            return
        self._draining = True
        await self._drain_videos()
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
        keeper = getattr(self, "keeper", None)
        if keeper is not None:
            keeper.shutdown()
        share = getattr(self, "share", None)
        if share is not None:
            share.forget()
