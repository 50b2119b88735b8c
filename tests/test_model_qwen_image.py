"""Qwen-Image through a shard group: its tiny pipeline, its guidance (``true_cfg_scale`` with a
negative prompt), a lane of CFG parallel x Ulysses 2, each request equal to the unsharded diffusers
pipeline written the way its model card writes it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support import embedded_pipeline, max_abs_diff, pipeline_with_adapters, reference_with, style_lora

from bench.reference import plain_call
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, InvalidRequestError, StepCache

TOLERANCE = 1e-5

#: Guided with the default negative prompt, unguided, guided with a negative prompt of its own;
#: three sizes (a text of another length each: Ulysses pads each to split it).
REQUESTS = [
    GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=3, guidance_scale=4.0),
    GenerationRequest(prompt="a blue boat", seed=2, num_inference_steps=2, guidance_scale=1.0, width=32, height=64),
    GenerationRequest(
        prompt="a cat and a dog baking a cake", negative_prompt="a dog", seed=3, num_inference_steps=3, width=64
    ),
]


@pytest.fixture(scope="module")
def qwen_image(ray_cluster):
    """The embedded tiny Qwen-Image folder and its unsharded pipeline."""
    return embedded_pipeline("tiny-qwen-image")


def model_card_frames(pipe, request: GenerationRequest, **overrides) -> np.ndarray:
    """The unsharded run as Qwen-Image's model card writes it (``bench.reference.plain_call``:
    guidance as ``true_cfg_scale`` and, when guided, a negative prompt, ``" "`` when the request
    has none), with ``overrides`` of its arguments.

    On one thread, as each CPU rank runs (``num_cpus=1``): the tiny Qwen-Image's VAE turns the last
    bits of its latents into up to 5e-6 of a pixel (measured), and sums over two threads differ in them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pipe(**{**plain_call(pipe, request), **overrides}).images[:, None]
    finally:
        torch.set_num_threads(threads)


def test_the_tiny_qwen_image_answers_every_input_visibly(qwen_image):
    _, pipe = qwen_image
    guided = REQUESTS[0]
    base = model_card_frames(pipe, guided)
    moved = {
        "seed": model_card_frames(pipe, dataclasses.replace(guided, seed=7)),
        "prompt": model_card_frames(pipe, dataclasses.replace(guided, prompt="a small boat on a lake")),
        "guidance": model_card_frames(pipe, dataclasses.replace(guided, guidance_scale=2.0)),
        "negative prompt": model_card_frames(pipe, dataclasses.replace(guided, negative_prompt="a cat")),
    }
    means = {name: float(np.abs(frames - base).mean() * 255) for name, frames in moved.items()}
    assert means["seed"] >= 20, means
    assert min(means.values()) >= 3, means
    # Qwen-Image's guidance_scale is for guidance-distilled checkpoints: it moves nothing here, so a
    # request's guidance that reached it instead of true_cfg_scale would be lost.
    assert max_abs_diff(model_card_frames(pipe, guided, guidance_scale=9.0), base) == 0


# Batch on two ranks: tests/serve/test_models.py, over HTTP.
def test_qwen_image_on_a_lane_of_cfg_2_x_ulysses_2_equals_the_model_card_run(qwen_image, tmp_path):
    folder, pipe = qwen_image
    layout = dict(shard_size=4, cfg_parallel=True, ulysses_degree=2)
    # One request asks for First Block Cache (a threshold no change reaches: every step after the
    # first reuses it, its measure taken over the lane's Ulysses ranks), one for a LoRA (through
    # diffusers' Qwen-Image loader); the others run in full, without it.
    cached = dataclasses.replace(REQUESTS[0], cache=StepCache("first_block", threshold=1e9), seed=5)
    styled = dataclasses.replace(REQUESTS[0], lora=(("style", 0.8),), seed=6)
    cache = {"kind": "first_block", "every_request": False}
    loras = style_lora(folder, tmp_path)
    with ShardGroup(GroupConfig(model=folder, device="cpu", cache=cache, loras=loras, **layout)) as group:
        facts = group.pipeline_facts
        *results, cached_result, styled_result = group.generate([*REQUESTS, cached, styled])
        memory = group.memory()
        # One step divides by zero in its scheduler (NaN in diffusers too): refused, naming it.
        with pytest.raises(InvalidRequestError, match="num_inference_steps 1"):
            group.submit(dataclasses.replace(REQUESTS[0], num_inference_steps=1))
    assert facts["cfg_split"] == ["transformer"] and facts["min_steps"] == facts["warm_up_steps"] == 2
    # The transformer and the Qwen2.5-VL text encoder are both sharded; the vision tower stays whole.
    assert set(memory[0]["sharded_components"]) == {"transformer", "text_encoder"}
    for request, result in zip(REQUESTS, results):
        assert max_abs_diff(result.frames, model_card_frames(pipe, request)) <= TOLERANCE, request
    assert max_abs_diff(cached_result.frames, reference_with(pipe, cached)) <= TOLERANCE
    # Every step after the first reused it, on the answering rank (the conditional half).
    assert cached_result.cached_forwards == cached.num_inference_steps - 1
    with_adapters = pipeline_with_adapters(folder, loras)  # diffusers' own loader, on the unsharded pipeline
    assert max_abs_diff(styled_result.frames, reference_with(with_adapters, styled)) <= TOLERANCE
