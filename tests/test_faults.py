"""A rank that hangs inside a collective: the group fails its requests within the timeout, never hangs."""

import time

import pytest

from ray_hsdp.config import GroupConfig
from ray_hsdp.group import GroupFailedError, ShardGroup
from ray_hsdp.request import GenerationRequest


def test_a_hung_rank_fails_the_request_after_the_collective_timeout(ray_cluster, tiny_model):
    timeout_s = 5.0
    group = ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2, collective_timeout_s=timeout_s))
    group.start()
    try:
        long = GenerationRequest(prompt="a long one", num_inference_steps=200, width=96, request_id="long")
        future = group.submit(long)
        while group.progress().get("long", {}).get("step", 0) < 1:
            time.sleep(0.05)
        stalled_at = time.monotonic()
        group.ranks[1].inject_stall.remote(60.0)  # far past the collective timeout
        with pytest.raises(GroupFailedError, match="shard group failed"):
            future.result(timeout=60)
        failed_after = time.monotonic() - stalled_at
        assert failed_after < timeout_s + 15, failed_after
        with pytest.raises(GroupFailedError):
            group.submit(GenerationRequest(prompt="after"))
        print(f"\nrank hung -> request failed after {failed_after:.1f}s (collective timeout {timeout_s:.0f}s)")
    finally:
        started = time.monotonic()
        group.shutdown()
        assert time.monotonic() - started < 30  # survivors in a dead collective are killed, not waited for
