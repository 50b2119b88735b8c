"""HTTP and handle request/response schema, OpenAI-shaped, and its mapping to a generation request."""

from __future__ import annotations

import base64
import dataclasses
import secrets
import time
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from ray_hsdp.config import AppConfig, parse_size
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.serve.media import encode_png as png_bytes
from ray_hsdp.serve.media import frames_for_seconds

MAX_SEED = 2**63 - 1


def _size_is_wxh(value: str | None) -> str | None:
    if value is not None:
        parse_size(value)
    return value


#: ``"WxH"``, each side a multiple of 16 (checked by ``parse_size``).
Size = Annotated[str | None, AfterValidator(_size_is_wxh)]


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields plus the diffusers extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr = Field(..., min_length=1, description="Text prompt.")
    model: StrictStr | None = Field(None, description="Served model name; the deployment's model when omitted.")
    n: StrictInt = Field(1, ge=1, description="Number of images.")
    size: Annotated[StrictStr | None, AfterValidator(_size_is_wxh)] = Field(
        None, description="'WxH', each a multiple of 16; the server default when omitted."
    )
    response_format: Literal["b64_json"] = Field("b64_json", description="Only base64 PNG is returned.")
    user: StrictStr | None = Field(None, description="OpenAI's end-user id; accepted and ignored.")
    negative_prompt: StrictStr | None = Field(None, description="Negative prompt.")
    num_inference_steps: StrictInt | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: StrictFloat | StrictInt | None = Field(None, ge=0, description="Classifier-free guidance scale.")
    guidance_scale_2: StrictFloat | StrictInt | None = Field(
        None, ge=0, description="Guidance of the low-noise expert (Wan2.2 A14B); guidance_scale when omitted."
    )
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description="Noise seed; random when omitted.")
    timeout_s: StrictFloat | StrictInt | None = Field(
        None, gt=0, description="Deadline once a rank takes the request; the server's request_timeout_s when omitted."
    )


class RequestLimitError(ValueError):
    """A request exceeds one of the server's configured limits."""


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
    steps = body.num_inference_steps or config.default_steps
    if steps > config.max_steps:
        raise RequestLimitError(f"num_inference_steps={steps} exceeds the limit max_steps={config.max_steps}")
    if body.timeout_s is not None and body.timeout_s > config.request_timeout_s:
        raise RequestLimitError(
            f"timeout_s={body.timeout_s} exceeds the limit request_timeout_s={config.request_timeout_s}"
        )
    guidance = body.guidance_scale if body.guidance_scale is not None else config.default_guidance_scale
    return GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        guidance_scale_2=float(body.guidance_scale_2) if body.guidance_scale_2 is not None else None,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        n=body.n,
        request_id=request_id,
        timeout_s=float(body.timeout_s) if body.timeout_s is not None else None,
    )


def encode_png(frame: np.ndarray) -> str:
    """Base64 PNG of one ``(H, W, 3)`` float frame in [0, 1]."""
    return base64.b64encode(png_bytes(frame)).decode("ascii")


def image_response(result: GenerationResult, model: str) -> dict:
    """The OpenAI images response for one result, with our ``seed`` and ``rank`` extensions."""
    return {
        "created": int(time.time()),
        "model": model,
        "data": [{"b64_json": encode_png(image[0])} for image in result.frames],
        "seed": result.seed,
        "rank": result.rank,
        "elapsed_s": round(result.elapsed_s, 4),
    }


class VideoCreateRequest(BaseModel):
    """``POST /v1/videos``: OpenAI's fields plus the diffusers extensions.

    Numbers may come as strings: the OpenAI client sends this body as a multipart form.
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(..., min_length=1, description="Text prompt.")
    model: str | None = Field(None, description="Served model name; the deployment's model when omitted.")
    size: Size = Field(None, description="'WxH', each a multiple of 16; the server default when omitted.")
    seconds: float | None = Field(
        None, gt=0, description="Clip length; frames = the nearest count the VAE takes at the model's frame rate."
    )
    num_frames: int | None = Field(None, ge=1, description="Frames; wins over seconds when both are given.")
    fps: int | None = Field(None, ge=1, le=120, description="Frame rate of the MP4; the model's when omitted.")
    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(None, ge=0, description="Classifier-free guidance scale.")
    guidance_scale_2: float | None = Field(
        None, ge=0, description="Guidance of the low-noise expert (Wan2.2 A14B); guidance_scale when omitted."
    )
    negative_prompt: str | None = Field(None, description="Negative prompt.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Noise seed; random when omitted.")
    user: str | None = Field(None, description="OpenAI's end-user id; accepted and ignored.")


def to_video_request(
    body: VideoCreateRequest, config: AppConfig, temporal_compression: int, request_id: str
) -> tuple[GenerationRequest, int]:
    """Applies the server's defaults and limits to a video job.

    Returns:
        The generation request (uint8 frames) and the frame rate of its MP4.

    Raises:
        RequestLimitError: A limit is exceeded, or the frame count is not one the VAE takes.
    """
    image = ImageGenerationRequest.model_validate(
        {
            k: v
            for k, v in {
                "prompt": body.prompt,
                "size": body.size,
                "negative_prompt": body.negative_prompt,
                "num_inference_steps": body.num_inference_steps,
                "guidance_scale": body.guidance_scale,
                "guidance_scale_2": body.guidance_scale_2,
                "seed": body.seed,
            }.items()
            if v is not None
        }
    )
    request = to_generation_request(image, config, request_id)
    fps = body.fps or config.fps
    t = temporal_compression
    if body.num_frames is not None:
        frames = body.num_frames
    else:
        frames = frames_for_seconds(body.seconds or config.default_video_seconds, fps, t)
    if frames > config.max_frames:
        raise RequestLimitError(f"{frames} frames exceed the limit max_frames={config.max_frames}")
    if (frames - 1) % t:
        raise RequestLimitError(
            f"num_frames={frames} is not a count this model's VAE takes: {t}k+1 (e.g. {t * ((frames - 1) // t) + 1} "
            f"or {t * ((frames - 1) // t + 1) + 1})"
        )
    return dataclasses.replace(request, num_frames=frames, uint8_frames=True), fps
