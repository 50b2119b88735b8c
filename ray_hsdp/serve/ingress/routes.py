"""The HTTP side of the application's ingress, as Ray Serve LLM splits it: the FastAPI app, its
guard (API key, body size), the error answers (``errors``), how a video body is read, and the
OpenAI-shaped routes: functions of the ingress replica this process serves (``ingress.server.OpenAIIngress``).

No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations as types."""

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from ray_hsdp.config.endpoint import EndpointConfig
from ray_hsdp.serve.errors import (
    ModelLoadingError,
    RequestLimitError,
    error_json,
    error_response,
)
from ray_hsdp.serve.ingress import chat
from ray_hsdp.serve.ingress.keys import KeyCheck
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest

logger = logging.getLogger("ray_hsdp")

api = FastAPI(title="ray_hsdp", description="FSDP2-sharded diffusion serving on Ray")


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    first = next((e.get("loc") for e in exc.errors()), ())
    param = str(first[-1]) if first and first[-1] != "body" else None
    return error_json(400, "; ".join(problems) or "invalid request", "invalid_request_error", param)


@api.exception_handler(ValidationError)
async def _invalid_model(request: Request, exc: ValidationError) -> JSONResponse:
    return await _invalid_request(request, RequestValidationError(exc.errors()))


#: The routes whose body may carry an input_reference image (a first frame, or FLUX.2's reference):
#: keyed on the route, since the guard runs before the body (and its ``model``) is read.
IMAGE_INPUT_ROUTES = ("/v1/images/generations", "/v1/videos", "/v1/videos/sync", "/v1/chat/completions")


def _ingress():
    """The ingress replica this process serves (what Serve hands a class's routes as ``self``; its
    constructor has run: Serve routes nothing here before)."""
    return serve.get_replica_context().servable_object


