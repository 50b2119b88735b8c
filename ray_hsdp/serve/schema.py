"""HTTP and handle request/response schema, OpenAI-shaped, and its mapping to a generation request."""

from __future__ import annotations

import base64
import dataclasses
import secrets
import time
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from ray_hsdp import deadlines
from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import LoraDefaults
from ray_hsdp.request import (
    GenerationRequest,
    GenerationResult,
    fit_image,
    parse_lora,
    parse_size,
)
from ray_hsdp.serve.errors import ImageTooLargeError, RequestLimitError
from ray_hsdp.serve.media import encode_image, frames_for_seconds
from ray_hsdp.serve.request_fields import GenerationFields, guidance_of, solver_of


class ImageGenerationRequest(GenerationFields):
    """``POST /v1/images/generations``: OpenAI's fields plus the diffusers extensions (those shared
    with the video route are ``GenerationFields``'). A JSON body: its values must have their types
    (no numbers as text)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    n: int = Field(1, ge=1, description="Number of images.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Images come back as base64 (b64_json).")
    output_format: Literal["png", "jpeg", "webp"] = Field(
        "png",
        description="File format of each image (OpenAI's): png (lossless, fast zlib level), or jpeg and webp "
        "(lossy, smaller, at output_compression's quality; jpeg is the fastest to encode).",
    )
    output_compression: int | None = Field(
        None,
        ge=0,
        le=100,
        description="Quality of a jpeg or webp image, 0-100 (OpenAI's name); 100 when omitted. A png is lossless "
        "and takes none.",
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Deadline once a rank takes the request; the server's request_timeout_s when omitted."
    )
    input_reference: str | dict | None = Field(
        None,
        description="A reference image for a model that takes one (FLUX.2: a subject or an edit): PNG, JPEG or WebP "
        "as base64, a data: URL or {'image_url': 'data:...'}; fitted to the size (cover, then centre crop). A model "
        "that makes images from text alone refuses it.",
    )

    @model_validator(mode="after")
    def _compression_of_a_lossy_format(self) -> ImageGenerationRequest:
        if self.output_compression is not None and self.output_format == "png":
            raise ValueError("output_compression is the quality of a jpeg or webp image; a png is lossless")
        return self


INLINE_ONLY = "only inline images are taken: a file part of the form, base64, or a data: URL of the image"


def image_type(data: bytes) -> str | None:
    """``"png"``, ``"jpeg"`` or ``"webp"`` from the image's first bytes (clients often send files as
    ``application/octet-stream``, so the bytes decide); ``None`` for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def reference_image(value: bytes | str | dict, config: AppConfig) -> bytes:
    """The image bytes of an ``input_reference`` in any form a client sends it: bytes (a file part
    of the form, or the handle), a base64 string, a ``data:`` URL, or OpenAI's object form
    ``{"image_url": "data:..."}``.

    Raises:
        RequestLimitError: A URL or ``file_id`` (only inline images are taken), bad base64, a data
            URL of another type, bytes that are no PNG, JPEG or WebP, or more pixels than
            ``max_image_pixels``.
        ImageTooLargeError: More bytes than ``max_image_bytes``.
    """
    import binascii
    import io

    from PIL import Image

    if isinstance(value, dict):
        if "file_id" in value:
            raise RequestLimitError(f"input_reference.file_id: uploaded files are not kept here; {INLINE_ONLY}")
        url = value.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or set(value) - {"image_url"}:
            raise RequestLimitError(
                f"input_reference as an object takes one field, image_url (a data: URL); {INLINE_ONLY}"
            )
        value = url
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("http://", "https://")):
            raise RequestLimitError(f"input_reference is a URL; {INLINE_ONLY}")
        if text.startswith("data:"):
            head, _, text = text.partition(",")
            media = head.removeprefix("data:").split(";")[0].strip().lower()
            if media not in ("image/png", "image/jpeg", "image/webp") or ";base64" not in head:
                raise RequestLimitError(
                    f"input_reference is a data URL of {media or 'no type'!r}"
                    f"{'' if ';base64' in head else ' without base64'}: "
                    "send image/png, image/jpeg or image/webp as base64"
                )
        if len(text) > (config.max_image_bytes + 2) // 3 * 4 + 4:
            raise ImageTooLargeError(f"input_reference is larger than max_image_bytes={config.max_image_bytes}")
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestLimitError("input_reference is not valid base64 (nor a data: URL)") from None
    if not isinstance(value, bytes | bytearray):
        raise RequestLimitError(
            f"input_reference must be an image (bytes, base64 or a data: URL), not {type(value).__name__}"
        )
    data = bytes(value)
    if not data:
        raise RequestLimitError("input_reference is empty")
    if len(data) > config.max_image_bytes:
        raise ImageTooLargeError(
            f"input_reference is {len(data)} bytes; the limit is max_image_bytes={config.max_image_bytes}"
        )
    if image_type(data) is None:
        raise RequestLimitError("input_reference is not a PNG, JPEG or WebP image")
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
    except Image.DecompressionBombError:
        raise RequestLimitError(
            f"input_reference has more pixels than can be opened safely; the limit is "
            f"max_image_pixels={config.max_image_pixels}"
        ) from None
    except Exception as err:  # noqa: BLE001 - whatever PIL makes of a broken header is the client's error
        raise RequestLimitError(f"input_reference could not be read as an image ({err})") from None
    if width * height > config.max_image_pixels:
        raise RequestLimitError(
            f"input_reference is {width}x{height} pixels; the limit is max_image_pixels={config.max_image_pixels}"
        )
    if width < 1 or height < 1:
        raise RequestLimitError(f"input_reference is {width}x{height} pixels")
    return data


