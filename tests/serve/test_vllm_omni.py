"""vllm-omni's clients against ray_hsdp unchanged: its videos guide's multipart requests as the guide
writes them (sizes, frames and steps scaled down for the tiny model), its sync answer's headers, and
its ``extra_params``; each video equal to the unsharded diffusers run of the same request."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from support import reference_frames, wait_until

from ray_hsdp.request import GenerationRequest
from ray_hsdp.serve.media import decode_mp4

from .test_videos import SAME_MP4_MAE, as_mp4, mae


def form(**fields) -> dict:
    """``curl -F key=value`` for each field, as the guide sends them."""
    return {key: (None, str(value)) for key, value in fields.items()}


def reference_mp4(pipe, **fields) -> np.ndarray:
    """The unsharded run of the request ``fields`` make, through the server's MP4 encoder."""
    return as_mp4((np.clip(reference_frames(pipe, GenerationRequest(**fields))[0], 0, 1) * 255).round())


def test_the_guides_quick_start_creates_polls_and_downloads(server, reference_pipe):
    # The guide: -F prompt=... -F width=1280 -F height=720 -F num_frames=80 -F fps=16 -F num_inference_steps=40.
    created = requests.post(
        f"{server}/v1/videos",
        files=form(
            prompt="A cinematic tracking shot of a mountain lake at sunrise",
            width=64,
            height=32,
            num_frames=8,
            fps=16,
            num_inference_steps=3,
            seed=4,
        ),  # fmt: skip
        timeout=60,
    )
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    done = wait_until(
        lambda: (v := requests.get(f"{server}/v1/videos/{video_id}", timeout=10).json())["status"] == "completed" and v,
        timeout_s=300,
    )
    # 8 frames is no 4k+1 count: diffusers makes 9 of it, and so does the server (the record says so).
    assert done["num_frames"] == 9 and done["size"] == "64x32"
    content = requests.get(f"{server}/v1/videos/{video_id}/content", timeout=60)
    frames, _ = decode_mp4(content.content)
    want = reference_mp4(reference_pipe, prompt="A cinematic tracking shot of a mountain lake at sunrise",
                         width=64, height=32, num_frames=9, num_inference_steps=3, seed=4)  # fmt: skip
    assert mae(frames, want) <= SAME_MP4_MAE


def test_sync_answers_with_vllm_omnis_headers_and_runs_extra_params(server, reference_pipe):
    # The guide's synchronous request, with extra_params' solver.
    sync = requests.post(
        f"{server}/v1/videos/sync",
        files=form(
            prompt="A small robot walking through a neon city",
            width=64,
            height=64,
            num_frames=5,
            fps=16,
            num_inference_steps=3,
            seed=9,
            extra_params=json.dumps({"sample_solver": "unipc"}),
        ),  # fmt: skip
        timeout=300,
    )
    assert sync.status_code == 200, sync.text
    served = requests.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]
    assert sync.headers["X-Request-Id"] and sync.headers["X-Model"] == served  # Serve's request id
    assert float(sync.headers["X-Inference-Time-S"]) > 0
    asked = requests.post(f"{server}/v1/videos/sync", files=form(prompt="a", num_frames=1, num_inference_steps=1),
                          headers={"X-Request-Id": "mine-1"}, timeout=300)  # fmt: skip
    assert asked.status_code == 200 and asked.headers["X-Request-Id"] == "mine-1"  # a client's own id comes back
    frames, _ = decode_mp4(sync.content)
    want = reference_mp4(reference_pipe, prompt="A small robot walking through a neon city", num_frames=5,
                         num_inference_steps=3, seed=9, sample_solver="unipc")  # fmt: skip
    assert mae(frames, want) <= SAME_MP4_MAE
    other = reference_mp4(reference_pipe, prompt="A small robot walking through a neon city", num_frames=5,
                          num_inference_steps=3, seed=9)  # fmt: skip
    assert mae(frames, other) > 10 * SAME_MP4_MAE  # the solver made them


def test_a_distilled_schedule_of_sigmas_runs_as_diffusers_runs_it(server, reference_pipe):
    body = {"prompt": "a kite over the sea", "num_frames": 5, "seed": 2, "sigmas": [1.0, 0.75, 0.5, 0.25],
            "guidance_scale": 1.0}  # fmt: skip
    sync = requests.post(f"{server}/v1/videos/sync", json=body, timeout=300)
    assert sync.status_code == 200, sync.text
    want = reference_mp4(reference_pipe, prompt="a kite over the sea", num_frames=5, seed=2, num_inference_steps=4,
                         guidance_scale=1.0, sigmas=(1.0, 0.75, 0.5, 0.25))  # fmt: skip
    assert mae(decode_mp4(sync.content)[0], want) <= SAME_MP4_MAE
    # As a form (vllm-omni's clients send forms): the list as JSON text.
    as_form = requests.post(f"{server}/v1/videos/sync", files=form(**{**body, "sigmas": json.dumps(body["sigmas"])}),
                            timeout=300)  # fmt: skip
    assert mae(decode_mp4(as_form.content)[0], want) <= SAME_MP4_MAE


