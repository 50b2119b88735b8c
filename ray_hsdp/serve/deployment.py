"""The Serve deployment: one replica owns one shard group and answers HTTP and handle calls."""

import asyncio
import collections
import dataclasses
import hmac
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ray_hsdp.config import AppConfig
from ray_hsdp.group import (
    GroupFailedError,
    GroupOverloadedError,
    GroupUnplaceableError,
    QueueTimeoutError,
    ShardGroup,
    remote_cause,
)
from ray_hsdp.request import GenerationRequest, GenerationResult, InvalidRequestError, RequestCancelledError
from ray_hsdp.serve.jobs import DECODED, DENOISED
from ray_hsdp.serve.keeper import GroupKeeper
from ray_hsdp.serve.media import encode_mp4, encode_png
from ray_hsdp.serve.metrics import ReplicaMetrics
from ray_hsdp.serve.routing import GROUP_LOAD, GROUP_OK
from ray_hsdp.serve.schema import (
    ImageGenerationRequest,
    ImageTooLargeError,
    RequestLimitError,
    VideoCreateRequest,
    image_response,
    to_generation_request,
    to_video_request,
)
from ray_hsdp.topology import ParallelDims
from ray_hsdp.variant.lane import UnsplittableRequestError

logger = logging.getLogger("ray_hsdp")

api = FastAPI(title="ray_hsdp", description="FSDP2-sharded diffusion serving on Ray")


def show_logs() -> None:
    """Sends the ``ray_hsdp`` logger's INFO lines (the request log) to this process's stderr.

    Serve configures only its own ``ray.serve`` logger in a replica; without this, the one JSON
    line per request and the group's lifecycle lines would be dropped at the root logger's WARNING.
    """
    ours = logging.getLogger("ray_hsdp")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


class UnknownModelError(LookupError):
    """The request names a model this deployment does not serve."""


class VideoNotFoundError(LookupError):
    """No video job has this id (any more: deleted or expired)."""


class VideoNotReadyError(RuntimeError):
    """The video job has no content yet (or failed)."""


class JobTableFullError(RuntimeError):
    """The video job table is at one of its limits."""


#: The one error table: exception class -> (HTTP status, OpenAI error type, the param it names,
#: whether the client should retry after ``retry_after_s``). The first class an error is an
#: instance of decides (more specific classes first); anything else is a 500 with its cause.
ERRORS: list[tuple[type[BaseException], int, str, str | None, bool]] = [
    (ImageTooLargeError, 413, "invalid_request_error", "input_reference", False),
    (RequestLimitError, 400, "invalid_request_error", None, False),
    (UnsplittableRequestError, 400, "invalid_request_error", "size", False),
    (UnknownModelError, 404, "invalid_request_error", "model", False),
    (VideoNotFoundError, 404, "invalid_request_error", "video_id", False),
    (VideoNotReadyError, 409, "invalid_request_error", "video_id", False),
    (RequestCancelledError, 409, "invalid_request_error", None, False),  # deleted while a sync call waited
    (GroupOverloadedError, 429, "rate_limit_error", None, True),
    (JobTableFullError, 429, "rate_limit_error", None, True),
    (BackPressureError, 503, "server_error", None, True),  # Serve's own queue is full
    (GroupFailedError, 503, "server_error", None, True),
    (GroupUnplaceableError, 503, "server_error", None, False),
    (TimeoutError, 504, "server_error", None, False),  # deadline or queue_timeout_s missed
    (InvalidRequestError, 400, "invalid_request_error", None, False),  # the group or the pipeline refused it
    (ValidationError, 400, "invalid_request_error", None, False),  # a body the schema refused (handle, form)
]
#: A failed video job's error code, by the status its error would answer with.
JOB_ERROR_CODES = {400: "invalid_request", 413: "invalid_request", 409: "cancelled", 429: "overloaded",
                   503: "group_failed", 504: "timeout"}  # fmt: skip


def _error_row(exc: BaseException) -> tuple[type[BaseException], int, str, str | None, bool] | None:
    """The row of ``ERRORS`` that answers ``exc`` (its remote cause), or None: a 500."""
    exc = remote_cause(exc)
    return next((row for row in ERRORS if isinstance(exc, row[0])), None)


def job_error_code(exc: BaseException) -> str:
    """The ``error.code`` of a video job that ``exc`` failed (by the one error table)."""
    row = _error_row(exc)
    return JOB_ERROR_CODES.get(row[1], "internal_error") if row else "internal_error"


