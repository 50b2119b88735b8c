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
        group.ranks[1].inject_fault.remote("stall", 60.0)  # far past the collective timeout
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


def test_a_request_past_its_deadline_is_answered_and_interrupted(ray_cluster, tiny_model):
    with ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2)) as group:
        # 3000 steps: over 13 s even unsharded in one process on this machine, so leaving early means interrupted.
        late = GenerationRequest(
            prompt="too slow", num_inference_steps=3000, width=96, timeout_s=1.0, request_id="late"
        )
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="missed its deadline of 1s"):
            group.submit(late).result(timeout=60)
        assert time.monotonic() - started < 10
        # Interrupted, not left running: it leaves the rank well before its 200 steps would end.
        while "late" in group.progress():
            assert time.monotonic() - started < 6, "the late request was not interrupted"
            time.sleep(0.05)
        print(f"\nthe late request left its rank {time.monotonic() - started:.1f}s after it was submitted")
        (after,) = group.generate([GenerationRequest(prompt="next", num_inference_steps=2)])
        assert after.frames.shape == (1, 1, 64, 64, 3)


def test_other_groups_keep_serving_while_one_fails(ray_cluster, tiny_model, reference_pipe):
    import os
    import signal

    from conftest import max_abs_diff, reference_frames

    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, replicate_size=2)
    broken, healthy = ShardGroup(config), ShardGroup(config)
    try:
        broken.start()
        healthy.start()
        doomed = broken.submit(GenerationRequest(prompt="doomed", num_inference_steps=3000, request_id="doomed"))
        while broken.progress().get("doomed", {}).get("step", 0) < 1:
            time.sleep(0.05)
        os.kill(broken.placement[1]["pid"], signal.SIGKILL)
        during = [GenerationRequest(prompt=f"meanwhile {i}", seed=i) for i in range(4)]
        futures = [healthy.submit(r) for r in during]
        with pytest.raises(GroupFailedError):
            doomed.result(timeout=60)
        for request, future in zip(during, futures):
            assert max_abs_diff(future.result(timeout=120).frames, reference_frames(reference_pipe, request)) <= 1e-5
    finally:
        broken.shutdown()
        healthy.shutdown()
