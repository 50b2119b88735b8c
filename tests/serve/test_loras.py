"""LoRA adapters over HTTP, on the shared ``serve run`` of tiny_cpu.yaml: its text-to-video app
registers ``style`` and ``detail``, its image-to-video app ``style`` (the embedded tiny adapters).
``GET /v1/loras`` lists them; ``lora`` in an image request (JSON) and in video jobs (JSON, and the
``openai`` client's multipart form with its ``lora[][name]`` fields) gives what diffusers' own
``load_lora_weights`` + ``set_adapters`` give on the unsharded pipeline; bad values are 400s."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import requests
from support import reference_frames

from ray_hsdp.loading.components import load_pipeline, resolve_lora_path, resolve_model_path
from ray_hsdp.request import GenerationRequest, fit_image, parse_lora
from ray_hsdp.serve.media import decode_mp4

from .served import png_pixels
from .test_videos import SAME_MP4_MAE, as_mp4, mae
from .test_videos_from_images import solid


def with_adapters(model: str, loras: dict[str, str]):
    """The unsharded embedded pipeline with ``loras`` (name -> embedded adapter) loaded by diffusers."""
    pipe = load_pipeline(resolve_model_path(model), "float32")
    pipe.set_progress_bar_config(disable=True)
    for name, source in loras.items():
        pipe.load_lora_weights(str(resolve_lora_path(source)), adapter_name=name)
    return pipe


@pytest.fixture(scope="module")
def t2v_pipe(server):  # after the server: its ranks wrote the embedded model and adapters
    return with_adapters("tiny", {"style": "tiny-style", "detail": "tiny-detail"})


def reference(pipe, request: GenerationRequest) -> np.ndarray:
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in request.lora], [scale for _, scale in request.lora])
    return (np.clip(reference_frames(pipe, request)[0], 0, 1) * 255).round()


def test_get_loras_lists_each_app_s_adapters(server):
    listed = requests.get(f"{server}/v1/loras", timeout=60).json()
    assert [(a["id"], a["components"], a["fused"], a["defaults"]) for a in listed["data"]] == [
        ("detail", ["transformer"], None, {"num_inference_steps": 2, "flow_shift": 3.0}),
        ("style", ["transformer"], None, {}),
    ]
    assert listed["max_loras_per_request"] == 4
    assert [a["id"] for a in requests.get(f"{server}/i2v/v1/loras", timeout=60).json()["data"]] == ["style"]


def test_an_image_with_two_adapters_equals_diffusers_own(server, t2v_pipe):
    body = {"prompt": "A small boat on a calm lake", "size": "64x64", "seed": 6, "num_inference_steps": 3}
    lora = [{"name": "style", "scale": 0.5}, "detail"]
    response = requests.post(f"{server}/v1/images/generations", json={**body, "lora": lora}, timeout=120)
    assert response.status_code == 200, response.text
    # detail's lora_defaults give the shift the request leaves out (its steps it gives).
    request = GenerationRequest(
        prompt=body["prompt"], num_inference_steps=3, seed=6, lora=parse_lora(lora), flow_shift=3.0
    )
    got, expected = png_pixels(response.json()), reference(t2v_pipe, request)[0]
    assert np.abs(got - expected).max() <= 1
    # The adapters reach the pixels: the tiny model moves them by about one level, in many more
    # pixels than rounding makes differ from the run with them.
    t2v_pipe.disable_lora()
    bare = (np.clip(reference_frames(t2v_pipe, dataclasses.replace(request, lora=()))[0, 0], 0, 1) * 255).round()
    assert (got != bare).mean() > 5 * (got != expected).mean() + 0.01, ((got != bare).mean(), (got != expected).mean())


def test_a_video_job_takes_the_string_form(server, t2v_pipe):
    body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 2}
    response = requests.post(f"{server}/v1/videos/sync", json={**body, "lora": "style:0.8"}, timeout=300)
    assert response.status_code == 200, response.text
    request = GenerationRequest(prompt="waves", num_frames=5, num_inference_steps=2, seed=2, lora=(("style", 0.8),))
    frames, _ = decode_mp4(response.content)
    assert mae(frames, as_mp4(reference(t2v_pipe, request))) <= SAME_MP4_MAE


def test_a_request_naming_an_adapter_gets_its_default_steps(server, t2v_pipe):
    """tiny_cpu.yaml: ``lora_defaults: {detail: {num_inference_steps: 2, flow_shift: 3.0}}``; the
    app's default is 4 steps at the scheduler's own shift."""
    body = {"prompt": "a lighthouse", "size": "64x64", "seed": 3, "lora": "detail"}
    response = requests.post(f"{server}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    ran = response.json()
    assert (ran["num_inference_steps"], ran["guidance_scale"], ran["flow_shift"]) == (2, 5.0, 3.0)
    request = GenerationRequest(
        prompt="a lighthouse", num_inference_steps=2, seed=3, lora=(("detail", 1.0),), flow_shift=3.0
    )
    assert np.abs(png_pixels(response.json()) - reference(t2v_pipe, request)[0]).max() <= 1
    video = requests.post(f"{server}/v1/videos", json={**body, "num_frames": 5, "lora": "style"}, timeout=60)
    assert video.status_code == 200, video.text
    assert (video.json()["num_inference_steps"], video.json()["flow_shift"]) == (4, None)  # the app's own
    assert requests.delete(f"{server}/v1/videos/{video.json()['id']}", timeout=60).status_code == 200


def test_the_openai_client_sends_its_lora_list_as_form_fields(server):
    """With a file part the client sends a multipart form: extra_body's list becomes lora[][name]
    and lora[][scale] fields."""
    import openai

    pipe = with_adapters("tiny-i2v", {"style": "tiny-style"})
    client = openai.OpenAI(base_url=f"{server}/i2v/v1", api_key="unused", max_retries=0, timeout=300)
    image = solid(64, 64, (200, 120, 40))
    job = client.videos.create_and_poll(
        prompt="The picture comes alive",
        size="64x64",
        input_reference=("frame.png", image, "image/png"),
        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 9, "lora": [{"name": "style", "scale": 2.0}]},
        poll_interval_ms=100,
    )
    assert job.status == "completed", job.error
    frames, _ = decode_mp4(client.videos.download_content(job.id).read())
    request = GenerationRequest(
        prompt="The picture comes alive",
        num_frames=5,
        num_inference_steps=2,
        seed=9,
        image=fit_image(image, 64, 64),
        lora=(("style", 2.0),),
    )
    assert mae(frames, as_mp4(reference(pipe, request))) <= SAME_MP4_MAE
    # The list reached the server through the form (a name it does not know is refused by name).
    with pytest.raises(openai.BadRequestError, match="unknown lora 'nope'; this deployment's adapters: style"):
        client.videos.create(
            prompt="x",
            size="64x64",
            input_reference=("frame.png", image, "image/png"),
            extra_body={"lora": [{"name": "style", "scale": 0.5}, {"name": "nope", "scale": 1}]},
        )


@pytest.mark.parametrize(
    "lora, message",
    [
        ("nope", "unknown lora 'nope'; this deployment's adapters: detail, style"),
        ([{"name": "style", "scale": "strong"}], "the scale must be a number"),
        ("a,b,c,d,e", "5 adapters in one request; max_loras_per_request=4"),
        (7, "lora"),
        ("style,style", "twice"),
    ],
)
def test_a_bad_lora_is_a_400_that_says_why(server, lora, message):
    body = {"prompt": "a", "size": "64x64", "num_inference_steps": 2, "lora": lora}
    response = requests.post(f"{server}/v1/images/generations", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_a_form_pairs_the_ith_scale_with_the_ith_name(server):
    form = [("prompt", "x"), ("size", "64x64"), ("num_frames", "5"), ("num_inference_steps", "2")]
    names = [("lora[][name]", "style"), ("lora[][name]", "nope")]
    unknown = requests.post(f"{server}/v1/videos", data=form + names + [("lora[][scale]", "0.5")] * 2, timeout=60)
    assert unknown.status_code == 400 and "unknown lora 'nope'" in unknown.json()["error"]["message"]
    uneven = requests.post(f"{server}/v1/videos", data=form + names + [("lora[][scale]", "0.5")], timeout=60)
    assert uneven.status_code == 400
    assert "lora[][scale] is given 1 times for 2 lora[][name]" in uneven.json()["error"]["message"]
