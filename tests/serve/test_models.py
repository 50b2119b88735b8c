"""Models beyond Wan served end to end: each embedded tiny model deployed beside the tiny server,
asked over HTTP with the request choices that apply to it, each answer equal to the unsharded
diffusers pipeline's for the same choices. One app at a time (each deployed for its test)."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from support import embedded_pipeline, random_png, reference_frames
from test_model_qwen_image import model_card_frames

from ray_hsdp.request import GenerationRequest

from .served import deploy, png_pixels


def one_app(server: str, name: str, args: dict):
    """Generator for a fixture: the URL of app ``name`` of ``build_app(args)`` beside the tiny
    server, deleted after its test without waiting (its ranks stop while the next test runs)."""
    from ray import serve

    yield deploy(server, name, args)
    serve.delete(name, _blocking=False)


@pytest.fixture
def qwen_image_app(server):
    yield from one_app(server, "qwen", {"model": "tiny-qwen-image", "device": "cpu", "shard_size": 2})


def test_qwen_image_over_the_images_api_guides_with_true_cfg_and_its_negative_prompt(qwen_image_app):
    _, pipe = embedded_pipeline("tiny-qwen-image")
    bodies = [
        {"prompt": "a red fox", "size": "64x64", "seed": 3, "num_inference_steps": 3, "guidance_scale": 4.0},
        {"prompt": "a red fox", "size": "32x64", "seed": 3, "num_inference_steps": 3, "negative_prompt": "a cat"},
    ]
    for body in bodies:
        response = requests.post(f"{qwen_image_app}/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "tiny-qwen-image"
        width, height = map(int, body["size"].split("x"))
        request = GenerationRequest(
            prompt=body["prompt"],
            negative_prompt=body.get("negative_prompt"),
            width=width,
            height=height,
            num_inference_steps=3,
            guidance_scale=body.get("guidance_scale", 5.0),  # the server's default
            seed=3,
        )
        expected = (np.clip(model_card_frames(pipe, request)[0, 0], 0, 1) * 255).round()
        assert np.abs(png_pixels(response.json()) - expected).max() <= 1, body


@pytest.fixture
def ti2v_app(server):
    args = {"model": "tiny-wan2.2-ti2v", "device": "cpu", "shard_size": 2, "pipeline_class": "WanImageToVideoPipeline"}
    yield from one_app(server, "ti2v", args)


def test_wan22_ti2v_over_the_videos_api_animates_its_input_reference(ti2v_app):
    import base64

    from ray_hsdp.request import fit_image
    from ray_hsdp.serve.media import decode_mp4

    from .test_videos import SAME_MP4_MAE, as_mp4, mae

    _, pipe = embedded_pipeline("tiny-wan2.2-ti2v", "WanImageToVideoPipeline")
    image = random_png(80, 48, 4)
    body = {"prompt": "waves", "size": "64x64", "num_frames": 9, "num_inference_steps": 2, "seed": 4}
    response = requests.post(
        f"{ti2v_app}/v1/videos/sync", json={**body, "input_reference": base64.b64encode(image).decode()}, timeout=300
    )
    assert response.status_code == 200, response.text
    frames, _ = decode_mp4(response.content)
    request = GenerationRequest(
        prompt="waves", seed=4, num_frames=9, num_inference_steps=2, image=fit_image(image, 64, 64)
    )
    expected = (np.clip(reference_frames(pipe, request)[0], 0, 1) * 255).round()
    assert frames.shape == (9, 64, 64, 3)
    assert mae(frames, as_mp4(expected)) <= SAME_MP4_MAE


@pytest.fixture
def flux2_app(server):
    yield from one_app(server, "flux2", {"model": "tiny-flux2", "device": "cpu", "shard_size": 2})


def test_flux2_over_the_images_api_takes_a_large_reference_and_refuses_a_negative_prompt(flux2_app):
    import base64

    from ray_hsdp.request import fit_image

    _, pipe = embedded_pipeline("tiny-flux2")
    # 300 KB of noise, over max_body_bytes as base64: the images route keeps room for it (a 413 before).
    image = random_png(320, 320, 5)
    assert len(image) * 4 / 3 > 65536
    body = {"prompt": "a cat", "size": "128x64", "seed": 3, "num_inference_steps": 2, "guidance_scale": 3.0}
    response = requests.post(
        f"{flux2_app}/v1/images/generations",
        json={**body, "input_reference": base64.b64encode(image).decode()},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    request = GenerationRequest(
        prompt="a cat",
        width=128,
        height=64,
        seed=3,
        num_inference_steps=2,
        guidance_scale=3.0,
        image=fit_image(image, 128, 64),
    )
    expected = (np.clip(reference_frames(pipe, request)[0, 0], 0, 1) * 255).round()
    assert np.abs(png_pixels(response.json()) - expected).max() <= 1
    refused = requests.post(
        f"{flux2_app}/v1/images/generations", json={**body, "negative_prompt": "blurry"}, timeout=60
    )
    assert refused.status_code == 400 and "negative_prompt" in refused.text, refused.text


@pytest.fixture
def hunyuan_app(server):
    yield from one_app(server, "hy15", {"model": "tiny-hunyuanvideo-1.5", "device": "cpu", "shard_size": 2})


def test_hunyuan_video15_over_the_videos_api_guides_through_its_guider(hunyuan_app):
    from ray_hsdp.serve.media import decode_mp4

    from .test_videos import SAME_MP4_MAE, as_mp4, mae

    _, pipe = embedded_pipeline("tiny-hunyuanvideo-1.5")
    body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 4}
    videos = []
    for guidance in (6.0, 2.0):
        response = requests.post(
            f"{hunyuan_app}/v1/videos/sync",
            json={**body, "guidance_scale": guidance, "negative_prompt": "a cat"},
            timeout=300,
        )
        assert response.status_code == 200, response.text
        frames, _ = decode_mp4(response.content)
        request = GenerationRequest(
            prompt="waves",
            negative_prompt="a cat",
            seed=4,
            num_frames=5,
            num_inference_steps=2,
            guidance_scale=guidance,
        )
        expected = (np.clip(reference_frames(pipe, request)[0], 0, 1) * 255).round()
        assert mae(frames, as_mp4(expected)) <= SAME_MP4_MAE, guidance
        videos.append(frames)
    assert mae(videos[0], videos[1]) > SAME_MP4_MAE  # the guidance reached the model
    refused = requests.post(f"{hunyuan_app}/v1/videos/sync", json={**body, "lora": "tiny-style"}, timeout=60)
    assert refused.status_code == 400 and "lora" in refused.text, refused.text
