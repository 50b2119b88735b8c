"""Elastic serving (issue 23): Serve adds a shard group when the groups' own load (video jobs
included) calls for it, and a group it removes hands its running seeded video job to another."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
import requests
from PIL import Image
from support import pipeline_with_adapters, random_png, reference_with, wait_until

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import AutoscalingSpec
from ray_hsdp.serve.autoscaling import LOAD_METRIC, autoscaling_config, group_load_policy

from .prometheus import scrape, total
from .served import deploy

APP = "elastic"


def context(loads: dict[str, float], target: float, current: int = 1, low: int = 1, high: int = 3):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    return AutoscalingContext(
        deployment_id=None,
        deployment_name="HSDPServer",
        app_name=APP,
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=list(loads),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={LOAD_METRIC: loads} if loads else {},
        raw_metrics={},
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=AutoscalingConfig(min_replicas=low, max_replicas=high, target_ongoing_requests=target),
    )


def test_the_policy_sizes_the_pool_on_the_groups_own_load():
    # A group of 2 lanes at target_per_lane 2 holds 4.
    target = AutoscalingSpec(target_per_lane=2).target_per_lane * 2
    assert group_load_policy(context({"a": 4.0}, target))[0] == 1
    assert group_load_policy(context({"a": 4.0, "b": 1.0}, target, current=2))[0] == 2
    assert group_load_policy(context({"a": 9.0, "b": 9.0}, target, current=2))[0] == 3  # capped at max
    assert group_load_policy(context({"a": 0.0, "b": 0.0}, target, current=2))[0] == 1  # floored at min
    assert group_load_policy(context({}, target, current=2))[0] == 2  # no report yet: as it is
    config = autoscaling_config(AutoscalingSpec(min_groups=1, max_groups=4, target_per_lane=2), lanes_per_group=2)
    assert (config["min_replicas"], config["max_replicas"], config["target_ongoing_requests"]) == (1, 4, 4)
    assert config["policy"] == {"policy_function": "ray_hsdp.serve.autoscaling:group_load_policy"}
    # An adaptive group's lanes for scaling are its widest: a group of 4 ranks with lanes of 1, 2 and 4
    # holds one request at a time on its widest lane, not four (issue 54).
    adaptive = AppConfig(model="tiny", shard_size=4, lane_sizes=[1, 2, 4]).parallel_dims()
    assert (adaptive.num_lanes, adaptive.widest_lanes) == (4, 1)
    assert AppConfig(model="tiny", shard_size=4, lane_sizes=[1, 2]).parallel_dims().widest_lanes == 2
    assert AppConfig(model="tiny", shard_size=4, ulysses_degree=2).parallel_dims().widest_lanes == 2
    with pytest.raises(ValueError, match="max_groups=1 is below min_groups=2"):
        AppConfig(model="tiny", autoscaling={"min_groups": 2, "max_groups": 1})


def replicas(deadline_s: float, want: int) -> int:
    """Waits until the app runs ``want`` replicas (or the deadline); returns how many it runs."""
    from ray import serve

    deadline = time.monotonic() + deadline_s
    while True:
        deployment = serve.status().applications[APP].deployments["HSDPServer"]
        running = deployment.replica_states.get("RUNNING", 0)
        if running == want and sum(deployment.replica_states.values()) == want or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def exported(deadline_s: float, replica: str) -> dict[str, float]:
    """Waits until Prometheus shows the app's target groups at 1 and ``replica``'s group serving,
    or the deadline; returns what it last saw."""
    deadline = time.monotonic() + deadline_s
    while True:
        text = scrape()
        seen = {
            "target": total(text, "ray_hsdp_autoscaling_target_groups", application=APP),
            "serving": total(text, "ray_hsdp_group_state", application=APP, replica=replica, state="serving"),
            "draining": total(text, "ray_hsdp_group_state", application=APP, replica=replica, state="draining"),
        }
        if seen == {"target": 1, "serving": 1, "draining": 0} or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def wait_all(base: str, ids: list[str], deadline_s: float) -> list[dict]:
    deadline = time.monotonic() + deadline_s
    while True:
        jobs = [requests.get(f"{base}/v1/videos/{i}", timeout=30).json() for i in ids]
        if all(j["status"] in ("completed", "failed") for j in jobs) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.5)


def wait_running(base: str, video_id: str, deadline_s: float) -> dict | None:
    """Waits until a lane runs the job (or the deadline); returns its video object, or None."""
    deadline = time.monotonic() + deadline_s
    while (video := requests.get(f"{base}/v1/videos/{video_id}", timeout=30).json())["status"] != "in_progress":
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return video


def test_a_burst_adds_a_group_and_a_removed_group_hands_its_job_over(server):
    """Groups of one rank that run one request at a time and hold 2 (target_per_lane). (A group of
    one rank starts and steps fastest here; what is tested is the pool, not the sharding.) A burst of
    four long video jobs makes Serve add a second group; the burst is deleted once that serves. Two
    seeded jobs then run one on each group (a group runs one at a time; an idle group takes what is
    queued on the other), and their load (2) calls for one group. Serve removes one while both run:
    its job outlives drain_timeout_s and the other group takes it over with the same seed (one
    handed back to the replica it first queued on runs there: that replica had stopped its queued
    copy) once its lane frees. (That a moved job completes equal to its first run is
    test_videos' and test_retry's.)"""
    from ray import serve

    args = {
        "model": "tiny",
        "device": "cpu",
        "shard_size": 1,
        "requests_per_rank": 1,
        "default_size": "64x64",
        "max_steps": 8000,
        "drain_timeout_s": 0.5,
        "video_takeover_after_s": 0.5,
        "autoscaling": {
            "min_groups": 1,
            "max_groups": 2,
            "target_per_lane": 2,
            "upscale_delay_s": 0,
            # Starts once the burst is deleted: both seeded jobs run well within it (one queued on
            # a busy group moves within video_takeover_after_s and a poll).
            "downscale_delay_s": 4,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1,
        },
    }

    def video(prompt: str, steps: int, seed: int) -> str:
        body = {"prompt": prompt, "num_frames": 5, "num_inference_steps": steps, "seed": seed}
        return requests.post(f"{base}/v1/videos", json=body, timeout=60).json()["id"]

    base = deploy(server, APP, args)
    try:
        # The burst holds its load until the second group serves, however long its start takes.
        burst = [video(f"burst {i}", 3000, i) for i in range(4)]
        assert replicas(90, want=2) == 2
        for video_id in burst:
            assert requests.delete(f"{base}/v1/videos/{video_id}", timeout=30).status_code == 200
        # Longer than the test: no job ends before Serve removes a group, so the removed group always
        # holds a running job; the test, not the jobs' speed, decides when a lane frees.
        seeded = [video(f"seeded {i}", 8000, 100 + i) for i in range(2)]
        running = [wait_running(base, video_id, 30) for video_id in seeded]
        assert None not in running and len({video["replica"] for video in running}) == 2, running  # one on each
        assert replicas(60, want=1) == 1
        remaining = requests.get(f"{base}/v1/pool", timeout=30).json()["replica"]
        (moved,) = [v for v in running if v["replica"] != remaining]
        (kept,) = [v for v in running if v["replica"] == remaining]

        def get(video_id: str) -> dict:
            return requests.get(f"{base}/v1/videos/{video_id}", timeout=30).json()

        # The removed group's job is handed over (its attempt moves on), the other stays as it ran.
        handed = wait_until(lambda: (j := get(moved["id"]))["attempt"] > moved["attempt"] and j, 60, "a handover", 0.25)
        assert handed["retried"] is True and handed["status"] in ("queued", "in_progress"), handed
        assert (get(kept["id"])["retried"], get(kept["id"])["attempt"]) == (False, kept["attempt"])
        assert requests.delete(f"{base}/v1/videos/{kept['id']}", timeout=30).status_code == 200
        ran = wait_until(
            lambda: (j := get(moved["id"]))["status"] == "in_progress" and j["progress"] > 0 and j,
            60,
            "the moved job running on the remaining group",
            0.25,
        )
        assert ran["replica"] == remaining and ran["retried"] is True, ran
        assert requests.delete(f"{base}/v1/videos/{moved['id']}", timeout=30).status_code == 200
        # Once idle: the policy's answer (exported by Serve's controller) and the group's state.
        assert requests.get(f"{base}/v1/pool", timeout=30).json()["state"] == "serving"
        assert exported(30, remaining) == {"target": 1, "serving": 1, "draining": 0}
    finally:
        serve.delete(APP)


#: The takeover test's adapters and the defaults a request naming ``detail`` gets.
LORAS = {"style": "tiny-style", "detail": "tiny-detail"}
LORA_DEFAULTS = {"detail": {"flow_shift": 3.0}}


@pytest.fixture(scope="module")
def two_expert_i2v(tmp_path_factory):
    """The tiny two-expert image-to-video folder and its unsharded pipeline with the adapters."""
    from ray_hsdp.checkpoints.tiny import make_tiny

    folder = str(make_tiny(tmp_path_factory.mktemp("models") / "wan22-i2v", two_experts=True, image_to_video=True))
    return folder, pipeline_with_adapters(folder, LORAS)


def test_a_job_queued_behind_a_long_one_moves_to_the_group_that_frees_first(server, two_expert_i2v):
    """Two groups of one lane each (Ulysses 2), one request at a time, each busy with a long job (one
    queued behind the other is taken over by the idle group). Three jobs, a routing period apart,
    wait queued. The test then frees one group (it deletes that group's long job): that group runs
    what queued behind it and, with a free lane, takes over what still waits behind the other long
    job: all end on the group that freed first, while the other long job runs on. The test decides
    when a group frees, so no job's speed can change the outcome. The queued jobs carry request-level
    choices (adapters, an adapter's defaults, a step cache, flow_shift, guidance_scale_2, their
    image), and each one's first frame equals the unsharded pipeline's with the same choices
    whichever group ran it: a job moves whole."""
    from ray import serve

    from ray_hsdp.serve.schema import VideoCreateRequest, to_video_request

    folder, pipe = two_expert_i2v
    args = {
        "model": folder,
        "device": "cpu",
        "shard_size": 2,
        "ulysses_degree": 2,
        "replicate_size": 2,
        "requests_per_rank": 1,
        "default_size": "64x64",
        "default_steps": 4,
        "max_steps": 8000,
        "video_takeover_after_s": 1,
        "loras": LORAS,
        "lora_defaults": LORA_DEFAULTS,
        "cache": {"kind": "taylorseer", "every_request": False},
    }
    base = deploy(server, "takeover", args)

    def body(seed: int, **choices) -> dict:
        image = base64.b64encode(random_png(64, 48, seed)).decode()
        return {"prompt": f"job {seed}", "num_frames": 5, "seed": seed, "input_reference": image, **choices}

    def post(video: dict) -> str:
        return requests.post(f"{base}/v1/videos", json=video, timeout=60).json()["id"]

    def status(video_id: str) -> str:
        return requests.get(f"{base}/v1/videos/{video_id}", timeout=30).json()["status"]

    queued_bodies = [
        body(2, lora="style:0.8", cache="on", guidance_scale_2=2.0, flow_shift=2.0),
        body(3, lora="style:0.5,detail", cache={"interval": 3}),
        body(4),  # no cache, no adapter
    ]
    try:
        time.sleep(1.5)  # the router has seen both groups' load (routing stats come every second)
        # 8000 steps outlast the test many times over (500 take 25 s or more here); one of them is
        # stopped by the test, the other by the app's deletion.
        running = [wait_running(base, post(body(seed, num_inference_steps=8000)), 30) for seed in (0, 1)]
        assert None not in running, running
        kept, freed = running
        assert kept["replica"] != freed["replica"], running  # the second ran on the idle group
        queued = []
        for video in queued_bodies:
            if queued:
                time.sleep(1.5)  # the next one sees this one's load (routing stats come every second)
            queued.append(post(video))
        assert [status(i) for i in queued] == ["queued"] * 3  # no lane is free
        assert requests.delete(f"{base}/v1/videos/{freed['id']}", timeout=30).status_code == 200
        done = wait_all(base, queued, 120)
        assert [j["status"] for j in done] == ["completed"] * 3, [j["error"] for j in done]
        assert [j["replica"] for j in done] == [freed["replica"]] * 3, done  # whichever group each waited on
        long = requests.get(f"{base}/v1/videos/{kept['id']}", timeout=30).json()
        assert long["status"] == "in_progress" and long["replica"] == kept["replica"], long
        thumbnails = [
            requests.get(f"{base}/v1/videos/{i}/content", params={"variant": "thumbnail"}, timeout=30).content
            for i in queued
        ]
    finally:
        serve.delete("takeover")
    config = AppConfig(**args)
    for video, thumbnail in zip(queued_bodies, thumbnails):
        request, _ = to_video_request(VideoCreateRequest(**video), config, 4, "reference")
        expected = np.round(np.clip(reference_with(pipe, request)[0, 0], 0, 1) * 255)
        served = np.asarray(Image.open(io.BytesIO(thumbnail)), dtype=np.float64)
        assert np.abs(served - expected).max() <= 1, video["seed"]