def error_response(exc: BaseException, retry_after_s: int) -> JSONResponse:
    """The JSON error answer of ``exc`` by ``ERRORS``; the message keeps its cause."""
    exc = remote_cause(exc)
    row = _error_row(exc)
    if row is not None:
        _, status, kind, param, retry = row
        response = _error(status, str(exc), kind, param)
        if retry:
            response.headers["Retry-After"] = str(retry_after_s)
        return response
    logger.error("Unexpected error answered with 500: %s: %s", type(exc).__name__, exc)
    return _error(500, f"{type(exc).__name__}: {exc}", "server_error")


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    first = next((e.get("loc") for e in exc.errors()), ())
    param = str(first[-1]) if first and first[-1] != "body" else None
    return _error(400, "; ".join(problems) or "invalid request", "invalid_request_error", param)


@api.exception_handler(ValidationError)
async def _invalid_model(request: Request, exc: ValidationError) -> JSONResponse:
    return await _invalid_request(request, RequestValidationError(exc.errors()))


#: The routes that take an input_reference image.
VIDEO_CREATE_ROUTES = ("/v1/videos", "/v1/videos/sync")


@api.middleware("http")
async def _guard(request: Request, call_next):
    """API key and body size, before any route runs; an error no handler took still answers JSON."""
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
        limit = config.max_body_bytes
        if path in VIDEO_CREATE_ROUTES:  # room for one input_reference, base64 taking 4/3 of its bytes
            limit += -(-config.max_image_bytes // 3) * 4
        if not length.isdigit() or int(length) > limit:
            what = " (max_body_bytes, plus max_image_bytes as base64 on the video routes)"
            return _error(413, f"request body larger than {limit} bytes{what}", "invalid_request_error")
    try:
        response = await call_next(request)
    except Exception as exc:  # noqa: BLE001 - every route error is answered here, by ERRORS
        response = error_response(exc, config.retry_after_s)
    # Which replica answered: jobs live in a table every replica reaches, so any may answer.
    response.headers["X-Ray-Hsdp-Replica"] = serve.get_replica_context().replica_id.unique_id
    return response


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


async def _video_body(request: Request) -> VideoCreateRequest:
    """The body of ``POST /v1/videos``: a multipart or urlencoded form (what the OpenAI client
    sends, ``input_reference`` as a file part) or JSON. Form values are strings; the schema reads
    numbers out of them."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form()
        except Exception as err:  # noqa: BLE001 - a malformed form is the client's error
            raise RequestLimitError(f"could not read the form: {err}") from None
        fields: dict = {}
        # A list in a form: the OpenAI client sends extra_body={"lora": [{"name", "scale"}, ...]} as
        # lora[][name] and lora[][scale] fields (all names, then all scales: it groups a form's
        # fields by key), and a list of names as repeated lora[]. The i-th scale is the i-th name's.
        listed: dict[str, list[str]] = {"lora[]": [], "lora[][name]": [], "lora[][scale]": []}
        for key, value in form.multi_items():
            if key in listed and isinstance(value, str):
                listed[key].append(value)
                continue
            if key in fields:
                raise RequestLimitError(f"{key} is given more than once")
            if not isinstance(value, str):  # a file part: the OpenAI client sends input_reference so
                if key != "input_reference":
                    raise RequestLimitError(f"{key} is a file; only input_reference takes one")
                value = await value.read()
            fields[key] = value
        names, scales = listed["lora[][name]"], listed["lora[][scale]"]
        if scales and len(scales) != len(names):
            raise RequestLimitError(
                f"lora[][scale] is given {len(scales)} times for {len(names)} lora[][name]: give every adapter a "
                "scale, or none"
            )
        adapters = listed["lora[]"] + [
            {"name": name, **({"scale": scales[i]} if scales else {})} for i, name in enumerate(names)
        ]
        if adapters:
            if "lora" in fields:
                raise RequestLimitError("lora is given both as a field and as a list (lora[])")
            fields["lora"] = adapters
    elif kind == "application/json":
        try:
            fields = await request.json()
        except ValueError as err:
            raise RequestLimitError(f"the body is not valid JSON: {err}") from None
        if not isinstance(fields, dict):
            raise RequestLimitError("the body must be a JSON object")
    else:
        raise RequestLimitError(
            f"unsupported content type {kind or '(none)'!r}: send multipart/form-data, a urlencoded form or JSON"
        )
    return VideoCreateRequest.model_validate(fields)


def _application_going() -> bool:
    """Whether this replica's whole application is being deleted (or Serve shut down)."""
    try:
        app = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception:  # noqa: BLE001 - no controller to ask: Serve itself is going
        return True
    return app is None or app.status == "DELETING"


class _VideoRun(NamedTuple):
    """A video job this replica runs: its task, and what another replica needs to take it over."""

    task: asyncio.Task
    job: GenerationRequest
    fps: int


@serve.deployment
@serve.ingress(api)
class HSDPServer:
    """One Serve replica = one shard group, placed in the replica's own placement group.

    Args:
        config: ``AppConfig`` fields as a dict (what the app builder passes).
        dims: The pool's mesh arithmetic, as the app builder computed it.
        jobs: The application's video job table (``VideoJobTable``'s handle).
    """

    def __init__(self, config: dict, dims: ParallelDims, jobs: DeploymentHandle):
        show_logs()
        self.config = AppConfig(**config)
        self.dims = dims
        self.model_name = self.config.served_model_name
        # One replica per process: the middleware reads this process's settings from the app state.
        api.state.config = self.config
        api.state.api_key = read_api_key(self.config)
        self._placement = ray.util.get_current_placement_group()
        self._replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = ReplicaMetrics(self.model_name)
        self.jobs = jobs
        #: Video id -> the job this replica runs (a drain hands them over).
        self._videos: dict[str, _VideoRun] = {}
        #: Ids this replica cancelled lately (ids are unique: a bounded memory is enough).
        self._cancelled: collections.deque[str] = collections.deque(maxlen=4096)
        self._draining = False
        self._stopping = threading.Event()
        self.keeper: GroupKeeper | None = None  # while None, the group is starting
        # Before the group's start, so that the metrics show it starting.
        threading.Thread(target=self._report_metrics, name="ray_hsdp-metrics", daemon=True).start()
        try:
            self.keeper = GroupKeeper(self._build_group)
        except BaseException:
            self._stopping.set()
            raise
        if self.config.video_takeover_after_s is not None:
            # Serve runs the constructor on the replica's event loop: the task starts once it returns
            # (held here: the loop keeps only a weak reference to its tasks).
            self._takeover = asyncio.get_running_loop().create_task(
                self._take_waiting_jobs(self.config.video_takeover_after_s)
            )

    def _build_group(self) -> ShardGroup:
        labels = {"replica": self._replica}
        group = ShardGroup(self.config, placement_group=self._placement, dims=self.dims, labels=labels)
        group.listeners.append(self.metrics.request_done)
        return group.start()

    def _report_metrics(self) -> None:
        """Every ``metrics_interval_s``: the group's queue and ranks, its failures, the job table."""
        while not self._stopping.wait(self.config.metrics_interval_s):
            try:
                self.metrics.state(self._state(), self._load())
                if self.keeper is None:
                    continue
                if self.keeper.ready:
                    group = self.keeper.group
                    self.metrics.group(group.group_id, *group.load(), group.tick_stats())
                self.metrics.keeper(self.keeper.failures, self.keeper.rebuilds)
                self.metrics.video_jobs(self.jobs.counts.remote().result(timeout_s=self.config.metrics_interval_s))
            except Exception as err:  # noqa: BLE001 - a missed poll is reported again at the next one
                logger.warning("Metrics poll failed: %s", err)

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

    async def _submit(self, job: GenerationRequest):
        """Hands ``job`` to the group; a group being rebuilt is waited for, as a queued request
        waits, until the job's ``queue_deadline`` (what is left of it is the group queue's).

        Returns:
            The group's future of the result.
        """
        deadline = job.queue_deadline or time.time() + self.config.queue_timeout_s
        wait_s = max(0.0, deadline - time.time())
        try:
            group = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.keeper.current())), wait_s)
        except asyncio.TimeoutError:
            raise QueueTimeoutError(
                "the shard group was still being rebuilt at the request's deadline "
                f"(queue_timeout_s={self.config.queue_timeout_s:g} from its arrival)"
            ) from None
        if job.request_id in self._cancelled:
            # Cancelled while it waited for the rebuild (the failed group held no record of it).
            raise RequestCancelledError(f"request {job.request_id!r} was cancelled before its group took it")
        return group.submit(job)

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

    async def _result(self, job: GenerationRequest, future=None) -> tuple[GenerationResult, str | None]:
        """The result of ``job`` (awaiting ``future``, or submitting it), and the failure it was
        retried after, if any: a job whose group fails under it is retried once on another replica's
        group (every request has a seed, drawn on arrival if the client sent none: the same seed
        gives the same output). A caller that goes away (its HTTP
        client disconnects) cancels it."""
        try:
            if future is None:
                future = await self._submit(job)
            return await asyncio.shield(asyncio.wrap_future(future)), None
        except asyncio.CancelledError:
            self._cancel(job.request_id)
            raise
        except GroupFailedError as err:
            if serve.get_replica_context().world_size < 2:
                raise
            return await self._retry_elsewhere(job, err), str(err)

    async def _retry_elsewhere(self, job: GenerationRequest, error: GroupFailedError) -> GenerationResult:
        logger.warning("Retrying a request on another shard group after: %s", error)
        if error.ran:  # it had waited its turn: the retry gets a wait of its own
            job = dataclasses.replace(job, queue_deadline=time.time() + self.config.queue_timeout_s)
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        try:
            return await handle.run_request.remote(job, avoid_replica=context.replica_id.unique_id)
        except ray.exceptions.RayTaskError as err:
            # The other replica's own error (429, 503, ...), without the remote traceback.
            cause = remote_cause(err)
            if isinstance(cause, GroupFailedError):
                raise GroupFailedError(f"{error}; the retry on another shard group failed too: {cause}") from None
            raise cause from None
        except BackPressureError as err:  # every other replica's queue is full
            raise GroupFailedError(f"{error}; no other shard group could take the retry now: {err}") from None

    async def run_request(self, job: GenerationRequest, avoid_replica: str | None = None) -> GenerationResult:
        """Runs a prepared request on this replica's group: how another replica retries one.

        Args:
            job: The request, defaults and limits applied.
            avoid_replica: The replica whose group failed it (the router steers clear of it; if it
                lands there anyway, it is refused at once). A retry is not retried again.
        """
        if avoid_replica == serve.get_replica_context().replica_id.unique_id:
            raise GroupFailedError("no other shard group could take the retry")
        return await asyncio.wrap_future(await self._submit(job))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise UnknownModelError(f"model {model!r} is not served here; available: [{self.model_name!r}]")

    async def generate(self, request: dict | ImageGenerationRequest) -> dict:
        """Generates images for one request (the handle's entry point; HTTP uses the same path).

        A request whose shard group fails under it is retried once on another
        replica's group; the response then says ``"retried": true`` and carries the first failure
        in ``first_error``.

        Args:
            request: The ``/v1/images/generations`` body, as a dict or the schema object.

        Returns:
            The OpenAI images response: ``created``, ``data[i].b64_json``, plus ``seed``, ``rank``,
            ``retried`` and the steps and guidance it ran with.
        """
        body = ImageGenerationRequest.model_validate(request)
        self._check_model(body.model)
        if self.group.pipeline_facts.get("image_input"):
            raise RequestLimitError(
                f"{self.model_name} is an image-to-video model: POST /v1/videos with the first frame as input_reference"
            )
        job = to_generation_request(body, self.config, request_id=uuid.uuid4().hex)
        self.group.check(job)
        result, first_error = await self._result(job)
        response = {
            **image_response(result, self.model_name),
            "id": job.request_id,
            "retried": first_error is not None,
            # What ran: the request's defaults may come from the app or from an adapter (lora_defaults).
            "num_inference_steps": job.num_inference_steps,
            "guidance_scale": job.guidance_scale,
            # None: the low-noise expert ran at guidance_scale (or the model has one expert).
            "guidance_scale_2": job.guidance_scale_2,
            "flow_shift": job.flow_shift,
        }
        return {**response, "first_error": first_error} if first_error else response

    # ---- video jobs ------------------------------------------------------------------------

    async def create_video(self, request: dict | VideoCreateRequest) -> dict:
        """Creates a video job (``POST /v1/videos``) and starts it; returns the video object at
        once, in every state of the group: while the group is rebuilt, the job waits queued (and
        another group with a free lane may take it over: ``video_takeover_after_s``)."""
        return await self._create_video(request, movable=True)

    async def _create_video(self, request: dict | VideoCreateRequest, movable: bool) -> dict:
        """``create_video``; a job that is not ``movable`` (a caller waits for it here) stays on this group."""
        body = VideoCreateRequest.model_validate(request)
        self._check_model(body.model)
        facts = self.group.pipeline_facts
        if not facts.get("video"):
            raise RequestLimitError(f"{self.model_name} makes images, not videos; use /v1/images/generations")
        job, fps = to_video_request(body, self.config, facts["temporal_compression"], request_id="")
        self.group.check(job)
        fields = {
            "model": self.model_name,
            "prompt": job.prompt,
            "size": f"{job.width}x{job.height}",
            "seconds": f"{job.num_frames / fps:g}",
            "num_frames": job.num_frames,
            "fps": fps,
            "seed": job.seed,
            "num_inference_steps": job.num_inference_steps,
            "guidance_scale": job.guidance_scale,
            "guidance_scale_2": job.guidance_scale_2,
            "flow_shift": job.flow_shift,
        }
        spec = (job, fps) if movable else None
        status, created = await self.jobs.create.remote(fields, self._replica, spec)
        if status == "full":
            raise JobTableFullError(created)
        job = dataclasses.replace(job, request_id=created["id"])
        future = None
        current = self.keeper.current()
        if current.done() and current.exception() is None:
            try:
                future = current.result().submit(job)
            except GroupOverloadedError:
                await self.jobs.delete.remote(created["id"])
                raise
            except GroupFailedError:
                pass  # it failed just now: the job's task waits for the rebuild, or retries elsewhere
        self._start_video(created["id"], job, fps, future)
        return created

    def _start_video(self, video_id: str, job: GenerationRequest, fps: int, future=None) -> None:
        """Runs a video job in the background on this replica's group, to its MP4 in the table."""
        task = asyncio.create_task(self._run_video(video_id, job, fps, future))
        self._videos[video_id] = _VideoRun(task, job, fps)
        task.add_done_callback(lambda _: self._videos.pop(video_id, None))

    async def adopt_video(self, video_id: str, job: GenerationRequest, fps: int, avoid_replica: str) -> bool:
        """Takes over a video job from a replica being removed (its drain timed out): its seed
        makes the same video here. Returns once the job runs here (False: the job is gone).

        Raises:
            GroupFailedError: This is the replica to avoid, or it is being removed too.
        """
        if avoid_replica == self._replica or self._draining:
            raise GroupFailedError("this shard group is being removed too; it cannot take the job over")
        if not await self.jobs.update.remote(video_id, self._replica, retried=True):
            return False  # deleted or expired meanwhile: nothing to take over
        # It ran on the removed group: here it gets a wait of its own.
        job = dataclasses.replace(job, queue_deadline=time.time() + self.config.queue_timeout_s)
        self._start_video(video_id, job, fps)
        return True

    async def _take_waiting_jobs(self, waited_s: float) -> None:
        """While this group has free lanes and nothing queued: takes over the video jobs that have
        waited queued for ``waited_s`` on other, busy groups, one per free lane (the job table
        picks the oldest; their first replicas stop their copies at their next report)."""
        while not self._stopping.is_set():
            await asyncio.sleep(waited_s / 2)
            if self._draining or self.keeper is None or not self.keeper.ready:
                continue
            group = self.keeper.group
            queued, running = group.load()
            # The group's requests, and this replica's jobs not handed to it yet.
            for _ in range(group.running_capacity - max(queued + running, len(self._videos))):
                try:
                    taken = await self.jobs.take_waiting.remote(self._replica, waited_s)
                except Exception as err:  # noqa: BLE001 - the table answers again at the next round
                    logger.warning("Asking the job table for waiting video jobs failed: %s", err)
                    break
                if taken is None:
                    break
                video_id, (job, fps) = taken
                if video_id in self._videos:
                    continue  # released back to its first replica before it had stopped its copy: it runs on
                job = dataclasses.replace(job, request_id=video_id)
                try:  # requests that came in while the table answered may have filled the group
                    future = group.submit(job)
                except (GroupOverloadedError, GroupFailedError) as err:
                    logger.info("Could not take over video job %s: %s", video_id, err)
                    await self.jobs.release.remote(video_id, self._replica)
                    break
                logger.info("Took over video job %s, which waited queued on a busy shard group", video_id)
                self._start_video(video_id, job, fps, future)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaling policy sizes the pool on (``ray_hsdp.serve.autoscaling``):
        requests the group holds, queued or running, video jobs included; a group being rebuilt
        counts its waiting video jobs."""
        from ray_hsdp.serve.autoscaling import LOAD_METRIC

        return {LOAD_METRIC: float(self._load())}

    def _state(self) -> str:
        """The group's state, one of ``GROUP_STATES``."""
        if self._draining:
            return "draining"
        if self.keeper is None:
            return "starting"
        if self.keeper.broken:
            return "failed"
        return "serving" if self.keeper.ready else "rebuilding"

    def _load(self) -> int:
        """Requests the group holds, queued or running, video jobs included; while the group is
        rebuilt, the video jobs waiting for it."""
        load = len(self._videos)
        if self.keeper is not None and self.keeper.ready:
            load = max(load, sum(self.keeper.group.load()))
        return load

    async def _run_video(self, video_id: str, job: GenerationRequest, fps: int, future) -> BaseException | None:
        """Runs a job to its MP4 in the table; returns the error that failed it, if any."""
        reporter = asyncio.create_task(self._report_progress(video_id, job.request_id))
        try:
            result, _ = await self._result(job, future)
            await self.jobs.update.remote(video_id, self._replica, progress=DECODED)
            frames = result.frames[0]
            mp4 = await asyncio.to_thread(encode_mp4, frames, fps)  # off the event loop, far from any tick
            await self.jobs.complete.remote(video_id, mp4, encode_png(frames[0]), self._replica)
            return None
        except RequestCancelledError as err:
            return err  # deleted: nothing is kept
        except Exception as err:  # noqa: BLE001 - the job says why it failed
            err = remote_cause(err)
            logger.warning("Video job %s failed: %s", video_id, err)
            await self.jobs.fail.remote(video_id, job_error_code(err), str(err), self._replica)
            return err
        finally:
            reporter.cancel()

    async def _report_progress(self, video_id: str, request_id: str) -> None:
        """Reports a job's progress to the table (also its heartbeat, queued or running) until it
        ends; a job deleted meanwhile, or failed by the table's sweep, is cancelled here."""
        while True:
            try:
                state = (await asyncio.to_thread(self.group.progress)).get(request_id)
            except Exception:  # noqa: BLE001 - a failed group answers the job itself
                state = None
            running = state is not None and state["state"] == "running"
            progress = DENOISED * state["step"] // max(state["total"], 1) if running else None
            if not await self.jobs.update.remote(video_id, self._replica, progress=progress, running=running):
                self._cancel(request_id)
                return
            await asyncio.sleep(0.25)

    async def video(self, video_id: str) -> dict:
        """The video object of a job."""
        found = await self.jobs.get.remote(video_id)
        if found is None:
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        return found

    async def video_content(self, video_id: str, variant: str = "video") -> bytes:
        """The MP4 of a completed job, or its first frame as PNG (``variant="thumbnail"``)."""
        if variant not in ("video", "thumbnail"):
            raise RequestLimitError(f"variant must be 'video' or 'thumbnail', got {variant!r}")
        status, content = await self.jobs.content.remote(video_id, variant)
        if status == "missing":
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        if status == "not_ready":
            raise VideoNotReadyError(f"video {video_id!r} is {content}; its content exists once it is completed")
        return content

    async def delete_video(self, video_id: str) -> dict:
        """Deletes a job: a queued one is dropped, a running one stops at its next step without
        decoding; afterwards the id is 404. The replica that runs it stops it: at once when that
        is this one, else at its next report to the table (every 0.25 s)."""
        if not await self.jobs.delete.remote(video_id):
            raise VideoNotFoundError(f"no video {video_id!r} (never created, deleted, or expired)")
        if video_id in self._videos:
            self._cancel(video_id)  # a job's request id is its video id
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def generate_video(self, request: dict | VideoCreateRequest) -> dict:
        """Creates a video job and waits for it (the handle's entry point); it runs on this
        replica's group.

        Returns:
            ``{"video": the video object, "mp4": the MP4's bytes}``; raises if the job failed.
        """
        created = await self._create_video(request, movable=False)
        error = await asyncio.shield(self._videos[created["id"]].task)
        if error is not None:
            raise error  # answered by its own class: bad input 400, deadline 504, broken group 503
        video = await self.video(created["id"])
        return {"video": video, "mp4": await self.video_content(created["id"])}

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
        ``drain_timeout_s`` to finish; then each is handed to another replica (one that none takes
        fails with the reason). Only then does the group shut down. (Serve has stopped routing
        requests here and waited for the ongoing ones before it calls this.) When the whole
        application goes, the group shuts down at once."""
        if getattr(self, "_draining", False):  # once: Serve calls it, the garbage collector may again
            return
        self._draining = True
        tasks = {video_id: run.task for video_id, run in getattr(self, "_videos", {}).items()}
        # When the whole application goes (serve.delete, shutdown), its job table goes with it:
        # nothing would keep a drained job's video.
        if tasks and not await asyncio.to_thread(_application_going):
            logger.info("Draining %d video jobs (drain_timeout_s=%g)", len(tasks), self.config.drain_timeout_s)
            await asyncio.wait(tasks.values(), timeout=self.config.drain_timeout_s)
            for video_id, task in tasks.items():
                if not task.done():
                    await self._hand_over(video_id, task)
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
        keeper = getattr(self, "keeper", None)
        if keeper is not None:
            keeper.shutdown()

    async def _hand_over(self, video_id: str, task: asyncio.Task) -> None:
        """A job still running when this replica's drain ends: another replica takes it over (its
        seed makes the same video there), or it fails with the reason. Its run here stops either way."""
        run = self._videos.get(video_id)
        if run is None:  # it ended meanwhile
            return
        _, job, fps = run
        handed = False
        reason = "no other shard group took it over"
        # (The replica context's world size already counts this replica out.)
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        try:
            handed = await handle.adopt_video.remote(video_id, job, fps, self._replica)
        except Exception as err:  # noqa: BLE001 - the job then fails here with the reason
            reason = f"no other shard group could take it over ({remote_cause(err)})"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if handed:
            logger.info("Video job %s handed to another shard group", video_id)
            return
        message = (
            f"the shard group running it was removed and drain_timeout_s={self.config.drain_timeout_s:g} passed; "
            f"{reason}"
        )
        await self.jobs.fail.remote(video_id, "drained", message, self._replica)

    @api.post("/v1/images/generations")
    async def images_generations(self, body: ImageGenerationRequest) -> dict:
        return await self.generate(body)

    @api.post("/v1/videos")
    async def videos_create(self, request: Request) -> dict:
        return await self.create_video(await _video_body(request))

    @api.post("/v1/videos/sync")
    async def videos_create_sync(self, request: Request) -> Response:
        out = await self.generate_video(await _video_body(request))
        return Response(out["mp4"], media_type="video/mp4", headers={"X-Video-Id": out["video"]["id"]})

    @api.get("/v1/videos")
    async def videos_list(self, limit: int = 20, after: str | None = None, order: str = "desc") -> dict:
        if not 1 <= limit <= 100:
            raise RequestLimitError(f"limit must be between 1 and 100, got {limit}")
        if order not in ("asc", "desc"):
            raise RequestLimitError(f"order must be 'asc' or 'desc', got {order!r}")
        page = await self.jobs.list.remote(limit, after, order)
        if page is None:
            raise VideoNotFoundError(f"after={after!r} names no video")
        return page

    @api.get("/v1/videos/{video_id}")
    async def videos_retrieve(self, video_id: str) -> dict:
        return await self.video(video_id)

    @api.get("/v1/videos/{video_id}/content")
    async def videos_content(self, video_id: str, variant: str = "video") -> Response:
        content = await self.video_content(video_id, variant)
        return Response(content, media_type="video/mp4" if variant == "video" else "image/png")

    @api.delete("/v1/videos/{video_id}")
    async def videos_delete(self, video_id: str) -> dict:
        return await self.delete_video(video_id)

    @api.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "ray_hsdp"}]}

    @api.get("/v1/loras")
    def loras(self) -> dict:
        """The LoRA adapters: those requests may name (``lora``) and those merged into the weights
        (``fused``: the scale every request runs them at), with the components each adapts and the
        defaults a request gets from it."""
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "lora",
                    "components": sorted(parts),
                    "fused": self.config.fuse_loras.get(name),
                    "defaults": self.config.lora_defaults[name].model_dump(exclude_none=True)
                    if name in self.config.lora_defaults
                    else {},
                }
                for name, parts in sorted(self.config.lora_sources().items())
            ],
            "max_loras_per_request": self.config.max_loras_per_request,
        }

    @api.get("/health")
    def health(self) -> dict:
        self._ready_group().check_health()
        return {"status": "ok"}

    @api.get("/v1/pool")
    def pool_route(self) -> dict:
        return self.pool()
