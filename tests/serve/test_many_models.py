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
from support import embedded_pipeline, reference_frames
from test_model_qwen_image import model_card_frames

from ray_hsdp.request import GenerationRequest

YAML = Path(__file__).resolve().parents[2] / "serve_configs" / "tiny_cpu_models.yaml"
APP = "models"


@pytest.fixture(scope="module")
def models_app(server):
    """The YAML's application, built by ``build_app`` from its args as ``serve run`` builds it,
    deployed at ``/models`` beside the tiny server (one Serve: a second ``serve run`` would replace
    the shared server's applications)."""
    from ray import serve

    from .served import deploy

    args = yaml.safe_load(YAML.read_text())["applications"][0]["args"]
    yield deploy(server, APP, args)
    serve.delete(APP, _blocking=False)  # its ranks stop while the next tests run


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
