"""Two models behind one endpoint (``serve_configs/tiny_cpu_models.yaml``): the tiny Wan and the
tiny Qwen-Image, each its own pool of shard groups, one ingress in front. The official ``openai``
client picks the model by ``model``; each answer equals its unsharded diffusers run."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from support import embedded_pipeline, reference_frames, wait_until
from test_model_qwen_image import model_card_frames

from ray_hsdp.request import GenerationRequest
from ray_hsdp.serve.media import decode_mp4

YAML = Path(__file__).resolve().parents[2] / "serve_configs" / "tiny_cpu_models.yaml"
APP = "models"
READY = {"tiny-wan": "ready", "tiny-qwen-image": "ready"}


def applications(qwen_steps: int = 3, endpoint_fields: dict | None = None) -> list[dict]:
    """The YAML's applications, its endpoint at ``/models`` as app ``models`` (beside the shared
    server's own at ``/``), with the tiny Qwen-Image's ``default_steps`` and the ingress'
    ``user_config`` as given."""
    apps = yaml.safe_load(YAML.read_text())["applications"]
    endpoint, wan, qwen = apps
    endpoint = {**endpoint, "name": APP, "route_prefix": f"/{APP}"}
    if endpoint_fields is not None:
        endpoint["deployments"] = [{"name": "OpenAIIngress", "user_config": endpoint_fields}]
    qwen = {**qwen, "args": {**qwen["args"], "default_steps": qwen_steps}}
    return [endpoint, wan, qwen]


@pytest.fixture(scope="module")
def models_app(server):
    """The YAML's applications, deployed as ``serve deploy`` deploys them (the endpoint at
    ``/models``, beside the tiny server: one Serve)."""
    from ray import serve

    from .served import deploy_config

    deploy_config(server, applications())
    url = f"{server}/{APP}"
    wait_until(lambda: models_ready(url), 120, "both models ready", interval_s=0.5)
    yield url
    for app in (APP, "tiny-wan", "tiny-qwen-image"):
        serve.delete(app, _blocking=False)  # its ranks stop while the next tests run


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float32)


def test_one_endpoint_lists_both_models_and_routes_each_request_to_its_own_pool(models_app, reference_pipe):
    import openai

    client = openai.OpenAI(base_url=f"{models_app}/v1", api_key="unused", max_retries=0, timeout=300)
    listed = {model.id: model.model_dump() for model in client.models.list().data}
    assert listed["tiny-wan"]["kind"] == "video" and listed["tiny-wan"]["input"] == "text", listed
    assert listed["tiny-qwen-image"]["kind"] == "image" and listed["tiny-qwen-image"]["input"] == "text", listed
    assert list(listed) == ["tiny-wan", "tiny-qwen-image"]  # the configuration's order

    # Each model answers its own request, equal to its unsharded diffusers run for the same seed.
    common = {"prompt": "a red fox", "size": "64x64"}
    qwen = client.images.generate(model="tiny-qwen-image", **common, extra_body={"seed": 3, "num_inference_steps": 3})
    _, pipe = embedded_pipeline("tiny-qwen-image")
    request = GenerationRequest(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3)
    expected = (np.clip(model_card_frames(pipe, request)[0, 0], 0, 1) * 255).round()
    assert np.abs(pixels(qwen.data[0].b64_json) - expected).max() <= 1
    wan = client.images.generate(model="tiny-wan", **common, extra_body={"seed": 3, "num_inference_steps": 3})
    wan_request = GenerationRequest(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3)
    expected_wan = (np.clip(reference_frames(reference_pipe, wan_request)[0, 0], 0, 1) * 255).round()
    assert np.abs(pixels(wan.data[0].b64_json) - expected_wan).max() <= 1
    # The two differ by far more than the tolerance: a request sent to the wrong pool would fail above.
    assert np.abs(expected - expected_wan).mean() > 20
    # vllm-omni's chat route for the image model: the image as a data URL part, the same pixels.
    chat = requests.post(
        f"{models_app}/v1/chat/completions",
        json={
            "model": "tiny-qwen-image",
            "messages": [{"role": "user", "content": "a red fox"}],
            "extra_body": {"height": 64, "width": 64, "seed": 3, "num_inference_steps": 3},
        },  # fmt: skip
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    part = chat.json()["choices"][0]["message"]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    assert np.abs(pixels(part["image_url"]["url"].split(",", 1)[1]) - expected).max() <= 1

    # Each model's pool has shard groups of its own: its own ranks, on bundles of its own.
    pools = requests.get(f"{models_app}/v1/pool", timeout=60).json()["data"]
    assert [pool["model"] for pool in pools] == ["tiny-wan", "tiny-qwen-image"]
    ranks = [{(rank["node_id"], rank["pid"]) for rank in pool["ranks"]} for pool in pools]
    assert all(len(r) == 2 for r in ranks) and not ranks[0] & ranks[1], ranks
    # Each group's ranks in one placement group (as each rank's process reports it), one per bundle.
    bundles = [{(rank["placement_group"], rank["bundle"]) for rank in pool["ranks"]} for pool in pools]
    groups = [{placement for placement, _ in b} for b in bundles]
    assert [len(b) for b in bundles] == [2, 2] and [len(g) for g in groups] == [1, 1], bundles
    assert None not in groups[0] | groups[1] and not groups[0] & groups[1], groups
    one = requests.get(f"{models_app}/v1/pool", params={"model": "tiny-qwen-image"}, timeout=60).json()
    assert one["model"] == "tiny-qwen-image" and one["shard_size"] == 2, one


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code", "mentions"),
    [
        # With two models a request must name one; an unknown one is OpenAI's model_not_found.
        ("/v1/images/generations", {"prompt": "a"}, 400, None, None, "model is required"),
        ("/v1/images/generations", {"prompt": "a", "model": "sora"}, 404, "model", "model_not_found", "sora"),
        # A request of the wrong kind names the model and what it makes.
        ("/v1/videos", {"prompt": "a", "model": "tiny-qwen-image"}, 400, None, None, "tiny-qwen-image makes images"),
    ],
)
def test_a_request_names_a_model_it_may_ask(models_app, path, body, status, param, code, mentions):
    response = requests.post(f"{models_app}{path}", json=body, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and mentions in error["message"], error


def models_ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).json()["models"] == READY
    except (requests.RequestException, ValueError, KeyError):  # its route is not up yet
        return False


def refused_create(url: str, body: dict) -> dict | None:
    """The error of a create the endpoint refuses (429), or None; one it takes is deleted at once.
    (Not the response: a 4xx response is falsy.)"""
    response = requests.post(f"{url}/v1/videos", json=body, timeout=60)
    if response.status_code == 200:
        requests.delete(f"{url}/v1/videos/{response.json()['id']}", timeout=60)
    return response.json()["error"] if response.status_code == 429 else None


def ingress_actors() -> set[str]:
    """The named actors of the endpoint's ingress replicas (a restart replaces them)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#OpenAIIngress#" in a["name"]}


