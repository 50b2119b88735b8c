"""The Serve deployment: one replica owns one shard group and answers HTTP and handle calls."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import uuid
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from ray_hsdp.config import AppConfig
from ray_hsdp.group import GroupFailedError, GroupOverloadedError, ShardGroup
from ray_hsdp.serve.keeper import GroupKeeper
from ray_hsdp.serve.routing import GROUP_OK
from ray_hsdp.serve.schema import ImageGenerationRequest, RequestLimitError, image_response, to_generation_request

logger = logging.getLogger("ray_hsdp")

api = FastAPI(title="ray_hsdp", description="FSDP2-sharded diffusion serving on Ray")


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    first = next((e.get("loc") for e in exc.errors()), ())
    param = str(first[-1]) if first and first[-1] != "body" else None
    return _error(400, "; ".join(problems) or "invalid request", "invalid_request_error", param)


@api.exception_handler(RequestLimitError)
async def _over_limit(_: Request, exc: RequestLimitError) -> JSONResponse:
    return _error(400, str(exc), "invalid_request_error")


@api.exception_handler(GroupOverloadedError)
async def _overloaded(request: Request, exc: GroupOverloadedError) -> JSONResponse:
    response = _error(429, str(exc), "rate_limit_error")
    response.headers["Retry-After"] = str(request.app.state.config.retry_after_s)
    return response


@api.middleware("http")
async def _guard(request: Request, call_next):
    """API key and body size, before any route runs."""
    config: AppConfig = request.app.state.config
    key: str | None = request.app.state.api_key
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))  # route prefix of the app
    if key and path != "/health":
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            response = _error(
                401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "authentication_error"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
    if request.method in ("POST", "PUT", "PATCH"):
        length = request.headers.get("content-length")
        if length is None:
            return _error(411, "a request body needs a Content-Length header", "invalid_request_error")
        if not length.isdigit() or int(length) > config.max_body_bytes:
            return _error(413, f"request body larger than {config.max_body_bytes} bytes", "invalid_request_error")
    return await call_next(request)


def read_api_key(config: AppConfig) -> str | None:
    """The API key from ``api_key_file`` or the ``api_key_env`` variable; ``None`` when neither is set."""
    if config.api_key_file:
        key = (
            Path(config.api_key_file).read_text().splitlines()[0].strip() if Path(config.api_key_file).exists() else ""
        )
        if not key:
            raise ValueError(f"api_key_file {config.api_key_file} is missing or empty")
        return key
    return os.environ.get(config.api_key_env) or None


@api.exception_handler(TimeoutError)
async def _deadline(_: Request, exc: TimeoutError) -> JSONResponse:
    return _error(503, str(exc), "server_error")


@api.exception_handler(GroupFailedError)
async def _group_failed(_: Request, exc: GroupFailedError) -> JSONResponse:
    return _error(503, str(exc), "server_error")


class UnknownModelError(LookupError):
    """The request names a model this deployment does not serve."""


@api.exception_handler(UnknownModelError)
async def _unknown_model(_: Request, exc: UnknownModelError) -> JSONResponse:
    return _error(404, str(exc), "invalid_request_error", "model")


@serve.deployment
@serve.ingress(api)
class HSDPServer:
    """One Serve replica = one shard group, placed in the replica's own placement group.

    Args:
        config: ``AppConfig`` fields as a dict (what the app builder passes).
    """

    def __init__(self, config: dict):
        self.config = AppConfig(**config)
        self.model_name = self.config.served_model_name
        # One replica per process: the middleware reads this process's settings from the app state.
        api.state.config = self.config
        api.state.api_key = read_api_key(self.config)
        placement = ray.util.get_current_placement_group()
        self.keeper = GroupKeeper(lambda: ShardGroup(self.config, placement_group=placement).start())

    @property
    def group(self) -> ShardGroup:
        """The replica's current shard group (failed or not)."""
        return self.keeper.group

    def _ready_group(self) -> ShardGroup:
        """The group, or a 503 while a failed one is rebuilt (the rebuild starts here if needed)."""
        current = self.keeper.current()
        if not current.done():
            raise GroupFailedError("the shard group failed and is being rebuilt; retry shortly")
        return current.result()

    async def generate(self, request: dict | ImageGenerationRequest, avoid_replica: str | None = None) -> dict:
        """Generates images for one request (the handle's entry point; HTTP uses the same path).

        A request with a seed whose shard group fails under it is retried once on another
        replica's group (the same seed gives the same images); the response then says
        ``"retried": true`` and carries the first failure in ``first_error``.

        Args:
            request: The ``/v1/images/generations`` body, as a dict or the schema object.
            avoid_replica: Set on a retry: the replica whose group failed it (the router steers
                clear of it; if it lands there anyway, it is refused at once). A retry is not
                retried again.

        Returns:
            The OpenAI images response: ``created``, ``data[i].b64_json``, plus ``seed``, ``rank``
            and ``retried``.
        """
        body = ImageGenerationRequest.model_validate(request)
        if body.model is not None and body.model != self.model_name:
            raise UnknownModelError(f"model {body.model!r} is not served here; available: [{self.model_name!r}]")
        me = serve.get_replica_context().replica_id.unique_id
        if avoid_replica == me:
            raise GroupFailedError("no other shard group could take the retry")
        job = to_generation_request(body, self.config, request_id=uuid.uuid4().hex)
        try:
            # A request that arrives while the group is rebuilt waits for it, within its deadline.
            deadline = job.timeout_s or self.config.request_timeout_s
            try:
                group = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.keeper.current())), deadline)
            except asyncio.TimeoutError:
                raise GroupFailedError(f"the shard group was still being rebuilt after {deadline:g}s") from None
            result = await asyncio.wrap_future(group.submit(job))
        except GroupFailedError as err:
            if body.seed is None or avoid_replica is not None or serve.get_replica_context().world_size < 2:
                raise
            return await self._retry_elsewhere(body, err, me)
        return {**image_response(result, self.model_name), "id": job.request_id, "retried": False}

    async def _retry_elsewhere(self, body: ImageGenerationRequest, error: GroupFailedError, me: str) -> dict:
        logger.warning("Retrying a seeded request on another shard group after: %s", error)
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        try:
            response = await handle.generate.remote(body.model_dump(exclude_none=True), avoid_replica=me)
        except ray.exceptions.RayTaskError as err:
            # The other replica's own error (429, 503, ...), without the remote traceback.
            cause = err.cause if err.cause is not None else err
            if isinstance(cause, GroupFailedError):
                raise GroupFailedError(f"{error}; the retry on another shard group failed too: {cause}") from None
            raise cause from None
        return {**response, "retried": True, "first_error": str(error)}

    def pool(self) -> dict:
        """Topology of this replica's group and each rank's memory report."""
        group = self._ready_group()
        replica = serve.get_replica_context().replica_id.unique_id
        return {**group.describe(), "replica": replica, "ranks": group.memory()}

    def progress(self) -> dict:
        """Request id -> state (queued, or running with its denoising step) of this replica's requests."""
        return self.group.progress()

    def record_routing_stats(self) -> dict:
        """What the router reads (``GroupAwareRouter``): whether this replica's group can serve now.

        Serve asks every ``request_routing_stats_period_s``, so a failed group also starts its
        rebuild here without waiting for a request or the health check.
        """
        self.keeper.current()
        return {GROUP_OK: self.keeper.ready}

    def check_health(self) -> None:
        """Serve's replica health check: every rank must answer within the deadline.

        A failed group is rebuilt in place, and counts as healthy meanwhile; one that could not
        be rebuilt does not, and Serve then replaces the replica.
        """
        current = self.keeper.current()
        if current.done():
            current.result().check_health()  # raises for a group that could not be rebuilt

    def __del__(self) -> None:
        keeper = getattr(self, "keeper", None)
        if keeper is not None:
            keeper.shutdown()

    @api.post("/v1/images/generations")
    async def images_generations(self, body: ImageGenerationRequest) -> dict:
        return await self.generate(body)

    @api.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "ray_hsdp"}]}

    @api.get("/health")
    def health(self) -> dict:
        self._ready_group().check_health()
        return {"status": "ok"}

    @api.get("/v1/pool")
    def pool_route(self) -> dict:
        return self.pool()
