"""Combined mode over HTTP: ``serve run serve_configs/tiny_cpu_usp.yaml`` (4 CPU ranks as 2 lanes of
Ulysses 2), started as on a fresh 2-core machine: no cluster, a Ray of its own. Images and videos
equal the unsharded pipeline's, the two lanes serve two requests at once, a size that does not
split is a 400, and a job deleted mid-run stops within two steps and leaves its lane serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from support import reference_frames, wait_until

from ray_hsdp.request import GenerationRequest
from ray_hsdp.serve.media import decode_mp4

from .served import png_pixels, serve_run
from .test_videos import SAME_MP4_MAE, as_mp4, mae, reference_video


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    """The YAML as a user starts it: plain ``serve run``, this machine's CPUs (the session's cluster
    only writes the tiny model's cache the server reads)."""
    yield from serve_run(tmp_path_factory, "tiny_cpu_usp.yaml", own_ray=True)


def test_the_pool_shows_two_lanes_of_two(server):
    pool = requests.get(f"{server}/v1/pool", timeout=60).json()
    assert (pool["shard_size"], pool["lanes"], pool["lane_size"], pool["ulysses_degree"]) == (4, 2, 2, 2)
    assert [r["lane"] for r in pool["ranks"]] == [0, 0, 1, 1]


def test_an_image_and_a_video_at_once_on_the_two_lanes_equal_unsharded(server, reference_pipe):
    image = {"prompt": "A small boat on a calm lake", "size": "96x64", "seed": 5, "num_inference_steps": 2}
    video = {"prompt": "waves", "num_frames": 5, "num_inference_steps": 3, "seed": 3, "size": "64x64"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        image_call = pool.submit(requests.post, f"{server}/v1/images/generations", json=image, timeout=300)
        video_call = pool.submit(requests.post, f"{server}/v1/videos/sync", json=video, timeout=300)
        image_response, video_response = image_call.result(), video_call.result()
    assert image_response.status_code == 200, image_response.text
    ref = reference_frames(
        reference_pipe,
        GenerationRequest(prompt=image["prompt"], width=96, height=64, num_inference_steps=2, seed=5),
    )
    assert np.abs(png_pixels(image_response.json()) - (np.clip(ref[0, 0], 0, 1) * 255).round()).max() <= 1
    assert video_response.status_code == 200, video_response.text
    frames, _ = decode_mp4(video_response.content)
    assert mae(frames, as_mp4(reference_video(reference_pipe, "waves", 3, 5, 3))) <= SAME_MP4_MAE
    # Each lane's leader answered one of them.
    assert image_response.json()["rank"] in (0, 2)


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/images/generations", {"prompt": "a", "size": "16x16"}),
        ("/v1/videos", {"prompt": "a", "size": "16x16", "num_frames": 1}),
    ],
)
def test_a_size_whose_tokens_do_not_split_is_a_400(server, route, body):
    response = requests.post(f"{server}{route}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "do not split over ulysses_degree x ring_degree = 2" in response.json()["error"]["message"]


def test_deleting_a_running_job_stops_its_lane_and_the_lane_serves_again(server, reference_pipe):
    long = {"prompt": "a long one", "size": "128x128", "num_frames": 17, "num_inference_steps": 200, "seed": 4}
    job = requests.post(f"{server}/v1/videos", json=long, timeout=60).json()

    def state() -> dict | None:  # what the group says of the job (its request id is the job's id)
        return requests.get(f"{server}/v1/pool", timeout=60).json()["requests"].get(job["id"])

    step = wait_until(lambda: (s := (state() or {}).get("step", 0)) >= 2 and s, 120, "step 2 of the job")
    assert requests.delete(f"{server}/v1/videos/{job['id']}", timeout=60).json()["deleted"] is True
    seen = [step]

    def gone() -> bool:
        now = state()
        seen.append((now or {}).get("step", 0))
        return now is None

    wait_until(gone, 60, "the deleted job leaving its lane")
    # Its owner stops it at its next report to the store (every 0.25 s): a few ~0.1 s steps at most.
    assert max(seen) <= step + 10, (step, seen)
    # Both lanes serve: two requests at once, each equal to the unsharded run.
    bodies = [{"prompt": f"after {i}", "seed": 30 + i, "num_inference_steps": 2} for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        calls = [pool.submit(requests.post, f"{server}/v1/images/generations", json=b, timeout=300) for b in bodies]
        responses = [c.result() for c in calls]
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        ref = reference_frames(
            reference_pipe, GenerationRequest(prompt=body["prompt"], seed=body["seed"], num_inference_steps=2)
        )
        assert np.abs(png_pixels(response.json()) - (np.clip(ref[0, 0], 0, 1) * 255).round()).max() <= 1
