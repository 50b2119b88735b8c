"""The one error table of the HTTP API and the handle: every exception a route or a request can
end with -> its HTTP status, OpenAI error type, the parameter it names, and whether to retry."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from ray_hsdp.group import (
    GroupFailedError,
    GroupOverloadedError,
    GroupUnplaceableError,
    remote_cause,
)
from ray_hsdp.request import InvalidRequestError, RequestCancelledError
from ray_hsdp.serve.jobs.records import StoreUnavailableError
from ray_hsdp.variant.lane import UnsplittableRequestError

logger = logging.getLogger("ray_hsdp")


def error_json(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse(status_code=status, content={"error": error})


class RequestLimitError(InvalidRequestError):
    """A request exceeds one of the server's configured limits."""


class ImageTooLargeError(RequestLimitError):
    """An input_reference image has more bytes than ``max_image_bytes`` (HTTP 413)."""


class UnknownModelError(LookupError):
    """The request names a model this deployment does not serve."""


class GroupLostError(RuntimeError):
    """The shard group running a request was lost (its replica's process or node died), and no
    other group of its model could run it."""


class ModelLoadingError(RuntimeError):
    """No group of the requested model has been ready yet (its application starts or warms up)."""


class VideoNotFoundError(LookupError):
    """No video job has this id (any more: deleted or expired)."""


class UnknownCursorError(VideoNotFoundError):
    """A list's ``after`` names no video job (any more)."""


class VideoNotReadyError(RuntimeError):
    """The video job has no content yet (or failed)."""


class VideoGoneError(RuntimeError):
    """A completed video job whose file is missing from the media store."""


class JobTableFullError(RuntimeError):
    """The video job table is at one of its limits."""


#: The one error table: exception class -> (HTTP status, OpenAI error type, the param it names,
#: whether the client should retry after ``retry_after_s``). The first class an error is an
#: instance of decides (more specific classes first); anything else is a 500 with its cause.
#: ``CODES`` gives some of them OpenAI's ``code`` too.
ERRORS: list[tuple[type[BaseException], int, str, str | None, bool]] = [
    (ImageTooLargeError, 413, "invalid_request_error", "input_reference", False),
    (RequestLimitError, 400, "invalid_request_error", None, False),
    (UnsplittableRequestError, 400, "invalid_request_error", "size", False),
    (UnknownModelError, 404, "invalid_request_error", "model", False),
    (UnknownCursorError, 404, "invalid_request_error", "after", False),
    (VideoNotFoundError, 404, "invalid_request_error", "video_id", False),
    (VideoNotReadyError, 409, "invalid_request_error", "video_id", False),
    (VideoGoneError, 410, "invalid_request_error", "video_id", False),
    (RequestCancelledError, 409, "invalid_request_error", None, False),  # deleted while a sync call waited
    (GroupOverloadedError, 429, "rate_limit_error", None, True),
    (JobTableFullError, 429, "rate_limit_error", None, True),
    (BackPressureError, 503, "server_error", None, True),  # Serve's own queue is full
    (GroupFailedError, 503, "server_error", None, True),
    (StoreUnavailableError, 503, "server_error", None, True),  # the job store's database does not answer
    (GroupLostError, 503, "server_error", None, True),
    (ModelLoadingError, 503, "server_error", "model", True),
    # A group's replica that died (its process, its node) under a call no one retries (pool, health).
    (RayActorError, 503, "server_error", None, True),
    (ActorUnavailableError, 503, "server_error", None, True),
    (GroupUnplaceableError, 503, "server_error", None, False),
    (TimeoutError, 504, "server_error", None, False),  # deadline or queue_timeout_s missed
    (InvalidRequestError, 400, "invalid_request_error", None, False),  # the group or the pipeline refused it
    (ValidationError, 400, "invalid_request_error", None, False),  # a body the schema refused (handle, form)
]
#: OpenAI's ``error.code`` of the errors that have one.
CODES: dict[type[BaseException], str] = {UnknownModelError: "model_not_found"}

#: A failed video job's error code, by the status its error would answer with.
JOB_ERROR_CODES = {400: "invalid_request", 413: "invalid_request", 409: "cancelled", 429: "overloaded",
                   503: "group_failed", 504: "timeout"}  # fmt: skip


#: A failed video job's error code -> the error a caller that waited for the job (``/v1/videos/sync``)
#: is answered with; any other code is a 500.
JOB_FAILURES: dict[str, type[BaseException]] = {
    "invalid_request": InvalidRequestError,
    "cancelled": RequestCancelledError,
    "overloaded": GroupOverloadedError,
    "group_failed": GroupFailedError,
    "replica_lost": GroupLostError,
    "drained": GroupLostError,
    "timeout": TimeoutError,
}


def job_failure(error: dict) -> BaseException:
    """The error of a failed job's ``error`` (``{"code", "message"}``), for its waiting caller."""
    return JOB_FAILURES.get(error["code"], RuntimeError)(error["message"])


def error_row(exc: BaseException) -> tuple[type[BaseException], int, str, str | None, bool] | None:
    """The row of ``ERRORS`` that answers ``exc`` (its remote cause), or None: a 500."""
    exc = remote_cause(exc)
    return next((row for row in ERRORS if isinstance(exc, row[0])), None)


def job_error_code(exc: BaseException) -> str:
    """The ``error.code`` of a video job that ``exc`` failed (by the one error table)."""
    row = error_row(exc)
    return JOB_ERROR_CODES.get(row[1], "internal_error") if row else "internal_error"


def error_response(exc: BaseException, retry_after_s: int) -> JSONResponse:
    """The JSON error answer of ``exc`` by ``ERRORS``; the message keeps its cause."""
    exc = remote_cause(exc)
    row = error_row(exc)
    if row is not None:
        cls, status, kind, param, retry = row
        response = error_json(status, str(exc), kind, param, CODES.get(cls))
        if retry:
            response.headers["Retry-After"] = str(retry_after_s)
        return response
    logger.error("Unexpected error answered with 500: %s: %s", type(exc).__name__, exc)
    return error_json(500, f"{type(exc).__name__}: {exc}", "server_error")
