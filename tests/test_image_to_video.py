"""Image-to-video (diffusers' ``WanImageToVideoPipeline``) on CPU ranks: Wan2.1-I2V with its CLIP
vision encoder (replicated on every rank) and the two-expert Wan2.2-I2V, in ``batch`` and in lanes
with Ulysses and CFG parallel. Each result equals the unsharded pipeline's for the same fitted
image, prompt and seed; the image reaches the model (two images, two videos)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.request import GenerationRequest, fit_image

#: Lanes sum in other orders; the tiny VAE keeps the latents' variation, and with it differences of
#: a few 1e-6 (measured up to 1.1e-5 on 9 frames; the images of two inputs differ by 1e-2 and more).
TOLERANCE = 3e-5


def png(width: int, height: int, seed: int) -> bytes:
    """A seeded random RGB picture of its own size (the fit to the request's size is part of the test)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def i2v_request(prompt: str, seed: int, image: bytes, **fields) -> GenerationRequest:
    size = dict(width=32, height=32, num_frames=5, num_inference_steps=2)
    size.update(fields)
    return GenerationRequest(prompt=prompt, seed=seed, image=fit_image(image, size["width"], size["height"]), **size)


@pytest.fixture(scope="module")
def i2v_models(tmp_path_factory):
    """The tiny Wan2.1-I2V and Wan2.2-I2V folders, each with its unsharded reference pipeline."""
    out = {}
    for name, two_experts in (("wan21-i2v", False), ("wan22-i2v", True)):
        folder = make_tiny(tmp_path_factory.mktemp("models") / name, two_experts=two_experts, image_to_video=True)
        pipe = load_pipeline(Path(folder), "float32")
        pipe.set_progress_bar_config(disable=True)
        out[name] = (str(folder), pipe)
    return out


def test_the_fit_covers_the_size_then_crops_the_centre():
    wide = np.zeros((50, 100, 3), dtype=np.uint8)
    wide[:, :50] = (255, 0, 0)  # left half red, right half blue
    wide[:, 50:] = (0, 0, 255)
    data = io.BytesIO()
    Image.fromarray(wide).save(data, format="PNG")
    fitted = np.asarray(Image.open(io.BytesIO(fit_image(data.getvalue(), 32, 32))))
    # 100x50 scaled to 64x32 covers 32x32; the crop keeps columns 16-47: red up to 16, blue after.
    assert fitted.shape == (32, 32, 3)
    assert tuple(fitted[16, 2]) == (255, 0, 0) and tuple(fitted[16, 29]) == (0, 0, 255)
    palette = io.BytesIO()
    Image.fromarray(wide).convert("P").save(palette, format="PNG")
    assert Image.open(io.BytesIO(fit_image(palette.getvalue(), 48, 16))).mode == "RGB"
    with pytest.raises(ValueError, match="could not be decoded"):
        fit_image(b"not an image", 32, 32)


def test_batch_on_two_ranks_equals_unsharded_and_the_image_matters(ray_cluster, i2v_models):
    folder, pipe = i2v_models["wan21-i2v"]
    requests = [
        i2v_request("a cat on a roof", 3, png(40, 30, 1)),
        i2v_request("a cat on a roof", 3, png(40, 30, 2)),  # the same but for the image
    ]
    with ShardGroup(GroupConfig(model=folder, device="cpu", shard_size=2)) as group:
        assert group.pipeline_facts["image_input"] is True
        results = group.generate(requests)
        with pytest.raises(ValueError, match="makes a video from an image: send the first frame"):
            group.submit(GenerationRequest(prompt="no image", num_frames=5, width=32, height=32))
    for request, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(pipe, request)) <= TOLERANCE
    assert max_abs_diff(results[0].frames, results[1].frames) > 1e-3


def test_a_lane_of_cfg_2_x_ulysses_2_equals_unsharded(ray_cluster, i2v_models):
    """The second request's 320 x 288 frames make 2 x 2 of the VAE's tiles: the lane's four ranks
    share the decode (vae_parallel), equal to the unsharded pipeline's tiled decode."""
    folder, pipe = i2v_models["wan21-i2v"]
    small = i2v_request("rain at night", 5, png(64, 48, 3), width=64, num_frames=9)
    tiled = i2v_request("a harbour", 6, png(64, 48, 5), width=320, height=288, num_frames=5, num_inference_steps=1)
    config = GroupConfig(
        model=folder, device="cpu", shard_size=4, ulysses_degree=2, cfg_parallel=True, vae_parallel="auto"
    )
    with ShardGroup(config) as group:
        assert group.describe()["lane_size"] == 4
        results = group.generate([small, tiled])
    assert max_abs_diff(results[0].frames, reference_frames(pipe, small)) <= TOLERANCE
    pipe.vae.enable_tiling()
    try:
        assert max_abs_diff(results[1].frames, reference_frames(pipe, tiled)) <= TOLERANCE
    finally:
        pipe.vae.disable_tiling()


def test_two_experts_with_ulysses_2_equal_unsharded(ray_cluster, i2v_models):
    folder, pipe = i2v_models["wan22-i2v"]
    # The tiny two-expert boundary sits at half the schedule: 4 steps run both experts.
    request = i2v_request("waves", 7, png(30, 40, 4), num_inference_steps=4)
    config = GroupConfig(model=folder, device="cpu", shard_size=2, ulysses_degree=2)
    with ShardGroup(config) as group:
        (result,) = group.generate([request])
    assert max_abs_diff(result.frames, reference_frames(pipe, request)) <= TOLERANCE
