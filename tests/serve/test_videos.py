"""Video jobs over HTTP, the way OpenAI's own client drives them, against ``serve run`` of the tiny
YAML: create, poll, download, delete; limits and bad input."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from support import reference_frames, wait_until

from ray_hsdp.request import GenerationRequest
from ray_hsdp.serve.media import decode_mp4, encode_mp4

from .served import deploy, png_pixels

#: How far (mean absolute difference, 0-255) an MP4's decoded frames may be from the unsharded
#: run's frames encoded by the same encoder. Sharded frames equal the unsharded ones to 1e-5 in
#: float, so their uint8 differ only where a value sits at a rounding edge, and the encoder is the
#: same. Another seed's frames, encoded alike, differ by about 35 (the test prints it).
SAME_MP4_MAE = 0.2
#: The codec's own error against the uncompressed frames, as a share of the distance to another
#: seed's frames: the tiny model's frames vary from pixel to pixel, colour included, and yuv420p
#: keeps one colour per 2 x 2 pixels (measured 17 against 40 for another seed).
CODEC_SHARE = 0.6


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def reference_video(reference_pipe, prompt: str, seed: int, frames: int, steps: int, size=(64, 64)) -> np.ndarray:
    width, height = size
    request = GenerationRequest(
        prompt=prompt, seed=seed, num_frames=frames, num_inference_steps=steps, width=width, height=height
    )
    return (np.clip(reference_frames(reference_pipe, request)[0], 0, 1) * 255).round()


def as_mp4(frames: np.ndarray) -> np.ndarray:
    """The frames after a round trip through our MP4 encoder (the server's codec)."""
    return decode_mp4(encode_mp4(frames.astype(np.uint8), fps=16))[0]


def mae(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).mean())


def test_the_openai_client_creates_polls_and_downloads_a_video_equal_to_unsharded(client, reference_pipe):
    job = client.videos.create(
        prompt="A red fox runs through fresh snow",
        size="64x64",
        seconds="0.6",  # 16 fps and 4k+1 frames: 9 frames
        extra_body={"num_inference_steps": 40, "seed": 7},
    )
    assert job.status in ("queued", "in_progress") and job.object == "video"
    seen = [job.progress]
    deadline = time.monotonic() + 120
    while job.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the job did not finish within 120 s"
        time.sleep(0.05)
        job = client.videos.retrieve(job.id)
        seen.append(job.progress)
    assert job.status == "completed", job.error
    assert seen == sorted(seen) and any(0 < p < 100 for p in seen), seen  # never down, seen in between
    assert job.progress == 100 and job.size == "64x64" and job.seconds == "0.5625"
    assert job.completed_at >= job.created_at and job.expires_at > job.completed_at
    mp4 = client.videos.download_content(job.id).read()
    frames, fps = decode_mp4(mp4)
    assert frames.shape == (9, 64, 64, 3) and fps == 16
    expected = reference_video(reference_pipe, "A red fox runs through fresh snow", 7, 9, 40)
    other = reference_video(reference_pipe, "A red fox runs through fresh snow", 8, 9, 40)
    same, different = mae(frames, as_mp4(expected)), mae(frames, as_mp4(other))
    raw = mae(frames, expected)
    print(
        f"\nMP4 vs the unsharded run encoded alike: mean abs diff {same:.3f} (same seed), {different:.3f} "
        f"(other seed); vs the uncompressed frames {raw:.2f} (same seed), {mae(frames, other):.2f} (other seed)"
    )
    assert same <= SAME_MP4_MAE < different
    assert raw <= CODEC_SHARE * mae(frames, other)
    thumbnail = client.videos.download_content(job.id, variant="thumbnail").read()
    assert thumbnail[:8] == b"\x89PNG\r\n\x1a\n"

    polled = client.videos.create_and_poll(
        prompt="A small boat",
        size="96x64",
        extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 1},
        poll_interval_ms=100,
    )
    assert polled.status == "completed" and polled.size == "96x64"
    assert decode_mp4(client.videos.download_content(polled.id).read())[0].shape == (5, 64, 96, 3)
    listed = client.videos.list(limit=1)
    assert listed.data[0].id == polled.id and listed.has_more  # newest first
    ids = [v.id for v in client.videos.list(limit=1)]  # iterating pages: the client follows last_id
    assert ids.index(polled.id) < ids.index(job.id)
    deleted = client.videos.delete(polled.id)
    assert deleted.deleted and deleted.id == polled.id
    with pytest.raises(Exception, match="404"):
        client.videos.retrieve(polled.id)


