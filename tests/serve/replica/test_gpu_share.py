"""More models than GPUs (issue 83, ``serve_configs/tiny_cpu_share.yaml``): the tiny Wan and the tiny
Qwen-Image on one GPU share that holds one of them awake. Alternating requests each equal their lone
diffusers run; the states and metrics follow; requests sent during a wake wait and are answered; a
rank of the sleeping model killed: that model comes back, the other keeps serving."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import ray
import requests
import yaml
from support import embedded_pipeline, reference_frames, wait_until
from test_model_qwen_image import model_card_frames

from ray_hsdp.request import GenerationRequest
from ray_hsdp.serve.replica.gpu_share import SHARE_NAMESPACE, close_share, share_actor_name

from ..prometheus import scrape, total
from ..test_many_models import pixels

YAML = Path(__file__).resolve().parents[3] / "serve_configs" / "tiny_cpu_share.yaml"
APP, WAN, QWEN, SHARE = "share", "share-wan", "share-qwen", "test-share"


def applications() -> list[dict]:
    """The YAML's applications, its endpoint at ``/share``, its models renamed (beside the other
    modules' apps on the one Serve) on a share of their own."""
    endpoint, wan, qwen = yaml.safe_load(YAML.read_text())["applications"]
    endpoint = {**endpoint, "name": APP, "route_prefix": f"/{APP}", "args": {"models": [WAN, QWEN]}}
    wan = {**wan, "name": WAN, "args": {**wan["args"], "model_name": WAN, "gpu_share": SHARE}}
    qwen = {**qwen, "name": QWEN, "args": {**qwen["args"], "model_name": QWEN, "gpu_share": SHARE}}
    return [endpoint, wan, qwen]


def states(url: str) -> dict:
    try:
        return requests.get(f"{url}/health", timeout=5).json()["models"]
    except (requests.RequestException, ValueError, KeyError):
        return {}


def share_states() -> dict:
    actor = ray.get_actor(share_actor_name(SHARE), namespace=SHARE_NAMESPACE)
    return ray.get(actor.states.remote())


@pytest.fixture(scope="module")
def share_app(server):
    from ray import serve

    from ..served import deploy_config

    deploy_config(server, applications(), timeout_s=240)
    url = f"{server}/{APP}"
    wait_until(lambda: sorted(states(url).values()) == ["ready", "sleeping"], 120, "one awake, one asleep", 0.5)
    yield url
    for app in (APP, WAN, QWEN):
        serve.delete(app)
    close_share(SHARE)


def generate(url: str, model: str, seed: int) -> np.ndarray:
    body = {"model": model, "prompt": "a red fox", "size": "64x64", "seed": seed}
    response = requests.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return pixels(response.json()["data"][0]["b64_json"])


def expected(model: str, seed: int, reference_pipe) -> np.ndarray:
    if model == WAN:
        request = GenerationRequest(prompt="a red fox", width=64, height=64, num_inference_steps=4, seed=seed)
        frames = reference_frames(reference_pipe, request)
    else:
        _, pipe = embedded_pipeline("tiny-qwen-image")
        request = GenerationRequest(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=seed)
        frames = model_card_frames(pipe, request)
    return (np.clip(frames[0, 0], 0, 1) * 255).round()