def pool_of(url: str, model: str) -> tuple[str, set]:
    """The replica of a model's group and its ranks' processes."""
    pool = requests.get(f"{url}/v1/pool", params={"model": model}, timeout=60).json()
    return pool["replica"], {(rank["node_id"], rank["pid"]) for rank in pool["ranks"]}


def test_an_edit_of_one_model_restarts_it_alone_and_an_endpoint_edit_restarts_nothing(
    models_app, server, reference_pipe
):
    """Issue 73: with a video job of the tiny Wan running, a deploy that edits the tiny Qwen-Image's
    ``default_steps`` restarts that model's group alone, and one that edits the ingress'
    ``max_video_jobs`` applies in place: the job completes and its MP4 equals its unsharded run,
    the tiny Wan's ranks keep their processes and the ingress its replica through both. (Before,
    one application: every edit restarted every group and emptied the job table.)"""
    from .served import deploy_config
    from .test_videos import SAME_MP4_MAE, as_mp4, mae, reference_video

    wan_before, qwen_before = pool_of(models_app, "tiny-wan"), pool_of(models_app, "tiny-qwen-image")
    ingress = ingress_actors()
    body = {"model": "tiny-wan", "prompt": "a fox in the snow", "size": "64x64", "num_frames": 9, "seed": 5}
    created = requests.post(f"{models_app}/v1/videos", json={**body, "num_inference_steps": 120}, timeout=60)
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]

    deploy_config(server, applications(qwen_steps=5))
    wait_until(lambda: pool_of(models_app, "tiny-qwen-image")[0] != qwen_before[0], 120, "Qwen-Image's new group")
    wait_until(lambda: models_ready(models_app), 60, "both models ready again", interval_s=0.5)
    image = requests.post(f"{models_app}/v1/images/generations", json={"model": "tiny-qwen-image", "prompt": "a"})
    assert image.status_code == 200 and image.json()["num_inference_steps"] == 5, image.text  # the edit applies

    deploy_config(server, applications(qwen_steps=5, endpoint_fields={"max_video_jobs": 1}))
    refused = wait_until(lambda: refused_create(models_app, body), 120, "max_video_jobs=1 in place", interval_s=0.5)
    assert "max_video_jobs=1" in refused["message"], refused
    assert ingress_actors() == ingress  # the same ingress replicas: no restart

    video = wait_until(
        lambda: (
            (v := requests.get(f"{models_app}/v1/videos/{video_id}", timeout=60).json())["status"]
            in ("completed", "failed")
            and v
        ),
        120,
        "the video job finishing",
        interval_s=0.2,
    )
    assert video["status"] == "completed" and video["attempt"] == 1, video  # it never moved
    mp4 = requests.get(f"{models_app}/v1/videos/{video_id}/content", timeout=60).content
    frames, _ = decode_mp4(mp4)
    expected = reference_video(reference_pipe, body["prompt"], 5, 9, 120)
    assert mae(frames, as_mp4(expected)) <= SAME_MP4_MAE
    assert pool_of(models_app, "tiny-wan") == wan_before  # the Wan's replica and ranks' processes


