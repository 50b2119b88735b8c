"""Combined mode on CPU (gloo, fp32): lanes of ranks that split one request by Ulysses sequence
parallel and CFG parallel, on top of FSDP over the whole group. Every result equals the plain
diffusers pipeline's for the same request and seed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.request import GenerationRequest
from ray_hsdp.variant.lane import UnsplittableRequestError

TOLERANCE = 1e-5

#: Different steps, sizes, frames and guidance (on and off): one lane must take any of them.
MIXED = [
    GenerationRequest(prompt="a cat on a roof", seed=3, num_inference_steps=3, width=32, height=32, num_frames=5),
    GenerationRequest(
        prompt="a dog", seed=4, num_inference_steps=2, width=48, height=32, num_frames=1, guidance_scale=1.0
    ),
    GenerationRequest(prompt="rain at night", seed=5, num_inference_steps=4, width=64, height=32, num_frames=9),
]


def assert_parity(pipe, requests, results):
    for request, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(pipe, request)) <= TOLERANCE, request


@pytest.fixture(scope="module")
def two_expert_model(tmp_path_factory):
    folder = make_tiny(tmp_path_factory.mktemp("models") / "tiny-wan22", two_experts=True)
    pipe = load_pipeline(Path(folder), "float32")
    pipe.set_progress_bar_config(disable=True)
    return str(folder), pipe


# In place; the other lane tests gather with fsdp2 (the CPU default).
@pytest.mark.parametrize("gather", ["in_place"])
def test_a_lane_of_two_with_ulysses_2_equals_unsharded(ray_cluster, tiny_model, reference_pipe, gather):
    config = GroupConfig(model=tiny_model, device="cpu", ulysses_degree=2, gather=gather)
    with ShardGroup(config) as group:
        assert group.describe()["lanes"] == 1 and group.describe()["lane_size"] == 2
        results = group.generate(MIXED)
        stats = group.tick_stats()
        # Sizes whose tokens do not split over 2 ranks are refused before they reach a rank.
        with pytest.raises(UnsplittableRequestError, match="1 tokens, which do not split over"):
            group.submit(GenerationRequest(prompt="x", width=16, height=16, num_frames=1))
    assert_parity(reference_pipe, MIXED, results)
    assert {r.rank for r in results} == {0}  # the lane's leader answers
    # Both ranks of the lane ran every forward together: no ghost passes, the same count.
    assert stats[0]["forwards"] == stats[1]["forwards"] > 0
    assert stats[0]["ghosts"] == stats[1]["ghosts"] == 0


def test_cfg_parallel_runs_cond_and_uncond_on_two_ranks_and_equals_unsharded(ray_cluster, tiny_model, reference_pipe):
    guided = GenerationRequest(prompt="a lighthouse", seed=8, num_inference_steps=5, width=32, height=32, num_frames=5)
    config = GroupConfig(model=tiny_model, device="cpu", cfg_parallel=True)
    with ShardGroup(config) as group:
        assert group.pipeline_facts["cfg_split"] == ["transformer"]
        first = group.generate([guided])
        stats = group.tick_stats()
        results = group.generate(MIXED)
    assert_parity(reference_pipe, [guided, *MIXED], [*first, *results])
    # Two text-encoder forwards (prompt, negative prompt), then ONE transformer forward per step
    # on each rank, where one GPU runs two.
    assert [s["forwards"] for s in stats] == [2 + guided.num_inference_steps] * 2


def test_two_lanes_of_ulysses_2_run_different_requests_at_the_same_ticks(ray_cluster, two_expert_model):
    """A group of 4 ranks as 2 lanes x (cfg 1 x ulysses 2) of the two-expert model: different
    requests in the two lanes, their forwards at the same ticks (tick numbers are shared by every
    rank of a group), each equal to the unsharded pipeline: 8 steps and 3 put them on different
    experts (the boundary at half the schedule), and one gives the low-noise expert a guidance of
    its own (Wan2.2's guidance_scale_2)."""
    folder, pipe = two_expert_model
    requests = [
        GenerationRequest(
            prompt="a cat",
            seed=1,
            num_inference_steps=8,
            width=32,
            height=32,
            num_frames=5,
            guidance_scale_2=2.0,
            request_id="own guidance",
        ),
        GenerationRequest(
            prompt="slow one", seed=11, num_inference_steps=8, width=64, height=32, num_frames=9, request_id="slow"
        ),
        GenerationRequest(
            prompt="fast one", seed=12, num_inference_steps=5, width=32, height=32, num_frames=5, request_id="fast"
        ),
        GenerationRequest(
            prompt="unguided",
            seed=13,
            num_inference_steps=3,
            width=32,
            height=32,
            num_frames=5,
            guidance_scale=1.0,
            request_id="unguided",
        ),
    ]
    config = GroupConfig(model=folder, device="cpu", shard_size=4, ulysses_degree=2, requests_per_rank=1)
    with ShardGroup(config) as group:
        assert group.describe()["lanes"] == 2
        assert group.pipeline_facts["guidance_scale_2"] is True
        assert group.pipeline_facts["warm_up_steps"] == 2  # the tiny's schedule crosses its boundary at step 2
        group.start_profile()
        results = group.generate(requests)
        profiles = group.stop_profile()
    assert_parity(pipe, requests, results)
    assert {r.rank for r in results} == {0, 2}  # both leaders answered
    # The two lanes' leaders ran forwards at the same ticks, for different requests.
    lane0, lane1 = set(profiles[0]["forward_ticks"]), set(profiles[2]["forward_ticks"])
    assert profiles[0]["forward_ticks"] == profiles[1]["forward_ticks"]  # a lane's ranks act together
    assert profiles[2]["forward_ticks"] == profiles[3]["forward_ticks"]
    together = lane0 & lane1
    assert len(together) >= 5, (sorted(lane0), sorted(lane1))
    ran0, ran1 = set(profiles[0]["requests"]), set(profiles[2]["requests"])
    assert ran0 | ran1 == {"own guidance", "slow", "fast", "unguided"} and not ran0 & ran1
    # It is the expert's own guidance: without it, the same request comes out otherwise, by far
    # more than sharding moves it (the tiny model's frames move little: measured 1.1e-5).
    same = dataclasses.replace(requests[0], guidance_scale_2=None)
    sharding = max_abs_diff(reference_frames(pipe, requests[0]), results[0].frames)
    assert max_abs_diff(reference_frames(pipe, same), results[0].frames) > max(10 * sharding, 2e-6)
    # (One lane of cfg 2 x ulysses 2 on 4 ranks: test_image_to_video's lane test.)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"ulysses_degree": 3, "shard_size": 4}, "ranks must divide shard_size=4"),
        ({"ulysses_degree": 2, "cfg_parallel": True, "shard_size": 2}, "= 4 ranks must divide shard_size=2"),
        ({"ring_degree": 0}, "ring_degree"),
        ({"ulysses_degree": 0}, "ulysses_degree"),
        ({"mode": "replicated", "ulysses_degree": 2}, "cannot be combined with ulysses_degree"),
        ({"mode": "replicated", "cfg_parallel": True}, "cannot be combined"),
        ({"ulysses_degree": 2, "max_forward_batch": 2}, "with max_forward_batch > 1: the ranks of a lane"),
        ({"mode": "replicated", "max_forward_batch": 2}, "mode 'replicated'\\) with max_forward_batch > 1"),
        ({"world_size": 4, "replicate_size": 2, "ulysses_degree": 4}, "must divide shard_size=2"),
        ({"attention_backend": "flash_hub"}, "downloads its kernels from the Hub"),
        ({"attention_backend": "fastest"}, "not a diffusers attention backend"),
    ],
)
def test_bad_combinations_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        GroupConfig(**fields)