def test_json_bodies_sync_and_the_handle(server, reference_pipe):
    from ray import serve

    created = requests.post(
        f"{server}/v1/videos",
        json={"prompt": "waves", "num_frames": 5, "num_inference_steps": 2, "seed": 3},
        timeout=60,
    )
    assert created.status_code == 200 and created.json()["status"] in ("queued", "in_progress")
    sync = requests.post(
        f"{server}/v1/videos/sync",
        json={"prompt": "waves", "num_frames": 5, "num_inference_steps": 2, "seed": 3, "size": "64x64"},
        timeout=300,
    )
    assert sync.status_code == 200 and sync.headers["content-type"] == "video/mp4"
    frames, _ = decode_mp4(sync.content)
    assert mae(frames, as_mp4(reference_video(reference_pipe, "waves", 3, 5, 2))) <= SAME_MP4_MAE
    handle = serve.get_app_handle("ray_hsdp")
    out = handle.generate_video.remote({"prompt": "waves", "num_frames": 5, "num_inference_steps": 2, "seed": 3})
    out = out.result(timeout_s=300)
    assert out["video"]["status"] == "completed"
    # The same seed, the same video: frames equal to float rounding (parity is <= 1e-5, so a value at a
    # rounding edge may land on either side; the bytes of two MP4s then differ after it).
    assert mae(decode_mp4(out["mp4"])[0], decode_mp4(sync.content)[0]) <= SAME_MP4_MAE


def test_deleting_a_running_job_stops_it_and_the_group_keeps_serving(server, reference_pipe):
    from ray import serve

    handle = serve.get_app_handle("ray_hsdp")
    long = {"prompt": "a long one", "size": "128x128", "num_frames": 17, "num_inference_steps": 200, "seed": 4}
    created = requests.post(f"{server}/v1/videos", json=long, timeout=60)
    assert created.status_code == 200, created.text
    job = created.json()
    images = [{"prompt": f"beside it {i}", "seed": 20 + i, "num_inference_steps": 3} for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as executor:
        others = [
            executor.submit(requests.post, f"{server}/v1/images/generations", json=b, timeout=300) for b in images
        ]

        def job_step() -> int:
            return handle.progress.remote().result(timeout_s=60).get(job["id"], {}).get("step", 0)

        step = wait_until(lambda: (s := job_step()) >= 3 and s, 120, "step 3 of the job")
        response = requests.delete(f"{server}/v1/videos/{job['id']}", timeout=60)
        deleted_at = time.monotonic()
        assert response.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        seen = [step]

        def gone() -> bool:
            state = handle.progress.remote().result(timeout_s=60).get(job["id"])
            seen.append(state.get("step", 0) if state else 0)
            return state is None

        wait_until(gone, 60, "the deleted job leaving its rank")
        last = max(seen)
        stopped_s = time.monotonic() - deleted_at
        results = [f.result(timeout=300) for f in others]
    assert last <= step + 2, (step, last)  # stopped within two steps of the DELETE
    assert requests.get(f"{server}/v1/videos/{job['id']}", timeout=60).status_code == 404
    for body, result in zip(images, results):
        assert result.status_code == 200
        ref = reference_frames(
            reference_pipe, GenerationRequest(prompt=body["prompt"], seed=body["seed"], num_inference_steps=3)
        )
        served = png_pixels(result.json())
        assert np.abs(served - (np.clip(ref[0, 0], 0, 1) * 255).round()).max() <= 1
    after = requests.post(
        f"{server}/v1/videos/sync", json={"prompt": "after", "num_frames": 5, "num_inference_steps": 2}, timeout=300
    )
    assert after.status_code == 200
    print(f"\nDELETE at step {step}: the job left its rank {stopped_s:.2f}s later, at step {last} of 200")


BAD_VIDEO_BODIES = [
    ({"prompt": "a", "size": "64"}, "size"),
    ({"prompt": "a", "size": "65x64"}, "multiples of 16"),
    ({"prompt": "a", "size": "axb"}, "size"),
    ({"prompt": "a", "size": "4096x4096"}, "pixels"),
    ({"prompt": "a", "seconds": "-1"}, "seconds"),
    ({"prompt": "a", "seconds": "soon"}, "seconds"),
    ({"prompt": "a", "seconds": "600"}, "max_frames"),
    ({"prompt": "a", "num_frames": 8}, "4k+1"),
    ({"prompt": "a", "num_frames": 0}, "num_frames"),
    ({"prompt": "a", "num_frames": 1001}, "max_frames"),
    ({"prompt": "a", "num_frames": "many"}, "num_frames"),
    ({"prompt": "a", "fps": 0}, "fps"),
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "a", "num_inference_steps": 10_000}, "max_steps"),
    ({"prompt": "a", "seed": -3}, "seed"),
    ({"prompt": "a", "guidance_scale": "loud"}, "guidance_scale"),
    ({"prompt": ""}, "prompt"),
    ({"size": "64x64"}, "prompt"),
    ({"prompt": "a", "model": "sora-2"}, "sora-2"),
    ({"prompt": "a", "quality": "high"}, "quality"),
]


