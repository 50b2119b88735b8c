"""Image-to-video over HTTP: the ``i2v`` app of the shared ``serve run`` (``tiny-i2v`` at ``/i2v``).
The image comes as OpenAI's client sends it (a file part of the multipart form) or in JSON (base64,
a data URL, ``{"image_url": ...}``); every bad image or misplaced one is a clean 4xx."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import requests
from PIL import Image
from support import reference_frames

from ray_hsdp.loading.components import load_pipeline, resolve_model_path
from ray_hsdp.request import GenerationRequest, fit_image
from ray_hsdp.serve.media import decode_mp4

from .test_videos import SAME_MP4_MAE, as_mp4, mae


def picture(width: int, height: int, seed: int, kind: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind)
    return out.getvalue()


def solid(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height``, with no pixels in its (empty) data chunk."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def i2v(server):
    return f"{server}/i2v"


@pytest.fixture(scope="module")
def i2v_pipe(i2v):
    """The unsharded tiny image-to-video pipeline (the server's ranks wrote the folder)."""
    pipe = load_pipeline(resolve_model_path("tiny-i2v"), "float32")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, prompt: str, seed: int, image: bytes, frames: int = 5, steps: int = 2) -> np.ndarray:
    request = GenerationRequest(
        prompt=prompt,
        seed=seed,
        num_frames=frames,
        num_inference_steps=steps,
        width=64,
        height=64,
        image=fit_image(image, 64, 64),
    )
    return (np.clip(reference_frames(pipe, request)[0], 0, 1) * 255).round()


def test_the_openai_client_animates_an_image_and_the_image_reaches_the_model(i2v, i2v_pipe):
    import openai

    client = openai.OpenAI(base_url=f"{i2v}/v1", api_key="unused", max_retries=0, timeout=300)
    videos = []
    for colour in ((230, 40, 40), (40, 40, 230)):  # two images, the same prompt and noise seed
        image = solid(80, 48, colour)
        job = client.videos.create_and_poll(
            prompt="The picture comes alive",
            size="64x64",
            # The client sends a file part with the name and type it is given.
            input_reference=("frame.png", image, "application/octet-stream"),
            extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 9},
            poll_interval_ms=100,
        )
        assert job.status == "completed", job.error
        frames, fps = decode_mp4(client.videos.download_content(job.id).read())
        assert frames.shape == (5, 64, 64, 3) and fps == 16
        assert mae(frames, as_mp4(reference(i2v_pipe, "The picture comes alive", 9, image))) <= SAME_MP4_MAE
        videos.append(frames)
    # Another image, another video: further apart than two MP4s of equal frames may be (the tiny
    # model's random weights let the image move its frames by little, 0.4 of 255 here).
    assert mae(videos[0], videos[1]) > SAME_MP4_MAE


@pytest.mark.parametrize("form", ["base64", "data_url", "object"])
def test_json_takes_base64_a_data_url_and_the_object_form(i2v, i2v_pipe, form):
    image = picture(64, 64, 3, "JPEG")
    b64 = base64.b64encode(image).decode()
    value = {
        "base64": b64,
        "data_url": f"data:image/jpeg;base64,{b64}",
        "object": {"image_url": f"data:image/jpeg;base64,{b64}"},
    }[form]
    body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 4}
    response = requests.post(f"{i2v}/v1/videos/sync", json={**body, "input_reference": value}, timeout=300)
    assert response.status_code == 200, response.text
    frames, _ = decode_mp4(response.content)
    assert mae(frames, as_mp4(reference(i2v_pipe, "waves", 4, image))) <= SAME_MP4_MAE


VIDEO = {"prompt": "a", "size": "64x64", "num_frames": 5, "num_inference_steps": 2}
PNG = picture(32, 32, 0)


def as_file(data: bytes, field: str = "input_reference") -> dict:
    return {"files": {field: ("x.png", data, "application/octet-stream")}, "data": VIDEO}


def as_json(value) -> dict:
    return {"json": {**VIDEO, "input_reference": value}}


BAD_IMAGES = [
    ("not an image", "/i2v", as_file(b"plain text, no picture"), 400, "not a PNG, JPEG or WebP"),
    ("truncated PNG", "/i2v", as_file(PNG[: len(PNG) // 2]), 400, "could not be decoded"),
    ("empty file", "/i2v", as_file(b""), 400, "input_reference is empty"),
    ("huge dimensions", "/i2v", as_file(png_header_only(100_000, 100_000)), 400, "max_image_pixels"),
    ("over max_image_bytes", "/i2v", as_file(b"\x89PNG\r\n\x1a\n" + bytes(11 * 2**20)), 413, "max_image_bytes"),
    ("wrong field name", "/i2v", as_file(PNG, field="image"), 400, "only input_reference takes one"),
    ("an image to a text-to-video model", "", as_file(PNG), 400, "makes its output from text alone"),
    ("no image to an image-to-video model", "/i2v", {"json": VIDEO}, 400, "send the first frame"),
    ("bad base64", "/i2v", as_json("!!not base64!!"), 400, "not valid base64"),
    ("a data URL of another type", "/i2v", as_json("data:text/plain;base64,aGVsbG8="), 400, "'text/plain'"),
    ("a file_id", "/i2v", as_json({"file_id": "file-123"}), 400, "only inline images"),
    ("an http URL", "/i2v", as_json("https://example.com/cat.png"), 400, "only inline images"),
]


@pytest.mark.parametrize("app, call, status, mentions", [b[1:] for b in BAD_IMAGES], ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_get_a_4xx_that_says_what_is_wrong(server, app, call, status, mentions):
    response = requests.post(f"{server}{app}/v1/videos", timeout=60, **call)
    assert response.status_code == status, response.text
    assert mentions in response.json()["error"]["message"], response.text


def test_the_images_route_of_an_image_to_video_model_is_a_400(i2v):
    response = requests.post(f"{i2v}/v1/images/generations", json={"prompt": "a"}, timeout=60)
    assert response.status_code == 400
    assert "image-to-video model: POST /v1/videos" in response.json()["error"]["message"]
