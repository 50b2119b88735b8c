"""Step caches per request (issue 24): diffusers' First Block Cache and TaylorSeer hooks on the
sharded transformer, each request with its own cache state and settings, set by the tick thread
around each of its forwards. A cached request equals the unsharded pipeline with the same hook; an
uncached one on the same group equals the plain run; ranks that reuse their caches at different
steps stay in lock step; a lane that splits the sequence takes the same decisions on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import max_abs_diff, reference_with

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import StepCacheConfig
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest, StepCache

#: First Block Cache with a threshold no change reaches: every step after the first reuses the
#: cache, so the count is known. TaylorSeer's schedule: step 0 in full, then one in every 2.
SCHEDULES = {
    "first_block": StepCache("first_block", threshold=1e9),
    "taylorseer": StepCache("taylorseer", interval=2, warmup_steps=1),
}


def reused_forwards(cache: StepCache, steps: int) -> int:
    """Forwards (cond and uncond) that reuse the cache in a guided request of ``steps`` steps."""
    if cache.kind == "first_block":  # a threshold no change reaches: every step after the first
        return 2 * (steps - 1)
    full = [k < cache.warmup_steps or (k - cache.warmup_steps - 1) % cache.interval == 0 for k in range(steps)]
    return 2 * full.count(False)


def request(rid: str, steps: int, cache: StepCache | None, **fields) -> GenerationRequest:
    base = dict(prompt="a cat bakes a cake", seed=1, num_inference_steps=steps, num_frames=5, request_id=rid)
    return GenerationRequest(**{**base, **fields, "cache": cache})


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_cached_and_uncached_requests_of_different_steps_share_a_batch_group(
    kind, ray_cluster, reference_pipe, tiny_model
):
    """2 ranks, 2 requests on each at once: three cached (two of them on one rank together, whatever
    the placement) and one uncached, of 6 and 4 steps. The ranks reuse their caches at different
    ticks and stay in lock step (FSDP2 still gathers a skipped block); each cached request equals
    the unsharded pipeline with the same hook, the uncached one the plain run."""
    cache = SCHEDULES[kind]
    requests = [
        request("cached-6", 6, cache),
        request("plain-4", 4, None, prompt="waves on rocks", seed=3),
        request("cached-4", 4, cache, prompt="a red fox in the snow", seed=2),
        request("cached-6b", 6, cache, seed=4),
    ]
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=2, cache={"kind": kind})
    other = next(c for k, c in SCHEDULES.items() if k != kind)
    with ShardGroup(config) as group:
        refused = r"a group's cache kind \(or none\) with a request's step cache of another kind"
        with pytest.raises(ValueError, match=refused):
            group.submit(request("other", 2, other))
        group.start_profile()
        results = group.generate(requests)
        profiles = group.stop_profile()
        stats = group.tick_stats()
        # A cached request cut off part way by its deadline leaves no state behind: the next one,
        # under the same id, equals its unsharded run.
        cut = request("cut", 400, cache, timeout_s=1.0)
        with pytest.raises(TimeoutError, match="missed its deadline"):
            group.submit(cut).result(timeout=60)
        following = dataclasses.replace(cut, num_inference_steps=4, timeout_s=None)
        (again,) = group.generate([following])
    assert max_abs_diff(again.frames, reference_with(reference_pipe, following)) <= 1e-5
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_with(reference_pipe, req)) <= 1e-5, req.request_id
        expected = reused_forwards(cache, req.num_inference_steps) if req.cache else None
        assert result.cached_forwards == expected, req.request_id
    cached = [r for r in requests if r.cache is not None]
    expected = sum(reused_forwards(cache, r.num_inference_steps) for r in cached)
    assert sum(s["step_cache_reused"] for s in stats) == expected
    # The cache changes what a cached request computes (else this test would show nothing).
    uncached = reference_with(reference_pipe, dataclasses.replace(requests[0], cache=None))
    assert max_abs_diff(results[0].frames, uncached) > 1e-3
    placed = {rid: p["rank"] for p in profiles for rid in p["requests"]}
    assert sorted(placed.values()) == [0, 0, 1, 1]  # two requests on each rank, at once


def test_a_lane_of_ulysses_2_takes_the_same_first_block_decisions_on_both_ranks(
    ray_cluster, reference_pipe, tiny_model
):
    """The first block's output is split over the lane's two ranks: each sums its part of the change
    and the lane compares the whole, so both ranks skip the same steps (a rank that skipped alone
    would leave its peer in an attention all-to-all) and the decisions are the unsharded run's. The
    threshold sits among this model's changes (about 0.74 to 1.19), so some steps skip, some not."""
    cache = StepCache("first_block", threshold=1.03)
    requests = [request("lane-cached", 6, cache), request("lane-plain", 4, None, seed=5)]
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, ulysses_degree=2, cache={"kind": "first_block"})
    with ShardGroup(config) as group:
        results = group.generate(requests)
        stats = group.tick_stats()
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_with(reference_pipe, req)) <= 1e-5, req.request_id
    reused = results[0].cached_forwards
    assert 0 < reused < 10, reused
    assert [s["step_cache_reused"] for s in stats] == [reused, reused]