BAD_VLLM_OMNI_BODIES = [
    ({"prompt": "a", "sigmas": "[0.5, 0.75]"}, "sigmas must fall"),
    ({"prompt": "a", "sigmas": "[1.0, 0.5]", "num_inference_steps": 3}, "sigmas has 2 values"),
    ({"prompt": "a", "sigmas": "[1.0, 0.5]", "sample_solver": "unipc"}, "with sigmas"),
    ({"prompt": "a", "width": 64}, "width and height go together"),
    ({"prompt": "a", "width": 64, "height": 48, "size": "64x64"}, "disagree"),
    ({"prompt": "a", "width": 65, "height": 64}, "multiples of 16"),
    ({"prompt": "a", "extra_params": '{"preencode_mp4": true}'}, "extra_params.preencode_mp4"),
    ({"prompt": "a", "extra_params": "{not json"}, "extra_params is not a JSON object"),
    ({"prompt": "a", "extra_params": '{"sample_solver": "dpm++"}'}, "sample_solver"),
    ({"prompt": "a", "sample_solver": "euler", "extra_params": '{"sample_solver": "unipc"}'}, "disagree"),
    ({"prompt": "a", "boundary_ratio": 0.9}, "a one-expert model with boundary_ratio"),
    ({"prompt": "a", "boundary_ratio": 1.5}, "boundary_ratio"),
    ({"prompt": "a", "enable_frame_interpolation": "true"}, "enable_frame_interpolation"),
]


@pytest.mark.parametrize("body, mentions", BAD_VLLM_OMNI_BODIES)
def test_what_the_server_does_not_run_is_a_400_that_names_it(server, body, mentions):
    for response in (
        requests.post(f"{server}/v1/videos/sync", files=form(**body), timeout=60),
        requests.post(f"{server}/v1/videos", json={k: _json(v) for k, v in body.items()}, timeout=60),
    ):
        assert response.status_code == 400, response.text
        assert mentions in response.json()["error"]["message"], response.text


def _json(value):
    """A form's JSON text as the JSON body carries it (an object or a list), other values as they are."""
    if isinstance(value, str) and value.startswith(("{", "[")) and value != "{not json":
        return json.loads(value)
    return value


def chat_video(response) -> bytes:
    """The MP4 of a chat answer, read as vllm-omni's example client reads it."""
    import base64

    for item in response.json()["choices"][0]["message"]["content"]:
        url = item.get("video_url", {}).get("url", "")
        if url.startswith("data:video"):
            return base64.b64decode(url.split(",", 1)[1])
    raise AssertionError(f"no video in {response.text[:300]}")


def test_the_chat_examples_body_makes_its_video(server, reference_pipe):
    # examples/online_serving/text_to_video's curl body (its extra_body as a JSON key), scaled down.
    body = {
        "messages": [{"role": "user", "content": "A cat surfing on waves"}],
        "extra_body": {
            "height": 32,
            "width": 64,
            "num_frames": 8,
            "num_inference_steps": 3,
            "guidance_scale": 4.0,
            "seed": 42,
            "fps": 16,
        },  # fmt: skip
    }
    response = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion" and response.json()["video"]["num_frames"] == 9
    frames, _ = decode_mp4(chat_video(response))
    want = reference_mp4(reference_pipe, prompt="A cat surfing on waves", width=64, height=32, num_frames=9,
                         num_inference_steps=3, guidance_scale=4.0, seed=42)  # fmt: skip
    assert mae(frames, want) <= SAME_MP4_MAE
    # The OpenAI SDK flattens extra_body into the top level: the same request, the same video.
    flat = {"messages": body["messages"], **body["extra_body"]}
    again = requests.post(f"{server}/v1/chat/completions", json=flat, timeout=300)
    assert mae(decode_mp4(chat_video(again))[0], frames) <= SAME_MP4_MAE


BAD_CHATS = [
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "no user message"),
    ({"messages": [{"role": "user", "content": "a"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": 0.7}, "temperature"),
    ({"messages": [{"role": "user", "content": "a"}], "extra_body": {"guidance_scale_2": 3.0}}, "guidance_scale_2"),
    ({"messages": [{"role": "user", "content": "a"}], "seed": 1, "extra_body": {"seed": 2}}, "seed"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input_audio"),
]


@pytest.mark.parametrize("body, mentions", BAD_CHATS)
def test_a_chat_the_model_cannot_run_is_a_400_that_names_why(server, body, mentions):
    response = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert mentions in response.json()["error"]["message"], response.text


def test_the_image_clients_body_is_our_request_by_vllm_omnis_names(server):
    # examples/online_serving/text_to_image's client: true_cfg_scale for the guidance, lora as one object.
    theirs = {
        "prompt": "a cup of coffee on the table", "response_format": "b64_json", "n": 1, "size": "64x64",
        "num_inference_steps": 3, "true_cfg_scale": 4.0, "seed": 5, "lora": {"name": "style", "scale": 0.5},
    }  # fmt: skip
    ours = {**theirs, "guidance_scale": 4.0, "lora": "style:0.5"}
    del ours["true_cfg_scale"]
    answers = [requests.post(f"{server}/v1/images/generations", json=body, timeout=300) for body in (theirs, ours)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json()["data"][0]["b64_json"] == answers[1].json()["data"][0]["b64_json"]
    assert answers[0].json()["guidance_scale"] == 4.0
    both = requests.post(f"{server}/v1/images/generations", json={**ours, "true_cfg_scale": 2.0}, timeout=60)
    assert both.status_code == 400 and "disagree" in both.json()["error"]["message"], both.text