@pytest.mark.parametrize("body, mentions", BAD_VIDEO_BODIES)
def test_bad_video_bodies_get_4xx_with_a_message(server, body, mentions):
    as_json = requests.post(f"{server}/v1/videos", json=body, timeout=60)
    as_form = requests.post(f"{server}/v1/videos", files={k: (None, str(v)) for k, v in body.items()}, timeout=60)
    for response in (as_json, as_form):
        assert 400 <= response.status_code < 500, response.text
        assert mentions in response.json()["error"]["message"], response.text


def test_malformed_video_requests_get_4xx_with_a_message(server):
    url = f"{server}/v1/videos"
    cases = [
        requests.post(url, data=b"--xyz\r\ngarbage", headers={"Content-Type": "multipart/form-data; boundary=xyz"}),
        requests.post(url, data=b"{not json", headers={"Content-Type": "application/json"}),
        requests.post(url, data=b"[1]", headers={"Content-Type": "application/json"}),
        requests.post(url, data=b"prompt=a", headers={"Content-Type": "text/plain"}),
        requests.post(url, files={"prompt": (None, "a"), "input_reference": ("a.png", b"\x89PNG", "image/png")}),
        requests.post(url, files=[("prompt", (None, "a")), ("prompt", (None, "b"))]),
        requests.get(f"{server}/v1/videos/video_unknown"),
        requests.get(f"{server}/v1/videos/video_unknown/content"),
        requests.delete(f"{server}/v1/videos/video_unknown"),
        requests.get(f"{server}/v1/videos", params={"limit": 0}),
        requests.get(f"{server}/v1/videos", params={"limit": "ten"}),
        requests.get(f"{server}/v1/videos", params={"order": "sideways"}),
        requests.get(f"{server}/v1/videos", params={"after": "video_unknown"}),
    ]
    for response in cases:
        assert 400 <= response.status_code < 500, (response.request.method, response.request.url, response.text)
        assert response.json()["error"]["message"], response.text
    running = requests.post(url, json={"prompt": "slow", "num_frames": 5, "num_inference_steps": 200}).json()
    for variant in ("video", "thumbnail"):
        early = requests.get(f"{url}/{running['id']}/content", params={"variant": variant})
        assert early.status_code == 409 and "completed" in early.json()["error"]["message"]
    assert requests.get(f"{url}/{running['id']}/content", params={"variant": "spritesheet"}).status_code == 400
    assert requests.delete(f"{url}/{running['id']}").status_code == 200


