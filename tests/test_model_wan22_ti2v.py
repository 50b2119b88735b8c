"""Wan2.2-TI2V-5B through a shard group: one folder that names ``WanPipeline`` makes videos from
text, and loaded as ``WanImageToVideoPipeline`` (the group's ``pipeline_class``) from a first
frame; each request equal to the unsharded pipeline of that class."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support import (
    embedded_pipeline,
    max_abs_diff,
    pipeline_with_adapters,
    random_png,
    reference_frames,
    reference_with,
    style_lora,
)

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, InvalidRequestError, StepCache, fit_image

TOLERANCE = 1e-5
I2V = "WanImageToVideoPipeline"

#: Text to video: guided, unguided, a negative prompt; two sizes and lengths.
TEXT = [
    GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=3, num_frames=5),
    GenerationRequest(prompt="a blue boat", seed=2, num_inference_steps=2, num_frames=9, guidance_scale=1.0),
    GenerationRequest(prompt="a cat", negative_prompt="a dog", seed=3, num_inference_steps=3, width=128, num_frames=5),
]


def with_image(request: GenerationRequest, seed: int) -> GenerationRequest:
    return dataclasses.replace(request, image=fit_image(random_png(80, 48, seed), request.width, request.height))


@pytest.fixture(scope="module")
def ti2v(ray_cluster):
    """The embedded tiny TI2V folder and its unsharded pipelines, text- and image-to-video."""
    folder, text = embedded_pipeline("tiny-wan2.2-ti2v")
    _, image = embedded_pipeline("tiny-wan2.2-ti2v", I2V)
    return folder, {"WanPipeline": text, I2V: image}


def test_the_tiny_ti2v_answers_every_input_visibly(ti2v):
    _, pipes = ti2v
    request = with_image(dataclasses.replace(TEXT[0], num_frames=9), 1)  # the image fixes the first of 3 latent frames
    base = reference_frames(pipes[I2V], request)
    moved = {
        "seed": dataclasses.replace(request, seed=9),
        "prompt": dataclasses.replace(request, prompt="a small boat on a lake"),
        "guidance": dataclasses.replace(request, guidance_scale=2.0),
        "negative prompt": dataclasses.replace(request, negative_prompt="a cat"),
        "image": with_image(request, 2),
    }
    means = {name: float(np.abs(reference_frames(pipes[I2V], r) - base).mean() * 255) for name, r in moved.items()}
    assert means["seed"] >= 20, means
    assert min(means.values()) >= 3, means


# From an image (WanImageToVideoPipeline on the same folder), on two ranks: tests/serve/test_models.py.
def test_ti2v_from_text_on_a_lane_of_ulysses_2_equals_unsharded(ti2v, tmp_path):
    folder, pipes = ti2v
    # One request asks for TaylorSeer (step 0 in full, then one in every 2), one for a LoRA; the
    # others run in full, without it.
    cached = dataclasses.replace(TEXT[0], cache=StepCache("taylorseer", interval=2, warmup_steps=1), seed=5)
    styled = dataclasses.replace(TEXT[0], lora=(("style", 0.8),), seed=6)
    cache = {"kind": "taylorseer", "every_request": False}
    loras = style_lora(folder, tmp_path)
    with ShardGroup(GroupConfig(model=folder, device="cpu", ulysses_degree=2, cache=cache, loras=loras)) as group:
        assert group.pipeline_facts["image_input"] is False
        *results, cached_result, styled_result = group.generate([*TEXT, cached, styled])
        # The folder's own class makes videos from text alone: an image is refused, naming it.
        with pytest.raises(InvalidRequestError, match="input_reference"):
            group.submit(with_image(TEXT[0], 0))
    for request, result in zip(TEXT, results):
        assert max_abs_diff(result.frames, reference_frames(pipes["WanPipeline"], request)) <= TOLERANCE, request
    assert max_abs_diff(cached_result.frames, reference_with(pipes["WanPipeline"], cached)) <= TOLERANCE
    assert cached_result.cached_forwards == 2  # step 2 of 3 predicted, its cond and uncond forwards
    with_adapters = pipeline_with_adapters(folder, loras)  # diffusers' own loader, on the unsharded pipeline
    assert max_abs_diff(styled_result.frames, reference_with(with_adapters, styled)) <= TOLERANCE