@api.middleware("http")
async def _guard(request: Request, call_next):
    """API key and body size, before any route runs; an error no handler took still answers JSON."""
    server = _ingress()
    config: EndpointConfig = server.config
    key: KeyCheck | None = server.key_check
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))  # route prefix of the app
    if key and path != "/health" and not has_key(request, key):
        response = error_json(
            401,
            "missing or wrong API key (send 'Authorization: Bearer <key>')",
            "authentication_error",
            code="invalid_api_key",
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    if request.method in ("POST", "PUT", "PATCH"):
        length = request.headers.get("content-length")
        if length is None:
            return error_json(411, "a request body needs a Content-Length header", "invalid_request_error")
        limit = config.max_body_bytes
        if path in IMAGE_INPUT_ROUTES:  # room for one input_reference, base64 taking 4/3 of its bytes
            limit += -(-config.max_image_bytes // 3) * 4
        if not length.isdigit() or int(length) > limit:
            what = " (max_body_bytes, plus max_image_bytes as base64 on the routes that take an input_reference)"
            return error_json(413, f"request body larger than {limit} bytes{what}", "invalid_request_error")
    try:
        response = await call_next(request)
    except Exception as exc:  # noqa: BLE001 - every route error is answered here, by ERRORS
        response = error_response(exc, config.retry_after_s)
    # Which ingress replica answered.
    response.headers["X-Ray-Hsdp-Replica"] = serve.get_replica_context().replica_id.unique_id
    return response


def has_key(request: Request, key: KeyCheck | None) -> bool:
    """Whether the request carries the key (``Authorization: Bearer <key>``), or none is asked for."""
    if key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and key.matches(token)


def serve_http_options() -> tuple[str | None, int | None]:
    """The address and port Serve's HTTP proxies listen on; ``None`` where they cannot be read."""
    try:
        from ray.serve.context import _get_global_client  # Serve has no public reader of its HTTP options

        http = _get_global_client().http_config
        return http.host, http.port
    except Exception:  # noqa: BLE001 - unknown: treated as open to strangers (refuse_keyless)
        return None, None


def serve_http_host() -> str | None:
    """The address Serve's HTTP proxies listen on; ``None`` when it cannot be read."""
    return serve_http_options()[0]


def refuse_keyless(api_key: KeyCheck | str | None, config: EndpointConfig, host: str | None, app: str = "") -> None:
    """Refuses to serve with no key where strangers may reach the server: a HTTP host that is not
    a loopback address (or is unknown), unless ``allow_unauthenticated``.

    Raises:
        ValueError: Naming every way to give a key.
    """
    loopback = host is not None and (host == "localhost" or host == "::1" or host.startswith("127."))
    if api_key or loopback or config.allow_unauthenticated:
        return
    raise ValueError(
        f"no API key, and Serve's HTTP host {host or '(unknown)'} is not a loopback address: give a key in "
        f"{config.api_key_env} in every node's environment, in a file at api_key_file on every node, or with "
        "ray-hsdp serve (it carries its own environment's key), or stored in the cluster with "
        f"`ray-hsdp key set --app {app or 'APP'}` before the deploy; or bind Serve to 127.0.0.1; or set "
        "allow_unauthenticated: true to serve anyone who reaches the port"
    )


async def video_body(request: Request) -> VideoCreateRequest:
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


# The routes of the HTTP API; each calls the ingress replica's method of the same concern.


@api.post("/v1/images/generations")
async def images_generations(body: ImageGenerationRequest) -> dict:
    return await _ingress().generate(body)


@api.post("/v1/videos")
async def videos_create(request: Request) -> dict:
    return await _ingress().create_video(await video_body(request))


@api.post("/v1/videos/sync")
async def videos_create_sync(request: Request) -> Response:
    started = time.perf_counter()
    out = await _ingress().generate_video(await video_body(request))
    video = out["video"]
    headers = {
        "X-Video-Id": video["id"],
        # vllm-omni's names: its clients read these. (X-Request-Id is Serve's own: the id of
        # this HTTP request in Serve's logs, the client's own when it sent one.)
        "X-Model": str(video.get("model", "")),
        "X-Inference-Time-S": f"{time.perf_counter() - started:.3f}",
    }
    return Response(out["mp4"], media_type="video/mp4", headers=headers)


@api.post("/v1/chat/completions")
async def chat_completions(request: Request) -> dict:
    """vllm-omni's chat route for an image or video model (``serve.ingress.chat``): the last user
    message is the prompt, and the answer carries the image(s) or the MP4 as data URLs."""
    try:
        body = await request.json()
    except ValueError as err:
        raise RequestLimitError(f"the body is not valid JSON: {err}") from None
    ask = chat.read_chat(body)
    ingress = _ingress()
    model = ingress.model_of(ask.model)
    kind = ingress.watch.entry(model).get("kind")
    if kind is None:
        raise ModelLoadingError(f"model {model!r} is loading: no shard group of it has answered yet; retry shortly")
    if kind == "video":
        return chat.video_answer(model, await ingress.generate_video(ask.video_body()))
    return chat.image_answer(model, await ingress.generate(ask.image_body()))


@api.get("/v1/videos")
async def videos_list(limit: int = 20, after: str | None = None, order: str = "desc") -> dict:
    return await _ingress().jobs.page(limit, after, order)


@api.get("/v1/videos/{video_id}")
async def videos_retrieve(video_id: str) -> dict:
    return await _ingress().video(video_id)


@api.get("/v1/videos/{video_id}/content")
async def videos_content(video_id: str, variant: str = "video") -> Response:
    content = await _ingress().video_content(video_id, variant)
    return Response(content, media_type="video/mp4" if variant == "video" else "image/png")


@api.delete("/v1/videos/{video_id}")
async def videos_delete(video_id: str) -> dict:
    return await _ingress().delete_video(video_id)


@api.get("/v1/models")
async def models_list() -> dict:
    return await _ingress().models()


@api.get("/v1/loras")
async def loras_list(model: str | None = None) -> dict:
    """The LoRA adapters of a model (or of each): those requests may name (``lora``) and those
    merged into the weights (``fused``: the scale every request runs them at), with the
    components each adapts and the defaults a request gets from it."""
    return await _ingress().loras(model)


@api.get("/health")
async def health_route(request: Request, model: str | None = None) -> JSONResponse:
    """200 while the endpoint can answer for one model at least (``?model=ID``: while that
    model has a ready group), else 503 with ``Retry-After``: a readiness probe of the endpoint
    that one model's outage does not fail, and one of each model. Each model's state; why a
    model's check failed only for a caller with the key (no key asked for: any caller)."""
    ingress = _ingress()
    body = await ingress.health(model)
    if not has_key(request, ingress.key_check):
        body.pop("errors")
    if body["status"] == "ok":
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(ingress.config.retry_after_s)})


@api.get("/v1/pool")
async def pool_route(model: str | None = None) -> dict:
    return await _ingress().pool(model)
