"""``warm_up``: the shapes users send run through a request's whole path before a group serves, so a
first request at a warmed shape traces and compiles nothing."""

from __future__ import annotations

import pytest
from support import max_abs_diff, reference_frames

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import WarmUpShape
from ray_hsdp.group import ShardGroup
from ray_hsdp.serve.media import to_uint8
from ray_hsdp.serve.replica.warm_up import start_warm
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest, to_generation_request, to_video_request


def test_warm_up_defaults_to_the_default_size_with_compile_and_is_checked_against_the_limits():
    assert AppConfig(default_size="96x64").warm_up_shapes() == []
    assert AppConfig(default_size="96x64", compile=True).warm_up_shapes() == [WarmUpShape(size="96x64")]
    assert AppConfig(compile=True, warm_up=[]).warm_up_shapes() == []
    shapes = [{"size": "832x480", "num_frames": 81}]
    assert AppConfig(warm_up=shapes).warm_up_shapes() == [WarmUpShape(size="832x480", num_frames=81)]
    with pytest.raises(ValueError, match="warm_up size 1920x1088 exceeds max_pixels"):
        AppConfig(warm_up=[{"size": "1920x1088"}])
    with pytest.raises(ValueError, match="warm_up num_frames=161 exceeds max_frames=129"):
        AppConfig(warm_up=[{"size": "64x64", "num_frames": 161}])
    with pytest.raises(ValueError, match="multiples of 16"):
        AppConfig(warm_up=[{"size": "65x64"}])


def test_a_first_request_at_a_warmed_shape_compiles_nothing_and_equals_diffusers(
    ray_cluster, tiny_model, reference_pipe
):
    """The default warm-up of a compiled group, as a replica builds its group (on every lane: the
    same ``on_every_lane`` as compile's own warm-up, ``test_adaptive_lanes``): each route's default
    shape, a video at the default clip length and (issue 73) an image, so that user requests of
    both routes then trace nothing (dynamo's graph count stays; no run is marked as compiled), and
    no block reached its recompile limit. The warm-up is no user's
    request: no listener hears of it, the group learns no time from it, and the start's phases show
    it. (What a second warmed shape does: ``ray_hsdp.group.warm_up``'s docstring.)"""
    # Half a second at 16 fps: the default clip is 9 frames.
    config = AppConfig(
        model=tiny_model, device="cpu", shard_size=1, compile=True, default_steps=2, default_size="96x64",
        default_video_seconds=0.5,
    )  # fmt: skip
    records = []
    group = ShardGroup(config)
    group.listeners.append(records.append)
    start_warm(group, config)  # as a replica builds its group
    try:
        warmed = group.tick_stats()
        assert records == [] and group.lane_times.as_dict() == {}
        # What the metrics count from (issue 73): the ranks' counts once warm, no request's peak.
        assert [s["compiled_graphs"] for s in group.warm_up_stats] == [s["compiled_graphs"] for s in warmed]
        assert all(s["compiled_graphs"] > 0 and s["last_request_peak_device_bytes"] == 0 for s in group.warm_up_stats)
        assert group.phases.seconds["warm-up"] > 0
        requests = []
        for i in range(2):
            body = VideoCreateRequest(prompt="a red fox", size="96x64", num_frames=9, seed=3 + i)
            request, _ = to_video_request(body, config, 4, request_id=f"user-{i}")
            requests.append(request)
        image = ImageGenerationRequest(prompt="a red fox", seed=5)  # the image route, at the defaults
        requests.append(to_generation_request(image, config, request_id="user-image"))
        results = [future.result() for future in [group.submit(r) for r in requests]]
        after = group.tick_stats()
        compiled_blocks = group.memory()[0]["compile"]
    finally:
        group.shutdown()
    assert [s["compiled_graphs"] for s in after] == [s["compiled_graphs"] for s in warmed]
    assert all(s["compiled_graphs"] > 0 and s["recompile_limit_hits"] == 0 for s in after)
    # An unsharded rank's blocks (those diffusers' regional compile would pick), each one graph.
    assert compiled_blocks["modules"] > 0 and compiled_blocks["graph_breaks"] == 0, compiled_blocks
    assert sorted(r.request_id for r in records) == ["user-0", "user-1", "user-image"]
    assert not any(r.compiled for r in records)
    for request, result in zip(requests, results):  # uint8 frames: one level apart at most, at a rounding edge
        assert max_abs_diff(result.frames, to_uint8(reference_frames(reference_pipe, request))) <= 1


