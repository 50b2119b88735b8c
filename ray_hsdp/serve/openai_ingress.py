"""The application's ingress (Ray Serve LLM's ``OpenAiIngress``): a light deployment, a replica on
each node, that answers the HTTP API (``ingress``: the key, the limits, the routes) and the handle
API for every model of the application. It picks the model's pool by the request's ``model``,
calls that pool's group deployment (``HSDPServer``, one replica per shard group) by handle, and
sends a call whose group was lost (its replica's process or node died) once more to another group
of the model, with the seed the first run had. Video jobs are read from the job table.

Results cross the hop encoded (PNG in the images response, MP4 bytes), never as frames."""

import asyncio
import logging

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from ray_hsdp.config_endpoint import EndpointConfig
from ray_hsdp.serve.errors import GroupLostError, RequestLimitError, UnknownModelError, VideoNotFoundError
from ray_hsdp.serve.ingress import OpenAIRoutes, api, refuse_keyless, serve_http_host
from ray_hsdp.serve.keys import KeyCheck, replica_key
from ray_hsdp.serve.logs import show_logs
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest, with_seed
from ray_hsdp.serve.videos import JobReads

logger = logging.getLogger("ray_hsdp")

#: How a lost group reaches a caller of its replica: the replica's actor died (its process, its
#: node), or Ray cannot reach it now (which may pass: the first call is cancelled before the retry).
LOST_GROUP = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@serve.deployment
@serve.ingress(api)
class OpenAIIngress(OpenAIRoutes, JobReads):
    """The one ingress of an application of one or several models.

    Args:
        endpoint: ``EndpointConfig`` fields (the key, the limits).
        servers: Model id -> the handle of its group deployment, in the configuration's order.
        jobs: The application's video job table (``VideoJobTable``'s handle).
        api_key: The key's check carried from where the application was built; ``None``: each
            replica finds its own (``serve.keys``).
    """

    def __init__(
        self,
        endpoint: dict,
        servers: dict[str, DeploymentHandle],
        jobs: DeploymentHandle,
        api_key: KeyCheck | None = None,
    ):
        show_logs()
        self.config = EndpointConfig(**endpoint)
        app = serve.get_replica_context().app_name
        #: The check of the key every route but /health asks for (the guard reads it); None: none.
        self.key_check = replica_key(api_key, self.config, app)
        refuse_keyless(self.key_check, self.config, serve_http_host(), app)
        self.servers = servers
        self.jobs = jobs
        self._descriptions: dict[str, dict] = {}  # model id -> its /v1/models entry, once its group told it

    def _model(self, model: str | None) -> str:
        """The id of the model a request names; the only one where it names none."""
        if model is None:
            if len(self.servers) == 1:
                return next(iter(self.servers))
            raise RequestLimitError(f"model is required: this endpoint serves {sorted(self.servers)}")
        if model not in self.servers:
            raise UnknownModelError(f"model {model!r} is not served here; available: {sorted(self.servers)}")
        return model

    async def _call(self, model: str, method: str, *args, retry: bool = True):
        """Calls ``method`` of a group of ``model``; a group lost under the call gets it once more
        on another group (Serve's router no longer picks a replica whose actor died).

        Returns:
            ``(answer, first_error)``: ``first_error`` says why it was retried, or is ``None``.
        """
        handle = getattr(self.servers[model], method)
        response = handle.remote(*args)
        try:
            return await response, None
        except LOST_GROUP as err:
            if not retry:
                raise GroupLostError(f"the shard group running it was lost: {err}") from None
            first = f"the shard group running it was lost ({type(err).__name__})"
        response.cancel()  # where Ray lost sight of it only for a while, its first run stops
        logger.warning("Retrying %s of %s on another shard group: %s", method, model, first)
        try:
            return await handle.remote(*args), first
        except LOST_GROUP as err:
            raise GroupLostError(f"{first}; its retry on another shard group was lost too: {err}") from None

    async def generate(self, request: dict | ImageGenerationRequest) -> dict:
        """Images for one request (``POST /v1/images/generations``; the handle's entry point).

        A request whose group is lost under it runs once more on another group of its model with
        the same seed; the response then says ``"retried": true`` and why in ``first_error``."""
        body = with_seed(ImageGenerationRequest.model_validate(request))
        answer, first_error = await self._call(self._model(body.model), "generate", body)
        if first_error is None:
            return answer
        errors = [first_error, answer.get("first_error")]  # the other group may have retried it too
        return {**answer, "retried": True, "first_error": "; ".join(e for e in errors if e)}

    async def create_video(self, request: dict | VideoCreateRequest) -> dict:
        """Creates a video job on a group of its model (``POST /v1/videos``); returns its object at once."""
        body = with_seed(VideoCreateRequest.model_validate(request))
        created, _ = await self._call(self._model(body.model), "create_video", body, retry=False)
        return created

    async def generate_video(self, request: dict | VideoCreateRequest) -> dict:
        """Creates a video job and waits for it (``POST /v1/videos/sync``; the handle's entry point).

        Returns:
            ``{"video": the video object, "mp4": the MP4's bytes}``; raises if the job failed.
        """
        body = with_seed(VideoCreateRequest.model_validate(request))
        answer, _ = await self._call(self._model(body.model), "generate_video", body)
        return answer

    async def delete_video(self, video_id: str) -> dict:
        """Deletes a job: afterwards its id is 404; the group running it stops it at its next report."""
        if not await self.jobs.delete.remote(video_id):
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def _each(self, method: str, *args) -> dict[str, object]:
        """Model id -> what ``method`` of one of its groups answered, for every model at once."""
        answers = await asyncio.gather(*(getattr(h, method).remote(*args) for h in self.servers.values()))
        return dict(zip(self.servers, answers))

    async def pool(self, model: str | None = None) -> dict:
        """One group's topology, memory and requests: of ``model``'s pool, or the only model's; with
        several models and none named, ``{"object": "list", "data": [each model's, with its id]}``."""
        if model is not None or len(self.servers) == 1:
            return await self.servers[self._model(model)].pool.remote()
        return {"object": "list", "data": [{"model": m, **p} for m, p in (await self._each("pool")).items()]}

    async def progress(self) -> dict:
        """Request id -> its state, over one group of every model."""
        merged: dict = {}
        for states in (await self._each("progress")).values():
            merged.update(states)
        return merged

    async def health(self) -> dict:
        await self._each("health")  # every model's group answers, or this raises its error
        return {"status": "ok"}

    async def models(self) -> dict:
        """The served models with their kind (``GET /v1/models``)."""
        missing = [m for m in self.servers if m not in self._descriptions]
        if missing:
            found = await asyncio.gather(*(self.servers[m].describe.remote() for m in missing))
            self._descriptions.update(zip(missing, found))
        return {"object": "list", "data": [self._descriptions[m] for m in self.servers]}

    async def loras(self, model: str | None = None) -> dict:
        """The adapters of ``model`` (or of the only model); with several, every model's, each
        entry naming its model."""
        if model is not None or len(self.servers) == 1:
            return await self.servers[self._model(model)].loras.remote()
        answers = await self._each("loras")
        return {
            "object": "list",
            "data": [{**entry, "model": m} for m, answer in answers.items() for entry in answer["data"]],
            "max_loras_per_request": {m: answer["max_loras_per_request"] for m, answer in answers.items()},
        }