def test_alternating_requests_wake_each_model_in_turn_and_equal_their_lone_runs(share_app, reference_pipe):
    before = share_states()
    wakes_before = {model: before[model]["wakes"] for model in (WAN, QWEN)}
    for seed, model in enumerate([WAN, QWEN, WAN, QWEN]):
        image = generate(share_app, model, seed)
        assert np.abs(image - expected(model, seed, reference_pipe)).max() <= 1, model
        other = QWEN if model == WAN else WAN
        # One awake at a time: the model that answered is awake, the other asleep (its weights parked).
        now = share_states()
        assert now[model]["state"] == "ready" and now[other]["state"] == "sleeping", now
        assert now[other]["parked_bytes"] > 0 and now[model]["parked_bytes"] == 0
        wait_until(lambda m=model, o=other: states(share_app) == {m: "ready", o: "sleeping"}, 10, "the health states")
        health = requests.get(f"{share_app}/health", params={"model": other}, timeout=5)
        assert health.status_code == 200 and health.json()["models"] == {other: "sleeping"}
    after = share_states()
    woke = {model: after[model]["wakes"] - wakes_before[model] for model in (WAN, QWEN)}
    assert sum(woke.values()) >= 3 and all(n >= 1 for n in woke.values()), woke
    listed = {m["id"]: m["state"] for m in requests.get(f"{share_app}/v1/models", timeout=5).json()["data"]}
    assert listed == {QWEN: "ready", WAN: "sleeping"}

    def metrics_say_it() -> bool:
        text = scrape()
        return (
            total(text, "ray_hsdp_wakes_total", model=WAN) >= woke[WAN]
            and total(text, "ray_hsdp_sleeping_bytes", model=WAN) == after[WAN]["parked_bytes"] > 0
        )

    wait_until(metrics_say_it, 60, "wakes and sleeping bytes in the metrics", interval_s=1)


def test_requests_sent_during_a_wake_wait_for_it_and_are_answered(share_app, reference_pipe):
    # Both models at once, twice each: every request waits its turn (never a 503) and equals its run.
    order = [WAN, QWEN, WAN, QWEN]
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        images = list(pool.map(lambda args: generate(share_app, *args), [(m, 10 + i) for i, m in enumerate(order)]))
    for i, (model, image) in enumerate(zip(order, images)):
        assert np.abs(image - expected(model, 10 + i, reference_pipe)).max() <= 1, model


def test_a_sleeping_model_that_lost_a_rank_comes_back_while_the_other_serves(share_app, reference_pipe):
    generate(share_app, QWEN, 1)  # the Wan sleeps
    assert share_states()[WAN]["state"] == "sleeping"
    actor = ray.get_actor(share_actor_name(SHARE), namespace=SHARE_NAMESPACE)
    ranks = ray.get(actor.rank_handles.remote(WAN))
    ray.kill(ranks[1], no_restart=True)
    # Its replica notices within seconds and rebuilds its group alone (its state leaves "sleeping").
    wait_until(lambda: share_states()[WAN]["state"] != "sleeping", 60, "the Wan's rebuild to start", interval_s=0.2)
    # The Qwen-Image answers on, equal to its run (taking its turn on the GPUs as the Wan loads).
    assert np.abs(generate(share_app, QWEN, 2) - expected(QWEN, 2, reference_pipe)).max() <= 1
    image = generate(share_app, WAN, 3)
    assert np.abs(image - expected(WAN, 3, reference_pipe)).max() <= 1
    assert ray.get(actor.rank_handles.remote(WAN))[1]._actor_id != ranks[1]._actor_id


def test_a_video_job_waiting_for_its_model_says_so_and_runs_once_the_other_is_done(share_app):
    generate(share_app, QWEN, 1)  # the Wan sleeps
    wait_until(lambda: states(share_app) == {QWEN: "ready", WAN: "sleeping"}, 10, "the health states")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # A long Qwen-Image request holds its model awake: the Wan cannot wake until it is answered.
        long = pool.submit(
            requests.post,
            f"{share_app}/v1/images/generations",
            json={"model": QWEN, "prompt": "a red fox", "size": "64x64", "seed": 5, "num_inference_steps": 60},
            timeout=300,
        )
        wait_until(lambda: share_states()[QWEN]["in_flight"] == 1, 30, "the long request to run")
        body = {"model": WAN, "prompt": "a red fox runs", "size": "64x64", "num_frames": 5, "seed": 2}
        job = requests.post(f"{share_app}/v1/videos", json=body, timeout=60).json()
        seen = requests.get(f"{share_app}/v1/videos/{job['id']}", timeout=10).json()
        assert seen["status"] == "queued" and seen.get("model_state") in ("sleeping", "waking"), seen
        assert long.result().status_code == 200
    done = wait_until(
        lambda: (
            (v := requests.get(f"{share_app}/v1/videos/{job['id']}", timeout=10).json())["status"] == "completed" and v
        ),
        120,
        "the video job to complete",
        interval_s=0.5,
    )
    assert "model_state" not in done and share_states()[WAN]["state"] == "ready"
