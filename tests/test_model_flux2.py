"""FLUX.2 through a shard group: its tiny pipeline (a 30-layer Mistral 3, whose layers 10, 20 and 30
the pipeline reads), its optional reference image, its refusal of a negative prompt and of step
caches, and a lane of Ulysses 2, each request equal to the unsharded diffusers pipeline."""

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
from ray_hsdp.request import GenerationRequest, InvalidRequestError, fit_image

TOLERANCE = 1e-5


def with_reference(request: GenerationRequest, seed: int) -> GenerationRequest:
    return dataclasses.replace(request, image=fit_image(random_png(160, 96, seed), request.width, request.height))


SENTENCE = "waves crash against the rocks while seagulls fly overhead and a small boat sails across a calm blue lake"

#: Two sizes, two guidances (FLUX.2-dev's distilled guidance embedding), one with a reference image.
REQUESTS = [
    GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=3, guidance_scale=4.0),
    GenerationRequest(prompt="a blue boat", seed=2, num_inference_steps=2, guidance_scale=2.5, width=128),
    with_reference(GenerationRequest(prompt="a cat", seed=3, num_inference_steps=3, width=128, height=128), 5),
]


@pytest.fixture(scope="module")
def flux2(ray_cluster):
    """The embedded tiny FLUX.2 folder and its unsharded pipeline."""
    return embedded_pipeline("tiny-flux2")


def test_the_tiny_flux2_answers_every_input_visibly(flux2):
    _, pipe = flux2
    request = REQUESTS[2]
    base = reference_frames(pipe, request)
    moved = {
        "seed": dataclasses.replace(request, seed=9),
        # FLUX.2 reads 512 text tokens, a short prompt a few of them: a sentence moves the tiny's image.
        "prompt": dataclasses.replace(request, prompt=f"{request.prompt} {SENTENCE}"),
        "guidance": dataclasses.replace(request, guidance_scale=2.0),
        "reference": dataclasses.replace(request, image=None),
    }
    means = {name: float(np.abs(reference_frames(pipe, r) - base).mean() * 255) for name, r in moved.items()}
    assert means["seed"] >= 20, means
    assert min(means.values()) >= 3, means


def test_flux2_on_a_lane_of_ulysses_2_equals_unsharded_and_refuses_a_negative_prompt(flux2, tmp_path):
    folder, pipe = flux2
    # One request asks for a LoRA (through diffusers' FLUX.2 loader); the others run without it.
    styled = dataclasses.replace(REQUESTS[0], lora=(("style", 0.8),), seed=6)
    loras = style_lora(folder, tmp_path)
    with ShardGroup(GroupConfig(model=folder, device="cpu", ulysses_degree=2, loras=loras)) as group:
        facts = group.pipeline_facts
        *results, styled_result = group.generate([*REQUESTS, styled])
        memory = group.memory()
        # diffusers' FLUX.2 takes no negative prompt and would ignore one: refused, naming it.
        with pytest.raises(InvalidRequestError, match="negative_prompt"):
            group.submit(dataclasses.replace(REQUESTS[0], negative_prompt="blurry"))
    # The reference is optional: requests with and without one run on one group.
    assert facts["image_reference"] and not facts["image_input"]
    assert set(memory[0]["sharded_components"]) == {"transformer", "text_encoder"}
    for request, result in zip(REQUESTS, results):
        assert max_abs_diff(result.frames, reference_frames(pipe, request)) <= TOLERANCE, request
    with_adapters = pipeline_with_adapters(folder, loras)  # diffusers' own loader, on the unsharded pipeline
    assert max_abs_diff(styled_result.frames, reference_with(with_adapters, styled)) <= TOLERANCE


@pytest.mark.parametrize("kind", ["first_block", "taylorseer"])
def test_a_step_cache_on_flux2_is_refused_at_start(flux2, kind):
    """What a rank's load checks before its weights load (a group's start fails with this message):
    FLUX.2's pipeline enters no cache context, so no step cache runs on it, in diffusers either."""
    from ray_hsdp.loading.start_checks import refuse_step_cache

    _, pipe = flux2
    with pytest.raises(ValueError, match="Flux2Transformer2DModel: a pipeline that enters no cache context"):
        refuse_step_cache(pipe.transformer, kind, type(pipe))