LIMITED = {
    "model": "tiny",
    "device": "cpu",
    # The job table's limits do not depend on sharding; one rank starts (and restarts) faster.
    "shard_size": 1,
    "default_size": "64x64",
    "default_steps": 2,
    "max_video_jobs": 2,
    "max_video_bytes": 1024,
    "video_ttl_s": 2,
}


@pytest.fixture(scope="module")
def limited(server):
    """A second app on the same server whose job table keeps at most 2 jobs, 1 KiB of videos, 2 s."""
    from ray import serve

    yield deploy(server, "limited", LIMITED)
    if "limited" in serve.status().applications:
        serve.delete("limited")


def wait_done(url: str, video_id: str) -> dict:
    def finished() -> dict | None:
        video = requests.get(f"{url}/{video_id}", timeout=60).json()
        return video if video["status"] in ("completed", "failed") else None

    return wait_until(finished, 120, f"video {video_id} finishing", interval_s=0.05)


def test_the_job_table_refuses_work_at_its_limits_and_forgets_expired_jobs(limited):
    url = f"{limited}/v1/videos"
    body = {"prompt": "a", "num_frames": 5}
    first, second = (requests.post(url, json=body, timeout=60) for _ in range(2))
    assert first.status_code == second.status_code == 200
    full = requests.post(url, json=body, timeout=60)
    assert full.status_code == 429 and full.headers["Retry-After"] == "2"
    assert "max_video_jobs=2" in full.json()["error"]["message"]
    done = [wait_done(url, r.json()["id"]) for r in (first, second)]
    assert all(v["status"] == "completed" for v in done)
    time.sleep(max(0.0, max(v["expires_at"] for v in done) - time.time()) + 1.1)
    for video in done:  # expired: gone
        assert requests.get(f"{url}/{video['id']}", timeout=60).status_code == 404
        assert requests.get(f"{url}/{video['id']}/content", timeout=60).status_code == 404
    third = requests.post(url, json=body, timeout=60)
    assert third.status_code == 200 and wait_done(url, third.json()["id"])["status"] == "completed"
    over = requests.post(url, json=body, timeout=60)  # one MP4 already holds more than 1 KiB
    assert over.status_code == 429 and "max_video_bytes" in over.json()["error"]["message"]