def test_one_models_outage_fails_its_own_health_and_not_the_endpoints(models_app):
    """Issue 82: with the image model's application deleted (its groups gone), ``/health`` stays
    200 at every probe, since the endpoint still answers for the tiny Wan, and
    ``/health?model=tiny-qwen-image`` is 503 with ``Retry-After`` (before: ``/health`` was 503 for
    every model). Last in the module: it leaves the endpoint without its image model."""
    from ray import serve

    serve.delete("tiny-qwen-image", _blocking=False)

    def image_model_down():
        whole = requests.get(f"{models_app}/health", timeout=5)
        assert whole.status_code == 200, whole.text  # at every probe, the image model's fall included
        one = requests.get(f"{models_app}/health", params={"model": "tiny-qwen-image"}, timeout=5)
        return one.status_code == 503 and (one.headers.get("Retry-After"), one.json())

    retry_after, body = wait_until(image_model_down, 60, "the image model's health failing", interval_s=0.25)
    assert retry_after is not None and int(retry_after) >= 1
    assert body["status"] == "unavailable" and body["models"] == {"tiny-qwen-image": "degraded"}, body
    whole = requests.get(f"{models_app}/health", timeout=5)
    assert whole.status_code == 200, whole.text
    assert whole.json()["models"] == {"tiny-wan": "ready", "tiny-qwen-image": "degraded"}, whole.json()
    assert "tiny-qwen-image" in whole.json()["errors"]  # why, for a caller with the key (none is asked here)
    assert requests.get(f"{models_app}/health", params={"model": "tiny-wan"}, timeout=5).status_code == 200
    # The model the probe keeps in service does serve.
    image = requests.post(
        f"{models_app}/v1/images/generations",
        json={"model": "tiny-wan", "prompt": "a", "size": "64x64", "num_inference_steps": 2},
        timeout=120,
    )
    assert image.status_code == 200, image.text
