"""HunyuanVideo-1.5 through a shard group: guidance through its guider (its pipeline takes no
``guidance_scale``), denoising steps counted without a step callback (it takes none), CFG parallel,
TaylorSeer's step cache, LoRA refused per request, and lanes that split the sequence and First
Block Cache refused at start (no plan; blocks diffusers' hook does not know)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support import embedded_pipeline, max_abs_diff, reference_frames, reference_with

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, InvalidRequestError, StepCache

TOLERANCE = 1e-5

#: The guider's default (6.0), another guidance, unguided; a negative prompt; two sizes and lengths.
REQUESTS = [
    GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=3, num_frames=5, guidance_scale=6.0),
    GenerationRequest(prompt="a blue boat", seed=2, num_inference_steps=2, num_frames=9, guidance_scale=2.5),
    GenerationRequest(
        prompt="a cat",
        negative_prompt="a dog",
        seed=3,
        num_inference_steps=3,
        width=128,
        num_frames=5,
        guidance_scale=4,
    ),
    GenerationRequest(prompt="rain at night", seed=4, num_inference_steps=2, num_frames=5, guidance_scale=1.0),
]


@pytest.fixture(scope="module")
def hunyuan(ray_cluster):
    """The embedded tiny HunyuanVideo-1.5 folder and its unsharded pipeline."""
    return embedded_pipeline("tiny-hunyuanvideo-1.5")


def test_the_tiny_hunyuan_video15_answers_every_input_visibly(hunyuan):
    _, pipe = hunyuan
    request = REQUESTS[0]
    base = reference_frames(pipe, request)
    moved = {
        "seed": dataclasses.replace(request, seed=9),
        "prompt": dataclasses.replace(request, prompt="a small boat on a lake"),
        "guidance": dataclasses.replace(request, guidance_scale=2.0),
        "negative prompt": dataclasses.replace(request, negative_prompt="a cat"),
    }
    means = {name: float(np.abs(reference_frames(pipe, r) - base).mean() * 255) for name, r in moved.items()}
    assert means["seed"] >= 20, means
    assert min(means.values()) >= 3, means


def test_hunyuan_video15_with_cfg_parallel_equals_unsharded_and_counts_its_steps(hunyuan):
    folder, pipe = hunyuan
    # One request asks for TaylorSeer (step 0 in full, then one in every 2); the others run in full.
    cached = dataclasses.replace(REQUESTS[0], cache=StepCache("taylorseer", interval=2, warmup_steps=1), seed=5)
    cache = {"kind": "taylorseer", "every_request": False}
    with ShardGroup(GroupConfig(model=folder, device="cpu", cfg_parallel=True, cache=cache)) as group:
        facts = group.pipeline_facts
        *results, cached_result = group.generate([*REQUESTS, cached])
        # diffusers has no LoRA loader for this pipeline: a request naming an adapter is refused.
        with pytest.raises(InvalidRequestError, match="lora"):
            group.submit(dataclasses.replace(REQUESTS[0], lora=(("style", 1.0),)))
    assert facts["cfg_split"] == ["transformer"] and facts["lora"] is False
    for request, result in zip(REQUESTS, results):
        assert max_abs_diff(result.frames, reference_frames(pipe, request)) <= TOLERANCE, request
        # Its steps were seen without a step callback (the scheduler's steps): their mean time.
        assert result.step_s is not None and result.step_s > 0, request
    assert max_abs_diff(cached_result.frames, reference_with(pipe, cached)) <= TOLERANCE
    assert cached_result.cached_forwards == 1  # step 2 of 3 predicted (on the answering, conditional half)


def test_lanes_that_split_hunyuan_video15s_sequence_are_refused_by_the_table(hunyuan):
    """What a rank's load does on a lane of Ulysses 2 (``enable_context_parallel``, before any mesh
    is touched): the model row of the table refuses it, naming the model and the lanes. (A group's
    start fails with this message: the rank's ValueError.)"""
    from ray_hsdp.sharding.context_parallel import enable_context_parallel

    _, pipe = hunyuan
    with pytest.raises(
        ValueError,
        match="HunyuanVideo15Transformer3DModel: a transformer without a context-parallel plan.*ulysses_degree",
    ):
        enable_context_parallel(pipe.transformer, None, ring=1, ulysses=2, device="cpu", attention_backend=None)


def test_first_block_cache_on_hunyuan_video15_is_refused_at_start(hunyuan):
    """What a rank's load checks before its weights load (a group's start fails with this message):
    diffusers' First Block Cache has no entry for HunyuanVideo-1.5's block class."""
    from ray_hsdp.loading.start_checks import refuse_step_cache

    _, pipe = hunyuan
    refuse_step_cache(pipe.transformer, "taylorseer", type(pipe))  # TaylorSeer runs (the group test above)
    with pytest.raises(ValueError, match="HunyuanVideo15Transformer3DModel: a transformer whose blocks"):
        refuse_step_cache(pipe.transformer, "first_block", type(pipe))
