"""The application's ingress (Ray Serve LLM's ``OpenAiIngress``): a light deployment, a replica on
each node, that answers the HTTP API (``ingress.routes``: the key, the limits, the routes, functions
of this replica) and the handle API for every model of the application (its job reads in
``ingress.job_reads``). It picks the model's pool by the request's ``model`` and calls that pool's
group deployment (``HSDPServer``, one replica per shard group) by handle.

It is the one place where work moves between groups: a call whose group was lost (its replica's
process or node died) or failed under it goes once more to another group of the model, with the
seed the first run had; a video job released in the job store (its replica stopped reporting, its
group failed under it or filled, its replica was removed) is placed on another group of its model,
which adopts it in the store (``ingress.placement``). A synchronous video is a job like any other,
waited for here.

Results cross the hop encoded (PNG in the images response, MP4 bytes), never as frames."""

import asyncio
import functools
import logging
import time
import uuid

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from ray_hsdp.config.endpoint import EndpointConfig
from ray_hsdp.group import GroupFailedError, remote_cause
from ray_hsdp.request import RequestCancelledError
from ray_hsdp.serve.detached import Detached
from ray_hsdp.serve.errors import (
    GroupLostError,
    ModelLoadingError,
    RequestLimitError,
    UnknownModelError,
    VideoNotFoundError,
    job_failure,
)
from ray_hsdp.serve.ingress.job_reads import JobReads
from ray_hsdp.serve.ingress.keys import KeyCheck, ReplicaKey
from ray_hsdp.serve.ingress.placement import JOBS_POLL_S, place_released_jobs
from ray_hsdp.serve.ingress.routes import api, refuse_keyless, serve_http_host
from ray_hsdp.serve.jobs.actor import open_store
from ray_hsdp.serve.jobs.client import STORE_AWAY, StoreClient
from ray_hsdp.serve.jobs.store import limits
from ray_hsdp.serve.logs import show_logs
from ray_hsdp.serve.model_health import CHECK_TIMEOUT_S, LOADING, ModelWatch
from ray_hsdp.serve.routing import SERVER_NAME
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest, with_seed

logger = logging.getLogger("ray_hsdp")

#: How a lost group reaches a caller of its replica: the replica's actor died (its process, its
#: node), or Ray cannot reach it now (which may pass: the first call is cancelled before the retry).
LOST_GROUP = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

#: How often an ingress replica reads its key again (``ray-hsdp key set`` / ``key remove``, a new
#: ``api_key_file``): a rotation takes effect within this, with no restart. Well under the 10 s a
#: rotation may take to reach every replica (``serve.ingress.keys``), a look at the stored key included.
KEY_REFRESH_S = 2.0