#: The request fields an adapter's ``lora_defaults`` may fill in: those ``LoraDefaults`` declares.
DEFAULTED = tuple(LoraDefaults.model_fields)
#: The schedule a request ran with, as its answer says it: the fields an adapter defaults, and the solver.
SCHEDULE = (*DEFAULTED, "sample_solver")


def to_generation_request(body: ImageGenerationRequest, config: AppConfig, request_id: str) -> GenerationRequest:
    """Applies the server's defaults and limits to an HTTP or handle request.

    Raises:
        RequestLimitError: ``n``, the step count or the pixel count is above the configured cap.
    """
    for field in ("prompt", "negative_prompt"):
        text = getattr(body, field)
        if text is not None and len(text) > config.max_prompt_chars:
            raise RequestLimitError(f"{field} has {len(text)} characters; the limit is {config.max_prompt_chars}")
    width, height = parse_size(body.size or config.default_size)
    if width * height > config.max_pixels:
        raise RequestLimitError(f"size {width}x{height} exceeds the limit of {config.max_pixels} pixels")
    if body.n > config.max_n:
        raise RequestLimitError(f"n={body.n} exceeds the limit max_n={config.max_n}")
    try:
        lora = parse_lora(body.lora)
        cache = config.cache.resolve(body.cache)
    except ValueError as err:
        raise RequestLimitError(str(err)) from None
    try:
        given = frozenset(f for f in DEFAULTED if getattr(body, f) is not None) | (
            {"guidance_scale"} if body.true_cfg_scale is not None else set()
        )
        defaults = config.request_defaults(lora, given)
    except ValueError as err:
        raise RequestLimitError(str(err)) from None
    steps, sigmas = _schedule(body, defaults)
    if steps > config.max_steps:
        raise RequestLimitError(f"num_inference_steps={steps} exceeds the limit max_steps={config.max_steps}")
    if body.timeout_s is not None and body.timeout_s > config.request_timeout_s:
        raise RequestLimitError(
            f"timeout_s={body.timeout_s} exceeds the limit request_timeout_s={config.request_timeout_s}"
        )
    guidance = guidance_of(body)
    guidance = guidance if guidance is not None else defaults["guidance_scale"]
    # An omitted guidance_scale_2 follows guidance_scale: an adapter's default for it comes with its
    # default for guidance_scale, and yields to a request's own guidance_scale.
    if body.guidance_scale_2 is not None:
        guidance_2 = body.guidance_scale_2
    else:
        guidance_2 = defaults.get("guidance_scale_2") if guidance_of(body) is None else None
    shift = body.flow_shift if body.flow_shift is not None else defaults.get("flow_shift")
    boundary = body.boundary_ratio if body.boundary_ratio is not None else defaults.get("boundary_ratio")
    image = None
    if body.input_reference is not None:
        image = fit_image(reference_image(body.input_reference, config), width, height)
    return GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        guidance_scale_2=float(guidance_2) if guidance_2 is not None else None,
        flow_shift=float(shift) if shift is not None else None,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        n=body.n,
        request_id=request_id,
        timeout_s=float(body.timeout_s) if body.timeout_s is not None else None,
        lora=lora,
        cache=cache,
        lane_size=body.lane_size,
        deadline=deadlines.due(body.deadline_s),
        queue_deadline=deadlines.from_arrival(config),  # one deadline from arrival, wherever it waits
        image=image,
        size_given=body.size is not None,
        uint8_frames=True,  # cast on the rank's device: a quarter of float32's bytes reach the replica
        boundary_ratio=float(boundary) if boundary is not None else None,
        sample_solver=solver_of(body) or config.sample_solver,
        sigmas=sigmas,
    )


def _schedule(body, defaults: dict) -> tuple[int, tuple[float, ...] | None]:
    """The request's steps and sigmas: its own sigmas set its steps (a count given beside them
    must match); an adapter's default sigmas apply where the request gives no steps of its own."""
    if body.sigmas is not None:
        if body.num_inference_steps is not None and body.num_inference_steps != len(body.sigmas):
            raise RequestLimitError(
                f"sigmas has {len(body.sigmas)} values for num_inference_steps={body.num_inference_steps}: one per "
                "step (leave num_inference_steps out)"
            )
        return len(body.sigmas), tuple(body.sigmas)
    if body.num_inference_steps is None and defaults.get("sigmas"):
        return len(defaults["sigmas"]), tuple(defaults["sigmas"])
    return body.num_inference_steps or defaults["num_inference_steps"], None


