"""A model's group deployment: one replica owns one shard group (the engine, kept by
``GroupKeeper``) and answers handle calls from the application's ingress (``ingress.server``), never
HTTP. Its parts share one ``state.ReplicaState``: the request path to the group (``requests``), its
video jobs (``videos``), its metrics poll (``state.report_metrics``); what it tells of its model is
``model_facts``'. Every error is answered by ``errors``' one table, there."""

import asyncio
import functools
import threading
import uuid
from typing import Protocol

import ray
from ray import serve
from ray.util.placement_group import PlacementGroup

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import Engine, GroupFailedError, ShardGroup
from ray_hsdp.serve.autoscaling import LOAD_METRIC
from ray_hsdp.serve.errors import RequestLimitError
from ray_hsdp.serve.jobs.actor import find_store
from ray_hsdp.serve.jobs.client import StoreClient
from ray_hsdp.serve.jobs.records import pool_of
from ray_hsdp.serve.logs import show_logs
from ray_hsdp.serve.replica import model_facts
from ray_hsdp.serve.replica.keeper import GroupKeeper
from ray_hsdp.serve.replica.metrics import ReplicaMetrics
from ray_hsdp.serve.replica.requests import GroupRequests
from ray_hsdp.serve.replica.share_member import ShareMember
from ray_hsdp.serve.replica.state import ReplicaState, check_model, group_load, group_state, report_metrics
from ray_hsdp.serve.replica.videos import VideoJobs
from ray_hsdp.serve.replica.warm_up import check_shapes, start_warm
from ray_hsdp.serve.routing import GROUP_LOAD, GROUP_OK
from ray_hsdp.serve.schema import (
    ImageGenerationRequest,
    VideoCreateRequest,
    image_response,
    to_generation_request,
    what_ran,
)

#: How long a replica looks for the job store at one call (an ingress starts it, or starts it again).
STORE_FIND_S = 10.0


class EngineFactory(Protocol):
    """Builds a replica's engine, not yet started (the replica starts and warms it, ``start_warm``):
    ``ShardGroup`` itself by default; a test passes a small fake (``tests/serve/replica/test_fake_engine.py``)."""

    def __call__(
        self,
        config: AppConfig,
        *,
        placement_group: PlacementGroup | None,
        dims: ParallelDims,
        labels: dict[str, str],
        shares_gpus: bool,
    ) -> Engine: ...