async def cancelled_with_caller(response):
    """Awaits a group's handle call; a caller that goes away (its client disconnected, its handle
    call cancelled) cancels the call here, not only through Ray's cancel of the request's child
    tasks: a retry made after the first call failed was seen to run all its steps after its
    caller's cancel."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """The one ingress of an application of one or several models.

    Args:
        endpoint: ``EndpointConfig`` fields (the key, the limits); the ingress' ``user_config``
            overrides them (``reconfigure``).
        servers: Model id -> the handle of its group deployment, or the name of the model's own
            application (``build_model``), in the configuration's order.
        api_key: The key's check carried from where the application was built; ``None``: each
            replica finds its own (``serve.ingress.keys``).
    """

    def __init__(
        self,
        endpoint: dict,
        servers: dict[str, DeploymentHandle | str],
        api_key: KeyCheck | None = None,
    ):
        show_logs()
        self._endpoint_args = endpoint
        self.config = EndpointConfig(**endpoint)
        app = serve.get_replica_context().app_name
        #: The name the job store keeps this endpoint's jobs (and limits) under: the application's.
        self.endpoint = app
        host, replica = serve_http_host(), serve.get_replica_context().replica_id.to_full_id_str()
        #: Where this replica finds its key, in ``serve.ingress.keys``' order, and reports it (``key show``).
        self._key = ReplicaKey(api_key, app, lambda check, config: refuse_keyless(check, config, host, app), replica)
        #: The check of the key every route but /health asks for (the guard reads it); None: none.
        self.key_check = self._key.read(self.config)
        # A model of its own application: its handle, which waits for the application to exist.
        self.servers = {
            model: serve.get_deployment_handle(SERVER_NAME, app_name=server, _check_exists=False)
            if isinstance(server, str)
            else server
            for model, server in servers.items()
        }
        self.watch = ModelWatch(self.servers)
        # The store, started again by this ingress if it was killed for good (``StoreClient``).
        opener = functools.partial(
            open_store,
            self.config.job_store,
            self.config.media_store,
            password_file=self.config.job_store_password_file,
            password_env=self.config.job_store_password_env,
        )
        self.store = StoreClient(opener)
        #: A job's object and content, as this endpoint holds them.
        self.jobs = JobReads(self.store, self.endpoint, self.watch)
        # Serve runs the constructor on the replica's event loop; the loop holds tasks weakly.
        loop = asyncio.get_running_loop()
        # The endpoint's limits apply from now, to its jobs of earlier deployments too; a store whose
        # database does not answer yet gets them once it does (its routes answer 503 meanwhile).
        self._configuring = loop.create_task(self._configure_store(self.config))
        self._placers = [
            loop.create_task(place_released_jobs(self.store, model, server)) for model, server in self.servers.items()
        ]
        self._watcher = loop.create_task(self.watch.run())
        self._key_reader = loop.create_task(self._read_key_again())
        #: Where the delete of a job whose caller left runs: not in the cancelled call (``serve.detached``).
        self._detached = Detached()

    async def reconfigure(self, user_config: dict) -> None:
        """The endpoint's fields from the ingress' ``user_config`` over its ``args``: Serve calls it
        at the start and at each deploy that edits them, in place (no replica or group restarts).
        Limits apply to the jobs kept, the key at once.

        Raises:
            ValueError: A field refused, or ``job_store`` / ``media_store`` changed (the cluster's
                one store cannot move under running jobs).
        """
        config = EndpointConfig(**{**self._endpoint_args, **user_config})
        if (config.job_store, config.media_store) != (self.config.job_store, self.config.media_store):
            raise ValueError("job_store and media_store do not change in place: set them in the endpoint's args")
        key = await asyncio.to_thread(self._key.read, config)
        self.config, self.key_check = config, key
        # The limits reach the store before this returns, or once its database answers (an edit is
        # never refused for an outage); a later edit's configure supersedes one still waiting.
        self._configuring.cancel()
        try:
            await self.store.call("configure", self.endpoint, limits(config))
        except STORE_AWAY:
            self._configuring = asyncio.get_running_loop().create_task(self._configure_store(config))

    async def _configure_store(self, config: EndpointConfig) -> None:
        """Gives the store this endpoint's limits, waiting out an outage of its database."""
        try:
            await self.store.landed("configure", self.endpoint, limits(config), until_s=float("inf"))
        except Exception as err:  # noqa: BLE001 - a store that refuses its limits keeps its last ones
            logger.error("Giving the job store this endpoint's limits failed: %s", err)

    async def _read_key_again(self) -> None:
        """Every ``KEY_REFRESH_S``: the key as ``serve.ingress.keys`` finds it now (``ReplicaKey.refresh``:
        a source that cannot be read keeps the key; a key that is gone leaves a server that
        strangers may reach refusing every request, never open)."""
        while True:
            await asyncio.sleep(KEY_REFRESH_S)
            self.key_check = await asyncio.to_thread(self._key.refresh, self.config)

    def model_of(self, model: str | None) -> str:
        """The id of the model a request names; the only one where it names none."""
        if model is None:
            if len(self.servers) == 1:
                return next(iter(self.servers))
            raise RequestLimitError(f"model is required: this endpoint serves {sorted(self.servers)}")
        if model not in self.servers:
            raise UnknownModelError(f"model {model!r} is not served here; available: {sorted(self.servers)}")
        return model

    async def _call(self, model: str, method: str, *args, **kwargs):
        """Calls ``method`` of a group of ``model``; a call whose group was lost (Serve's router no
        longer picks a replica whose actor died) or failed under it (the retry avoids its replica)
        goes once more to another group. The caller awaits the retry alone, so one answer reaches
        it; where Ray lost sight of the first only for a while and the retry reaches the same
        replica, the retry joins the run it still holds (same request or video id).

        Returns:
            ``(answer, first_error)``: ``first_error`` says why it was retried, or is ``None``.
        """
        if self.watch.states[model] == LOADING:  # look again now: it may have become ready since
            await self.watch.check(model)
            if self.watch.states[model] == LOADING:
                raise ModelLoadingError(f"model {model!r} is loading: no shard group of it is ready yet; retry shortly")
        handle = getattr(self.servers[model], method)
        response = handle.remote(*args, **kwargs)
        try:
            return await cancelled_with_caller(response), None
        except LOST_GROUP as err:
            # Not cancelled: a replica Ray lost sight of for a while that still runs the call is
            # joined by the retry (it carries the same request or video id), not refused by it.
            first, avoid = f"the shard group running it was lost ({type(err).__name__})", None
        except Exception as err:
            cause = remote_cause(err)
            if not isinstance(cause, GroupFailedError):
                raise
            first, avoid = str(cause), getattr(cause, "replica", None)
        logger.warning("Retrying %s of %s on another shard group: %s", method, model, first)
        try:
            return await cancelled_with_caller(handle.remote(*args, **kwargs, avoid_replica=avoid)), first
        except LOST_GROUP as err:
            raise GroupLostError(f"{first}; its retry on another shard group was lost too: {err}") from None
        except Exception as err:
            cause = remote_cause(err)
            if isinstance(cause, GroupFailedError):
                raise GroupFailedError(f"{first}; its retry on another shard group failed too: {cause}") from None
            raise cause from None

    async def generate(self, request: dict | ImageGenerationRequest) -> dict:
        """Images for one request (``POST /v1/images/generations``; the handle's entry point).

        A request whose group is lost or fails under it runs once more on another group of its
        model with the same seed; the response then says ``"retried": true`` and why in
        ``first_error``."""
        body = with_seed(ImageGenerationRequest.model_validate(request))
        # The group's request id, picked here (as a video's id is): a retry after Ray lost sight of
        # the replica joins the run that replica may still hold; a cancel then stops that one run.
        model, request_id = self.model_of(body.model), uuid.uuid4().hex
        answer, first_error = await self._call(model, "generate", body, request_id=request_id)
        if first_error is None:
            return {**answer, "retried": False}
        return {**answer, "retried": True, "first_error": first_error}

    async def create_video(self, request: dict | VideoCreateRequest, video_id: str | None = None) -> dict:
        """Creates a video job on a group of its model (``POST /v1/videos``); returns its object at
        once. The job's id is picked here (or by the caller): a create sent again after its group
        was lost under the call is the same job."""
        body = with_seed(VideoCreateRequest.model_validate(request))
        video_id = video_id or f"video_{uuid.uuid4().hex}"
        model = self.model_of(body.model)
        created, _ = await self._call(model, "create_video", body, endpoint=self.endpoint, video_id=video_id)
        return created

    async def generate_video(self, request: dict | VideoCreateRequest) -> dict:
        """Creates a video job and waits for it (``POST /v1/videos/sync``; the handle's entry point).
        It moves between groups as any job does; a caller that goes away, during the create too,
        deletes it.

        Returns:
            ``{"video": the video object, "mp4": the MP4's bytes}``; raises what failed the job.
        """
        video_id = f"video_{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.config.sync_wait_s
        try:
            await self.create_video(request, video_id)
            while (video := await self._poll_job(video_id)) is not None:
                if video["status"] == "failed":
                    raise job_failure(video["error"])
                if video["status"] == "completed":
                    return {"video": video, "mp4": await self.video_content(video_id)}
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"video {video_id!r} is still {video['status']} after sync_wait_s="
                        f"{self.config.sync_wait_s:g}s; it goes on: GET /v1/videos/{video_id}"
                    )
                await asyncio.sleep(JOBS_POLL_S)
        except asyncio.CancelledError:
            # Its group stops it at its next report; a store that is away gets the delete when it is back.
            self._detached.start(self._delete_left(video_id))
            raise
        raise RequestCancelledError(f"video {video_id!r} was deleted while the call waited for it")

    async def _poll_job(self, video_id: str) -> dict | None:
        """A waited-for job's object; a store outage is waited out (the job goes on meanwhile)."""
        return await self.store.landed("get", self.endpoint, video_id, until_s=self.config.sync_wait_s)

    async def _delete_left(self, video_id: str) -> None:
        try:
            await self.store.landed("delete", self.endpoint, video_id, until_s=self.config.video_lost_wait_s)
        except Exception as err:  # noqa: BLE001 - the job then runs to its end, kept as any job
            logger.warning("Deleting video %s, whose caller went away, failed: %s", video_id, err)

    async def video(self, video_id: str) -> dict:
        """The video object of a job (``GET /v1/videos/{id}``: ``JobReads.video``)."""
        return await self.jobs.video(video_id)

    async def video_content(self, video_id: str, variant: str = "video") -> bytes:
        """The MP4 of a completed job, or its first frame as PNG (``JobReads.video_content``)."""
        return await self.jobs.video_content(video_id, variant)

    async def delete_video(self, video_id: str) -> dict:
        """Deletes a job: afterwards its id is 404; the group running it stops it at its next report."""
        if not await self.store.call("delete", self.endpoint, video_id):
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def _each(self, method: str, *args) -> dict[str, object]:
        """Model id -> what ``method`` of one of its groups answered, for every model at once."""
        answers = await asyncio.gather(*(getattr(h, method).remote(*args) for h in self.servers.values()))
        return dict(zip(self.servers, answers))

    async def _pool_entry(self, model: str) -> dict:
        """One model's pool, or its state and why it cannot answer now (a rebuild, a start)."""
        try:
            return {"model": model, **await asyncio.wait_for(self.servers[model].pool.remote(), CHECK_TIMEOUT_S)}
        except Exception as err:  # noqa: BLE001 - one model's trouble is its own entry, not the list's
            cause = remote_cause(err)
            return {"model": model, "state": self.watch.states[model], "error": f"{type(cause).__name__}: {cause}"}

    async def pool(self, model: str | None = None) -> dict:
        """One group's topology, memory and requests: of ``model``'s pool, or the only model's; with
        several models and none named, ``{"object": "list", "data": [each model's, with its id]}``
        (a model that cannot answer now has its state and error there)."""
        if model is not None or len(self.servers) == 1:
            return await self.servers[self.model_of(model)].pool.remote()
        return {"object": "list", "data": list(await asyncio.gather(*map(self._pool_entry, self.servers)))}

    async def progress(self) -> dict:
        """Request id -> its state, over one group of every model."""
        merged: dict = {}
        for states in (await self._each("progress")).values():
            merged.update(states)
        return merged

    async def health(self, model: str | None = None) -> dict:
        """The endpoint's health (``GET /health``), or one model's (``model``), from the last check
        of each model (``ModelWatch``): ``status`` ``ok`` while one model at least has a ready group
        (the endpoint can answer: one model's outage is its own), or, for ``model``, while that
        model has one; ``models``: each model's state; ``errors``: why a model's last check failed."""
        if model is not None:
            model = self.model_of(model)
        healthy = self.watch.healthy(model)
        return {
            "status": "ok" if healthy else "unavailable",
            "models": dict(self.watch.states) if model is None else {model: self.watch.states[model]},
            "errors": {m: e for m, e in self.watch.errors.items() if model in (None, m)},
        }

    async def models(self) -> dict:
        """The served models (``GET /v1/models``), each with its state and, once a group of it has
        answered, its kind and input: at once, from the ingress' first moment."""
        return {"object": "list", "data": [self.watch.entry(m) for m in self.servers]}

    async def loras(self, model: str | None = None) -> dict:
        """The adapters of ``model`` (or of the only model); with several, every model's, each
        entry naming its model."""
        if model is not None or len(self.servers) == 1:
            return await self.servers[self.model_of(model)].loras.remote()
        answers = await self._each("loras")
        return {
            "object": "list",
            "data": [{**entry, "model": m} for m, answer in answers.items() for entry in answer["data"]],
            "max_loras_per_request": {m: answer["max_loras_per_request"] for m, answer in answers.items()},
        }