def what_ran(request: GenerationRequest) -> dict:
    """The schedule a request ran with, for its answer (an image response, a video object): its body's,
    else the app's defaults or an adapter's (``lora_defaults``). ``guidance_scale_2`` None: the
    low-noise expert ran at ``guidance_scale`` (or the model has one expert)."""
    ran = {name: getattr(request, name) for name in SCHEDULE}
    return {**ran, "sigmas": list(request.sigmas) if request.sigmas is not None else None}


def with_seed(body: ImageGenerationRequest | VideoCreateRequest):
    """``body`` with a seed drawn now where it has none: where it runs again (a retry on another
    group) it then makes the same output."""
    return body if body.seed is not None else body.model_copy(update={"seed": secrets.randbelow(2**31)})


def image_response(
    result: GenerationResult, model: str, output_format: str = "png", quality: int | None = None
) -> dict:
    """The OpenAI images response for one result, with our ``seed`` and ``rank`` extensions.

    Encodes each image as ``output_format`` (at ``quality`` for jpeg and webp): it takes hundreds of
    milliseconds for a large PNG, so a server calls this off its event loop."""
    images = [encode_image(image[0], output_format, quality) for image in result.frames]
    return {
        "created": int(time.time()),
        "model": model,
        "data": [{"b64_json": base64.b64encode(data).decode("ascii")} for data in images],
        "output_format": output_format,
        "seed": result.seed,
        "rank": result.rank,
        "elapsed_s": round(result.elapsed_s, 4),
        **({"cached_forwards": result.cached_forwards} if result.cached_forwards is not None else {}),
    }


class VideoCreateRequest(GenerationFields):
    """``POST /v1/videos``: OpenAI's fields plus the diffusers extensions (those shared with the image
    route are ``GenerationFields``').

    Numbers may come as strings: the OpenAI client sends this body as a multipart form.
    """

    width: int | None = Field(
        None, ge=16, description="vllm-omni's form of size: with height (both or neither); if size is given too, "
        "they must agree."
    )  # fmt: skip
    height: int | None = Field(None, ge=16, description="See width.")
    seconds: float | None = Field(
        None, gt=0, description="Clip length; frames = the nearest count the VAE takes at the model's frame rate."
    )
    num_frames: int | None = Field(
        None,
        ge=1,
        description="Frames; wins over seconds when both are given. A count the model's VAE does not take (Wan: 4k+1) "
        "is rounded to one as diffusers rounds it (80 makes 81: 4 * (80 // 4) + 1); the video's num_frames "
        "says what was made.",
    )
    fps: int | None = Field(None, ge=1, le=120, description="Frame rate of the MP4; the model's when omitted.")
    input_reference: bytes | str | dict | None = Field(
        None,
        description="First frame of an image-to-video model: PNG, JPEG or WebP as a file part of the form, base64, a "
        "data: URL or {'image_url': 'data:...'}; fitted to the size (cover, then centre crop).",
    )

    @model_validator(mode="after")
    def _one_size(self) -> VideoCreateRequest:
        if (self.width is None) != (self.height is None):
            raise ValueError("width and height go together: give both, or neither (or size)")
        if self.width is not None:
            parse_size(f"{self.width}x{self.height}")  # each a multiple of 16
            if self.size is not None and self.size != f"{self.width}x{self.height}":
                raise ValueError(
                    f"size={self.size!r} and width x height = {self.width}x{self.height} disagree: give one"
                )
        return self

    @property
    def resolved_size(self) -> str | None:
        """``size``, or ``width`` x ``height``; ``None``: the server's default."""
        return self.size or (f"{self.width}x{self.height}" if self.width is not None else None)


def to_video_request(
    body: VideoCreateRequest, config: AppConfig, temporal_compression: int, request_id: str
) -> tuple[GenerationRequest, int]:
    """Applies the server's defaults and limits to a video job.

    Returns:
        The generation request (uint8 frames) and the frame rate of its MP4.

    Raises:
        RequestLimitError: A limit is exceeded, the frame count is not one the VAE takes, or the
            input_reference is no image it takes (``reference_image``).
    """
    shared = {**body.generation_fields(), "size": body.resolved_size}
    image = ImageGenerationRequest.model_validate({k: v for k, v in shared.items() if v is not None})
    request = to_generation_request(image, config, request_id)
    fps = body.fps or config.fps
    t = temporal_compression
    if body.num_frames is not None:
        frames = body.num_frames
    else:
        frames = frames_for_seconds(body.seconds or config.default_video_seconds, fps, t)
    if (frames - 1) % t:
        frames = frames // t * t + 1  # what diffusers' video pipelines make of such a count
    if frames > config.max_frames:
        raise RequestLimitError(f"{frames} frames exceed the limit max_frames={config.max_frames}")
    image = None
    if body.input_reference is not None:
        image = fit_image(reference_image(body.input_reference, config), request.width, request.height)
    return dataclasses.replace(request, num_frames=frames, uint8_frames=True, image=image), fps