def test_shard_size_defaults_to_the_lane_size():
    assert GroupConfig(ulysses_degree=4).resolved_shard_size == 4
    assert GroupConfig(ulysses_degree=2, cfg_parallel=True).resolved_shard_size == 4
    assert GroupConfig().resolved_shard_size == 2
    assert GroupConfig(world_size=8, ulysses_degree=2).parallel_dims().num_lanes == 4


def test_model_facts_are_checked_before_anything_is_split(tiny_model):
    """What only the model knows, checked where a rank loads it, before any collective: its 2 heads
    do not split over ulysses 4; ring attention needs a backend that CPUs do not have; a CUDA-only
    backend on CPU ranks. (The group reports a rank's load error as its start's error.)"""
    from diffusers import WanTransformer3DModel

    from ray_hsdp.sharding.context_parallel import attention_backend_for, enable_context_parallel

    transformer = WanTransformer3DModel.from_pretrained(f"{tiny_model}/transformer")
    with pytest.raises(ValueError, match="ulysses_degree=4 does not divide the 2 attention heads"):
        enable_context_parallel(transformer, None, ring=1, ulysses=4, device="cpu", attention_backend=None)
    with pytest.raises(ValueError, match="ring_degree=2 needs an attention backend that returns the log-sum-exp"):
        enable_context_parallel(transformer, None, ring=2, ulysses=1, device="cpu", attention_backend=None)
    with pytest.raises(ValueError, match="attention_backend='_native_cudnn' needs CUDA"):
        attention_backend_for("_native_cudnn", "cpu", ring=1)
    assert attention_backend_for("auto", "cuda", ring=2) == "_native_cudnn"
    assert attention_backend_for("auto", "cpu", ring=1) is None
