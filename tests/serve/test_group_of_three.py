"""A group of 3 ranks behind HTTP: killing its last rank while each rank holds a request."""

from __future__ import annotations

import time

import pytest
import requests
from served import deploy


@pytest.fixture(scope="module")
def trio(server):
    """An app of one shard group of 3 CPU ranks beside the tiny server's app."""
    from ray import serve

    args = {"model": "tiny", "device": "cpu", "shard_size": 3, "default_size": "64x64", "requests_per_rank": 1}
    yield deploy(server, "trio", args)
    serve.delete("trio")


def test_killing_the_last_rank_of_three_answers_every_client_with_503_and_the_group_heals(trio):
    import os
    import signal as signals
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    url = f"{trio}/v1/images/generations"
    victim = requests.get(f"{trio}/v1/pool", timeout=60).json()["ranks"][2]["pid"]
    slow = [{"prompt": f"long {i}", "num_inference_steps": 200, "size": "128x128"} for i in range(3)]
    handle = serve.get_app_handle("trio")
    with ThreadPoolExecutor(max_workers=3) as pool:
        pending = [pool.submit(requests.post, url, json=body, timeout=120) for body in slow]
        deadline = time.monotonic() + 60
        while len(handle.progress.remote().result(timeout_s=60)) < 3:  # one request on each rank
            assert time.monotonic() < deadline, "the three requests did not all start within 60 s"
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(victim, signals.SIGKILL)
        responses = [p.result(timeout=120) for p in pending]
    answered_s = time.monotonic() - killed_at
    assert [r.status_code for r in responses] == [503] * 3, [r.text for r in responses]
    assert all("rank 2 died" in r.json()["error"]["message"] for r in responses)
    assert answered_s < 10
    after = requests.post(url, json={"prompt": "after", "seed": 1}, timeout=120)  # waits for the rebuild
    assert after.status_code == 200, after.text
    print(
        f"\nrank 2 of 3 killed -> 3 clients 503 within {answered_s:.2f}s; "
        f"served again {time.monotonic() - killed_at:.1f}s after"
    )