def test_requests_choose_their_cache_and_bad_ones_are_refused():
    from ray_hsdp.serve.schema import (
        ImageGenerationRequest,
        RequestLimitError,
        VideoCreateRequest,
        to_generation_request,
    )

    config = AppConfig(model="tiny", device="cpu", cache={"kind": "taylorseer", "interval": 3})

    def mapped(cache):
        return to_generation_request(ImageGenerationRequest(prompt="a", cache=cache), config, "r").cache

    assert mapped(None) == mapped("on") == StepCache("taylorseer", interval=3)
    assert mapped("off") is None and mapped(False) is None
    assert mapped({"interval": 4, "warmup_steps": 2}) == StepCache("taylorseer", interval=4, warmup_steps=2)
    # A form carries the object as JSON.
    assert VideoCreateRequest(prompt="a", cache='{"interval": 5}').cache == {"interval": 5}
    for bad, message in [
        ({"interval": 0}, r"cache.interval: Input should be greater than or equal to 1 \(got 0\)"),
        ({"kind": "first_block"}, "this deployment loads the 'taylorseer' step cache only"),
        ({"speed": 2}, r"unknown field\(s\) \['speed'\]"),
    ]:
        with pytest.raises(RequestLimitError, match=message):
            mapped(bad)
    with pytest.raises(ValueError, match="cache must be 'on', 'off' or an object"):
        config.cache.resolve([1])
    plain = AppConfig(model="tiny", device="cpu")
    assert to_generation_request(ImageGenerationRequest(prompt="a"), plain, "r").cache is None
    with pytest.raises(RequestLimitError, match="this deployment has no step cache"):
        to_generation_request(ImageGenerationRequest(prompt="a", cache="on"), plain, "r")
    optional = StepCacheConfig(kind="first_block", every_request=False)
    assert optional.resolve(None) is None and optional.resolve("on") == StepCache("first_block")
    with pytest.raises(ValueError, match=r"a step cache \(cache.kind\) with shard_size 1"):
        GroupConfig(model="tiny", shard_size=1, cache={"kind": "first_block"})


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_a_request_without_a_cache_keeps_no_cache_state(kind, tiny_model):
    """Issue 37: on a group with a cache kind, a request without a cache used to keep the hooks'
    state (First Block Cache: head output and residuals of cond and uncond, GBs for a video) until it
    ended. Now its forwards leave nothing behind; a cached request's state lives until it ends."""
    from diffusers import WanTransformer3DModel

    from ray_hsdp.sharding import step_cache

    model = WanTransformer3DModel.from_pretrained(f"{tiny_model}/transformer").eval()
    assert step_cache.enable(model, kind)
    caches = step_cache.StepCaches([model])
    managers = caches._managers[id(model)]
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 16, 2, 8, 8, generator=generator),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator),
        "return_dict": False,
    }
    plain, cached = 1, 2  # the requests' tickets
    with torch.no_grad():
        for step, context in enumerate(["cond", "uncond"] * 2):
            with caches.forward(model, plain, None, (context, {})):
                model(timestep=torch.tensor([900 - 100 * step]), **inputs)
            assert not any(m._state_cache for m in managers), step
        with caches.forward(model, cached, SCHEDULES[kind], ("cond", {})):
            model(timestep=torch.tensor([900]), **inputs)
    assert any(m._state_cache for m in managers)
    assert caches.release(plain) == 0 and caches.release(cached) == 0
    assert not any(m._state_cache for m in managers)
