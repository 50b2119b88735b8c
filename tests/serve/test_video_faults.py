"""Video jobs through the faults of the job store and of a group being removed (issue 82), on the
session's server (its store: SQLite in the session's folder): a request this version cannot read
fails its job at once; a store killed for good is started again by the ingress with every record;
a sync caller that leaves during its create leaves no job; a group that fails while it drains
releases its job to another group, which completes it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import requests
from support import wait_until

from ray_hsdp.serve.jobs.actor import find_store
from ray_hsdp.serve.jobs.records import pool_of

from .served import deploy

#: The session server's application (``serve_configs/tiny_cpu.yaml``) and its group deployment.
APP, POOL = "ray_hsdp", pool_of("ray_hsdp", "HSDPServer")


def job(server: str, video_id: str) -> dict:
    response = requests.get(f"{server}/v1/videos/{video_id}", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def pool_replica(base: str) -> str | None:
    """The replica whose group answers ``/v1/pool`` now (Serve routes nothing to one that stops)."""
    response = requests.get(f"{base}/v1/pool", timeout=60)
    return response.json()["replica"] if response.ok else None


def test_a_stored_request_this_version_cannot_read_fails_its_job_at_once(server):
    """A released job whose stored request cannot be decoded (an earlier version's, during an
    upgrade) fails with the reason the first time a group is offered it: it is never adopted, so
    it neither loops (adopt, stale, release) nor holds an attempt."""
    store = find_store()
    fields = {"model": None, "prompt": "from an older version"}
    status, created = ray.get(store.create.remote(APP, POOL, fields, "an-older-replica", '{"job": {"steps": 3}}'))
    assert status == "ok"
    assert ray.get(store.release.remote(created["id"], "an-older-replica", 1, "group_failed", "its group was lost"))
    failed = wait_until(lambda: (v := job(server, created["id"]))["status"] == "failed" and v, 30, "its failure", 0.25)
    assert failed["error"]["code"] == "internal_error", failed
    assert "cannot be read by this version" in failed["error"]["message"], failed
    assert failed["attempt"] == 1  # never adopted


def test_a_store_killed_for_good_is_started_again_with_every_record(server):
    body = {"prompt": "kept through the store's end", "num_frames": 5, "num_inference_steps": 2, "seed": 4}
    created = requests.post(f"{server}/v1/videos", json=body, timeout=60).json()
    done = wait_until(lambda: (v := job(server, created["id"]))["status"] == "completed" and v, 120, "its end", 0.25)
    mp4 = requests.get(f"{server}/v1/videos/{created['id']}/content", timeout=60).content
    ray.kill(find_store(), no_restart=True)
    # The next call of the ingress finds the store gone and starts it again over the same database.
    again = wait_until(lambda: (r := requests.get(f"{server}/v1/videos/{created['id']}", timeout=60)).ok and r, 30,
                       "the store started again", 0.25)  # fmt: skip
    assert again.json() == done
    assert requests.get(f"{server}/v1/videos/{created['id']}/content", timeout=60).content == mp4
    second = requests.post(f"{server}/v1/videos", json={**body, "seed": 5}, timeout=60)
    assert second.status_code == 200, second.text


def test_a_sync_caller_that_leaves_during_its_create_leaves_no_job(server):
    """The caller's id is picked before the create: a caller gone at any moment of it deletes that
    id, and a create still on its way is refused (``JobStore.create``'s ``deleted``)."""
    from ray import serve

    prompt = "a caller that leaves at once"
    body = {"prompt": prompt, "num_frames": 5, "num_inference_steps": 200, "seed": 6}
    handle = serve.get_app_handle(APP)
    for delay in (0.0, 0.05, 0.2):  # during the ingress' validation, its create, and just after
        call = handle.generate_video.remote(body)
        time.sleep(delay)
        call.cancel()

    def none_left() -> bool:
        listed = requests.get(f"{server}/v1/videos", params={"limit": 100}, timeout=60).json()["data"]
        running = requests.get(f"{server}/v1/pool", timeout=60).json()["requests"]
        return not any(v["prompt"] == prompt for v in listed) and not any(r.startswith("video_") for r in running)

    wait_until(none_left, 30, "every job of the callers that left deleted and stopped", 0.25)


def test_a_group_that_fails_while_it_drains_releases_its_job(server):
    """A redeploy removes the old group; it drains its running job (drain_timeout_s); a rank of it
    dies meanwhile: the job is released to the new group (code drained), which completes it, never
    failed (before: the drain's group failure failed the job)."""
    args = {"model": "tiny", "device": "cpu", "shard_size": 1, "default_size": "64x64", "max_steps": 6000,
            "drain_timeout_s": 120, "requests_per_rank": 1}  # fmt: skip
    base = deploy(server, "draining", args)
    try:
        old_rank = requests.get(f"{base}/v1/pool", timeout=60).json()["ranks"][0]
        body = {"prompt": "through a drain", "num_frames": 5, "num_inference_steps": 6000, "seed": 8}
        video_id = requests.post(f"{base}/v1/videos", json=body, timeout=60).json()["id"]
        first = wait_until(lambda: (v := job(base, video_id))["status"] == "in_progress" and v, 60, "its run", 0.25)
        # The redeploy returns once the old group has gone, so it runs beside: the old group drains
        # its job from the moment the new one serves.
        with ThreadPoolExecutor(max_workers=1) as pool:
            redeploy = pool.submit(deploy, server, "draining", {**args, "default_steps": 5})
            wait_until(lambda: pool_replica(base) not in (None, first["replica"]), 120, "the new group serving", 0.25)
            assert job(base, video_id)["status"] == "in_progress"  # still running, draining on the old group
            assert job(base, video_id)["attempt"] == first["attempt"]
            os.kill(old_rank["pid"], signal.SIGKILL)
            later = lambda: (v := job(base, video_id))["attempt"] > first["attempt"] and v  # noqa: E731
            moved = wait_until(later, 60, "a move", 0.25)
            assert moved["status"] in ("queued", "in_progress") and moved["retried"] is True, moved
            assert moved["replica"] != first["replica"] or moved["status"] == "queued", moved
            requests.delete(f"{base}/v1/videos/{video_id}", timeout=60)  # where it runs now is what counts
            redeploy.result(timeout=120)
    finally:
        from ray import serve

        serve.delete("draining")