def test_a_job_whose_replica_stops_reporting_is_released_then_fails_and_stays_failed():
    """A replica that dies cannot say so: once it has not reported for a while its job is released
    (owned by none, for the ingress to place); one that no group takes within ``lost_wait_s``
    fails, and a failed job never completes afterwards (the table's transitions forbid it)."""
    from ray_hsdp.serve.jobs import JobTable

    table = JobTable(max_jobs=4, max_bytes=2**20, ttl_s=60, stale_after_s=0.3, lost_wait_s=0.3)
    status, video = table.create({"model": "m", "prompt": "p", "size": "64x64"}, "a", ("spec", 16))
    assert status == "ok" and table.update(video["id"], "a", progress=30)
    time.sleep(0.4)  # a stopped reporting
    assert table.get(video["id"])["status"] == "in_progress"  # released: it waits for another group
    assert table.claim(["m"], hold_s=60) == [(video["id"], "m", ("spec", 16), "a")]
    time.sleep(0.4)  # no group adopted it within lost_wait_s
    failed = table.get(video["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "replica_lost", failed
    assert "no other group took it over within video_lost_wait_s" in failed["error"]["message"]
    assert failed["progress"] == 30 and failed["completed_at"] is not None
    # Its replica comes back to life too late: the job stays failed, nothing is stored.
    assert table.update(video["id"], "a", progress=60) is False
    assert table.complete(video["id"], b"mp4", b"png", "a") is False
    assert table.adopt(video["id"], "b") is False
    assert table.content(video["id"], "video") == ("not_ready", "failed")
    assert table.fail(video["id"], "other", "later") is False  # terminal: the first reason stays
    assert table.get(video["id"])["error"]["code"] == "replica_lost"


def test_a_released_job_is_placed_once_on_another_group_of_its_model_with_one_record():
    """Issue 63: a job released by its replica (its group failed under it) or by the sweep (its
    replica stopped reporting) is claimed by one ingress replica for a group of its own model, and
    adopted there: the first replica's late reports and MP4 are refused, so it completes once."""
    from ray_hsdp.serve.jobs import JobTable

    table = JobTable(max_jobs=8, max_bytes=2**20, ttl_s=60, stale_after_s=60, lost_wait_s=60)
    _, failed_under = table.create({"model": "wan", "prompt": "group failed"}, "a", ("spec 1", 16))
    _, other_model = table.create({"model": "qwen", "prompt": "its own model"}, "a", ("spec 2", 16))
    assert table.update(failed_under["id"], "a", progress=40)
    table.release(failed_under["id"], "a", "group_failed", "rank 1 died")
    table.release(other_model["id"], "z", "group_failed", "not z's to release")  # z does not own it
    assert table.claim(["qwen"], hold_s=60) == []
    assert table.claim(["wan"], hold_s=60) == [(failed_under["id"], "wan", ("spec 1", 16), "a")]
    assert table.claim(["wan"], hold_s=60) == []  # held by the first claimant
    time.sleep(0.2)
    assert table.adopt(failed_under["id"], "b")
    # A takeover counts its wait from the adoption (issue 54: a third group took a job the second ran).
    assert table.take_waiting("c", waited_s=0.15, model="wan") is None
    assert table.claim(["wan"], hold_s=0) == []  # owned again
    assert table.update(failed_under["id"], "a", progress=60) is False  # a stops its copy
    assert table.update(failed_under["id"], "b", running=True)
    assert table.complete(failed_under["id"], b"a's", b"png", "a") is False
    assert table.complete(failed_under["id"], b"b's", b"png", "b")
    assert table.content(failed_under["id"], "video") == ("ok", b"b's")
    moved = table.get(failed_under["id"])
    assert (moved["status"], moved["replica"], moved["retried"]) == ("completed", "b", True)


def test_a_create_sent_again_with_its_id_is_the_same_job():
    """The ingress picks a job's id: a create it sends again after its replica was lost under the
    call adopts the job the first call made (one record), and one that has ended is left be."""
    from ray_hsdp.serve.jobs import JobTable

    table = JobTable(max_jobs=8, max_bytes=2**20, ttl_s=60, stale_after_s=60)
    assert table.create({"prompt": "p"}, "a", ("spec", 16), "video_x")[0] == "ok"
    status, again = table.create({"prompt": "p"}, "b", ("spec", 16), "video_x")
    assert (status, again["id"], again["retried"]) == ("ok", "video_x", True) and len(table.jobs) == 1
    assert table.update("video_x", "a") is False and table.complete("video_x", b"mp4", b"png", "b")
    assert table.create({"prompt": "p"}, "c", ("spec", 16), "video_x")[0] == "ended"
    assert table.create({"prompt": "q"}, "c", ("spec", 16), "video_y")[1]["id"] == "video_y"


def test_the_job_table_moves_only_forward():
    from ray_hsdp.serve.jobs import TRANSITIONS, JobTable

    table = JobTable(max_jobs=4, max_bytes=2**20, ttl_s=60, stale_after_s=60)
    _, video = table.create({"prompt": "p"}, "a", ("spec", 16))
    assert table.update(video["id"], "a", running=True) and table.get(video["id"])["status"] == "in_progress"
    assert table.complete(video["id"], b"mp4", b"png", "a") and table.get(video["id"])["progress"] == 100
    assert table.fail(video["id"], "late", "too late") is False and table.get(video["id"])["status"] == "completed"
    assert all(not TRANSITIONS[state] for state in ("completed", "failed"))


def test_a_job_waiting_on_a_busy_group_moves_once_to_a_group_with_a_free_lane():
    """A queued job that waited long enough goes to the asking replica, and its first replica's
    next report fails, which stops its copy there; a running job, a job of the asker's own, or one
    that waited too little stays. One the taker cannot run after all is released to the ingress."""
    from ray_hsdp.serve.jobs import JobTable

    table = JobTable(max_jobs=8, max_bytes=2**20, ttl_s=60, stale_after_s=60)
    _, running = table.create({"prompt": "running"}, "a", ("spec running", 16))
    _, waiting = table.create({"prompt": "waiting"}, "a", ("spec waiting", 16))
    _, own = table.create({"model": "m", "prompt": "own"}, "b", ("spec own", 16))
    assert table.update(running["id"], "a", running=True)
    assert table.take_waiting("b", waited_s=60) is None  # nothing waited a minute
    time.sleep(0.05)
    assert table.take_waiting("b", waited_s=0.01) == (waiting["id"], ("spec waiting", 16))
    assert table.update(waiting["id"], "a") is False  # the first replica stops its copy
    assert table.fail(waiting["id"], "group_failed", "its copy's failure", "a") is False  # not the job's
    assert table.update(waiting["id"], "b", running=True)
    moved = table.get(waiting["id"])
    assert moved["status"] == "in_progress" and moved["replica"] == "b" and moved["retried"] is False
    assert table.take_waiting("b", waited_s=0.01) is None  # the running job and b's own stay
    assert table.take_waiting("c", waited_s=0.01) == (own["id"], ("spec own", 16))
    assert "_spec" not in moved and "_owner" not in moved
    # The first replica's copy of the moved job ran to the end anyway: its video is not the job's.
    assert table.complete(waiting["id"], b"a's mp4", b"png", "a") is False
    assert table.complete(waiting["id"], b"b's mp4", b"png", "b")
    assert table.content(waiting["id"], "video") == ("ok", b"b's mp4")
    # c's group filled up meanwhile: the job is released, and the sweep leaves it be (owned by none,
    # nobody reports for it) while the ingress places it.
    table.release(own["id"], "c", "overloaded", "c's group filled up")
    assert table.update(own["id"], "b") is False and table.take_waiting("b", waited_s=0) is None
    table.stale_after_s = 0.01
    time.sleep(0.05)
    assert table.get(own["id"])["status"] == "queued"
    assert table.claim(["m"], hold_s=60) == [(own["id"], "m", ("spec own", 16), "c")]


def test_a_redeploy_applies_new_limits_and_serve_delete_removes_the_table(limited, server):
    """The table belongs to the app: a redeploy's limits apply, and the app's deletion takes the
    table and its MP4s with it."""
    from ray import serve

    url = f"{limited}/v1/videos"
    body = {"prompt": "a", "num_frames": 5}
    codes = [requests.post(url, json=body, timeout=60).status_code for _ in range(3)]
    assert 429 in codes, codes  # max_video_jobs=2 (or the bytes of the limits test's MP4s)
    deploy(server, "limited", {**LIMITED, "max_video_jobs": 100, "max_video_bytes": 2**30})
    again = requests.post(url, json=body, timeout=60)
    assert again.status_code == 200, again.text  # the redeploy's limits
    assert tables("limited")
    serve.delete("limited")
    assert "limited" not in serve.status().applications
    wait_until(lambda: not tables("limited"), 30, "the job table's replica going with its app")


def tables(app: str) -> list[str]:
    """The live job-table replica actors of ``app`` (Serve names them after app and deployment)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return [n for n in names if "VideoJobTable" in n and f"{app}#" in n]
