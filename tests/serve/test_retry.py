"""Two replicas (two shard groups): a seeded request whose group dies under it is retried once on
the other group, and the answer says so."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import requests
from conftest import free_port, reference_frames
from PIL import Image

from ray_hsdp.request import GenerationRequest

COLLECTIVE_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def pool(ray_cluster):
    """An app of two replicas, each a shard group of 2 CPU ranks, on a free port of 127.0.0.1."""
    from ray import serve

    from ray_hsdp.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": "tiny",
        "device": "cpu",
        "shard_size": 2,
        "replicate_size": 2,
        "default_size": "64x64",
        "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
    }
    serve.run(build_app(args), name="pool", route_prefix="/pool")
    base = f"http://127.0.0.1:{port}/pool"
    yield base
    serve.delete("pool")
    serve.shutdown()


def live_groups(base: str, deadline_s: float = 120) -> dict[str, list[dict]]:
    """Replica id -> its ranks' placement, once both replicas answer with a working group."""
    seen: dict[str, list[dict]] = {}
    deadline = time.monotonic() + deadline_s
    while len(seen) < 2 and time.monotonic() < deadline:
        response = requests.get(f"{base}/v1/pool", timeout=60)
        if response.status_code == 200:
            seen[response.json()["replica"]] = response.json()["ranks"]
        else:
            time.sleep(0.5)  # a group still being rebuilt
    assert len(seen) == 2, seen
    return seen


def busy_replica(groups: dict[str, list[int]], deadline_s: float = 60) -> str:
    """The replica whose ranks compute (their processes use CPU) once one of them does."""
    procs = {replica: [psutil.Process(pid) for pid in pids] for replica, pids in groups.items()}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for ps in procs.values():
            for p in ps:
                p.cpu_percent(None)
        time.sleep(0.5)
        load = {replica: min(p.cpu_percent(None) for p in ps) for replica, ps in procs.items()}
        replica = max(load, key=load.get)
        if load[replica] > 30:
            return replica
    raise AssertionError(f"no group started computing within {deadline_s}s")


def test_a_seeded_request_is_retried_on_the_other_group_when_its_group_dies(pool, reference_pipe):
    url = f"{pool}/v1/images/generations"
    plain = requests.post(url, json={"prompt": "a plain one", "seed": 1, "num_inference_steps": 2}, timeout=120)
    assert plain.status_code == 200 and plain.json()["retried"] is False
    groups = {replica: [r["pid"] for r in ranks] for replica, ranks in live_groups(pool).items()}
    # Long enough on 2 CPU ranks that the kill lands while it runs.
    body = {"prompt": "a retried one", "num_inference_steps": 200, "size": "128x128", "seed": 11}
    with ThreadPoolExecutor(max_workers=1) as executor:
        pending = executor.submit(requests.post, url, json=body, timeout=600)
        victim = busy_replica(groups)
        killed_at = time.monotonic()
        os.kill(groups[victim][1], signal.SIGKILL)
        response = pending.result(timeout=600)
    answered_s = time.monotonic() - killed_at
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["retried"] is True and "failed" in payload["first_error"], payload
    request = GenerationRequest(
        prompt=body["prompt"], width=128, height=128, num_inference_steps=200, guidance_scale=5.0, seed=11
    )
    expected = (np.clip(reference_frames(reference_pipe, request)[0, 0], 0, 1) * 255).round()
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"]))), dtype=np.float64)
    assert np.abs(served - expected).max() <= 1  # PNG is 8-bit: equal up to rounding
    print(f"\nrank killed -> retried on the other group, answered 200 {answered_s:.1f}s after the kill")


def test_a_hung_rank_fails_its_request_at_the_collective_timeout_and_the_group_heals(pool):
    """A rank stuck before its collective (fault injection): the other rank's collective times
    out, an unseeded request gets 503, and both groups serve again afterwards."""
    import ray

    url = f"{pool}/v1/images/generations"
    groups = live_groups(pool)
    body = {"prompt": "a hung one", "num_inference_steps": 200, "size": "128x128"}
    with ThreadPoolExecutor(max_workers=1) as executor:
        pending = executor.submit(requests.post, url, json=body, timeout=600)
        victim = busy_replica({replica: [r["pid"] for r in ranks] for replica, ranks in groups.items()})
        hung = groups[victim][1]
        ray.get(ray.get_actor(hung["actor_name"], namespace=hung["namespace"]).inject_fault.remote("stall", 120))
        stalled_at = time.monotonic()
        response = pending.result(timeout=600)
    answered_s = time.monotonic() - stalled_at
    assert response.status_code == 503, response.text
    assert "failed" in response.json()["error"]["message"]
    assert answered_s < COLLECTIVE_TIMEOUT_S + 30
    after = live_groups(pool)
    assert hung["pid"] not in [r["pid"] for ranks in after.values() for r in ranks]
    ok = requests.post(url, json={"prompt": "after", "seed": 2, "num_inference_steps": 2}, timeout=120)
    assert ok.status_code == 200, ok.text
    message = response.json()["error"]["message"]
    print(f"\nrank hung -> client 503 after {answered_s:.1f}s ({message[:90]})")