@serve.deployment
class HSDPServer:
    """One Serve replica = one shard group of one model, placed in the replica's own placement group.

    Args:
        config: ``AppConfig`` fields as a dict (what the app builder passes).
        dims: The pool's mesh arithmetic, as the app builder computed it.
        shapes_checked: Whether the app builder checked the warm-up shapes (it held the model's
            folder); else the replica does, before its group reads a weight.
        engine_factory: How the replica builds its engine, at its start and at each rebuild.
    """

    def __init__(
        self,
        config: dict,
        dims: ParallelDims,
        shapes_checked: bool = False,
        engine_factory: EngineFactory = ShardGroup,
    ):
        show_logs()
        self.config = AppConfig(**config)
        self.dims = dims
        self.model_name = self.config.served_model_name
        self._engine_factory = engine_factory
        self._placement = ray.util.get_current_placement_group()
        context = serve.get_replica_context()
        self.state = ReplicaState(
            config=self.config,
            replica=context.replica_id.unique_id,
            pool=pool_of(context.app_name, context.deployment),
            metrics=ReplicaMetrics(self.model_name),
            store=StoreClient(functools.partial(find_store, STORE_FIND_S)),
        )
        self.requests = GroupRequests(self.state)
        # Before the group's start, so that the metrics show it starting.
        threading.Thread(target=report_metrics, args=(self.state,), name="ray_hsdp-metrics", daemon=True).start()
        try:
            if not shapes_checked:  # the check imports torch, which a replica otherwise never does
                check_shapes(self.config)
            if self.config.gpu_share is not None:
                self.state.share = ShareMember(self.config, self.dims)
                self._placement = self.state.share.placement
            self.state.keeper = GroupKeeper(self._build_group)
        except BaseException:
            self.state.stopping.set()
            raise
        self.videos = VideoJobs(self.state, self.requests)

    def _build_group(self) -> Engine:
        if self.state.share is not None:
            return self.state.share.start(self._start_group)
        return self._start_group()

    def _start_group(self) -> Engine:
        group = self._engine_factory(
            self.config,
            placement_group=self._placement,
            dims=self.dims,
            labels={"replica": self.state.replica},
            shares_gpus=self.state.share is not None,
        )
        group.listeners.append(self.state.metrics.request_done)
        return start_warm(group, self.config)

    @property
    def group(self) -> Engine:
        """The replica's current shard group (failed or not)."""
        return self.state.group

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
        if avoid_replica == self.state.replica:
            raise GroupFailedError("no other shard group could take the retry")
        body = ImageGenerationRequest.model_validate(request)
        check_model(self.state, body.model)
        if self.group.pipeline_facts.get("image_input"):
            raise RequestLimitError(
                f"{self.model_name} is an image-to-video model: POST /v1/videos with the first frame as input_reference"
            )
        job = to_generation_request(body, self.config, request_id=request_id or uuid.uuid4().hex)
        variant = self.group.check(job)  # built once: the group takes it with the job
        try:
            result = await self.requests.result(job, self.requests.held.get(job.request_id), variant)
        except GroupFailedError as err:
            err.replica = self.state.replica  # what the ingress' retry avoids
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

    async def create_video(
        self,
        request: dict | VideoCreateRequest,
        endpoint: str,
        video_id: str | None = None,
        avoid_replica: str | None = None,
    ) -> dict:
        """Creates a video job (``POST /v1/videos``) and starts it here: ``VideoJobs.create``."""
        return await self.videos.create(request, endpoint, video_id, avoid_replica)

    async def adopt_video(self, video_id: str, spec: str, attempt: int, avoid_replica: str | None = None) -> bool:
        """Runs a job the ingress placed here as its next attempt: ``VideoJobs.adopt``."""
        return await self.videos.adopt(video_id, spec, attempt, avoid_replica)

    def describe(self) -> dict:
        """This model's entry of ``GET /v1/models`` (``model_facts.describe``)."""
        return model_facts.describe(self.model_name, self.group.pipeline_facts)

    def loras(self) -> dict:
        """This model's adapters (``GET /v1/loras``: ``model_facts.loras``)."""
        return model_facts.loras(self.config)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaling policy sizes the pool on (``ray_hsdp.serve.autoscaling``):
        requests the group holds, queued or running, video jobs included; a group being rebuilt
        counts its waiting video jobs."""
        return {LOAD_METRIC: float(group_load(self.state))}

    def pool(self) -> dict:
        """Topology of this replica's group, each rank's memory report, and the requests it holds
        (queued, or running with their denoising step: ``ShardGroup.progress``)."""
        group = self.requests.ready_group()
        return {
            **group.describe(),
            "replica": self.state.replica,
            "state": group_state(self.state),
            "ranks": group.memory(),
            "requests": group.progress(),
            # What requests may ask of the step cache ('cache'), and what they get by default.
            "cache": self.config.cache.model_dump(),
        }

    def health(self) -> str:
        """Every rank of the group answers within the deadline (the ingress' ``/health``); raises
        while the group is rebuilt (503) or could not be. Returns the model's state: ``ready``, or
        on a GPU share its state there (``sleeping``, ``waking``...)."""
        self.requests.ready_group().check_health()
        if self.state.share is None:
            return "ready"
        state = self.state.share.state()["state"]
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
        self.state.keeper.current()
        return {GROUP_OK: self.state.keeper.ready, GROUP_LOAD: group_load(self.state)}

    def check_health(self) -> None:
        """Serve's replica health check: every rank must answer within the deadline.

        A failed group is rebuilt in place, and counts as healthy meanwhile; one that could not
        be rebuilt does not, and Serve then replaces the replica.
        """
        current = self.state.keeper.current()
        if current.done():
            current.result().check_health()  # raises for a group that could not be rebuilt

    async def __del__(self) -> None:
        """Serve removes this replica (a downscale, a redeploy): its video jobs get
        ``drain_timeout_s`` to finish; then each is released for the ingress to place on another
        group (one that none takes within ``video_lost_wait_s`` fails with the reason). Only then
        does the group shut down. (Serve has stopped routing requests here and waited for the
        ongoing ones before it calls this.) When the whole application goes, the group shuts down
        at once."""
        state = getattr(self, "state", None)
        if state is None or state.draining:  # once: Serve calls it, the garbage collector may again
            return
        state.draining = True
        videos = getattr(self, "videos", None)  # none where the constructor failed
        if videos is not None:
            await videos.drain()
        state.stopping.set()
        if state.keeper is not None:
            state.keeper.shutdown()
        if state.share is not None:
            state.share.forget()