def test_a_warm_up_of_the_steps_alone_compiles_what_the_first_request_needs(ray_cluster, tiny_model, reference_pipe):
    """Issue 74: a shape warmed as by default (``decode: false``) runs the transformer's steps only
    (the pipeline returns latents; no decode, no encoding: the warm-up's own record says so), one
    with ``decode: true`` its whole path; a first request at the shape compiles nothing more and
    equals diffusers."""
    config = AppConfig(
        model=tiny_model, device="cpu", shard_size=1, compile=True, default_steps=2,
        warm_up=[{"size": "96x64", "num_frames": 9}, {"size": "96x64", "num_frames": 9, "decode": True}],
    )  # fmt: skip
    group = start_warm(ShardGroup(config), config)
    try:
        steps_only, whole = group.describe()["start"]["warm_up"]
        assert steps_only["shape"] == whole["shape"] == "96x64x9" and steps_only["compiled"], steps_only
        assert "encode_s" not in steps_only and whole["encode_s"] > 0 and not whole["compiled"], whole
        warmed = group.tick_stats()
        body = VideoCreateRequest(prompt="a red fox", size="96x64", num_frames=9, seed=3)
        request, _ = to_video_request(body, config, 4, request_id="user")
        (result,) = group.generate([request])
        after = group.tick_stats()
    finally:
        group.shutdown()
    assert [s["compiled_graphs"] for s in after] == [s["compiled_graphs"] for s in warmed]
    assert max_abs_diff(result.frames, to_uint8(reference_frames(reference_pipe, request))) <= 1


def test_a_shape_the_model_does_not_take_fails_the_deploy_once_before_any_weight(server):
    """Issue 73: ``serve deploy`` of a model whose warm-up shape it cannot take (6 frames: Wan's VAE
    takes 4k+1) ends DEPLOY_FAILED with the shape named, from the application's build: no replica
    starts, no rank reads a weight, Serve retries nothing. (Before, each replica refused it after
    its group's full load, and Serve started replicas again.)"""
    import ray
    from ray import serve

    from ..served import deploy_config

    app = {
        "name": "bad-warm-up",
        "route_prefix": "/bad-warm-up",
        "import_path": "ray_hsdp.serve:build_model",
        "args": {"model": "tiny", "device": "cpu", "shard_size": 1, "warm_up": [{"size": "64x64", "num_frames": 6}]},
    }
    try:
        with pytest.raises(RuntimeError, match="DEPLOY_FAILED") as failed:
            deploy_config(server, [app], timeout_s=60)
        assert "num_frames': 6}: num_frames=6 is not a count this model" in str(failed.value).replace("\\", "")
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "bad-warm-up#" in a["name"]]
    finally:
        serve.delete("bad-warm-up")


def test_an_adapters_schedule_its_pipeline_cannot_run_fails_the_start_not_each_request():
    from ray_hsdp.config.app import AppConfig
    from ray_hsdp.serve.replica.warm_up import refuse_adapter_schedules

    sigmas = AppConfig(model="tiny", loras={"d": "tiny-detail"}, lora_defaults={"d": {"sigmas": [1.0, 0.5]}})
    with pytest.raises(ValueError, match="lora_defaults 'd': sigmas with the pipeline's own scheduler"):
        refuse_adapter_schedules(sigmas, {"euler": False})  # Wan's UniPC
    refuse_adapter_schedules(sigmas, {"euler": True})
    refuse_adapter_schedules(sigmas.model_copy(update={"sample_solver": "euler"}), {"euler": False})
    boundary = AppConfig(model="tiny", loras={"d": "tiny-detail"}, lora_defaults={"d": {"boundary_ratio": 0.9}})
    with pytest.raises(ValueError, match="boundary_ratio on a one-expert model"):
        refuse_adapter_schedules(boundary, {"guidance_scale_2": False})
    refuse_adapter_schedules(boundary, {"guidance_scale_2": True})
