"""A group that loses one rank replaces that rank alone (``group/mend.py``): the other ranks keep
their processes and shards, the group's answers after the mend equal the unsharded pipeline's,
and a group that cannot mend is rebuilt whole."""

import os
import signal
import time

import pytest
import ray
from support import max_abs_diff, reference_frames, wait_until

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import GroupFailedError, ShardGroup
from ray_hsdp.request import GenerationRequest

LONG = dict(num_inference_steps=400, width=96, height=64)


def pids(group: ShardGroup) -> list[int]:
    return [place["pid"] for place in group.placement]


def assert_equals_unsharded(group: ShardGroup, reference_pipe, seed: int) -> None:
    request = GenerationRequest(prompt="after the mend", seed=seed, num_inference_steps=2)
    (result,) = group.generate([request])
    assert max_abs_diff(result.frames, reference_frames(reference_pipe, request)) <= 1e-5


def test_a_killed_rank_is_replaced_alone_and_the_group_answers_as_before(ray_cluster, tiny_model, reference_pipe):
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=1)
    with ShardGroup(config) as group:
        assert group.mend_refusal is None
        assert_equals_unsharded(group, reference_pipe, seed=1)
        before = pids(group)
        running = group.submit(GenerationRequest(prompt="long", seed=3, request_id="long", **LONG))
        wait_until(lambda: group.progress().get("long", {}).get("step", 0) >= 1, 60, "the request runs")
        killed_at = time.monotonic()
        os.kill(before[1], signal.SIGKILL)
        with pytest.raises(GroupFailedError, match="rank 1 died.*replaces it") as failed:
            running.result(timeout=30)
        assert failed.value.ran  # the ingress retries it elsewhere
        # Sent while the group mends: it waits in the queue, then runs on the mended group.
        waiting = GenerationRequest(prompt="queued", seed=5, num_inference_steps=2)
        queued = group.submit(waiting)
        wait_until(lambda: len(group.mends) == 1, 60, "the mend")
        assert max_abs_diff(queued.result(timeout=60).frames, reference_frames(reference_pipe, waiting)) <= 1e-5
        mended_s = time.monotonic() - killed_at
        after = pids(group)
        assert after[0] == before[0] and after[1] != before[1]  # rank 0 kept its process
        assert group.failure is None
        assert_equals_unsharded(group, reference_pipe, seed=1)
        # Rank 0 hosts the rendezvous: its loss, the group idle, is mended the same way.
        os.kill(after[0], signal.SIGKILL)
        wait_until(lambda: len(group.mends) == 2, 60, "the second mend")
        assert pids(group)[1] == after[1]
        assert_equals_unsharded(group, reference_pipe, seed=7)
        assert group.check_health() is None
        phases = group.mends[0]["phases_s"]
        print(f"\nrank 1 killed mid-request -> queued request answered after {mended_s:.1f}s; mend phases {phases}")


def test_a_group_that_cannot_mend_says_why_and_is_rebuilt_whole(ray_cluster, tiny_model):
    from ray_hsdp.serve.replica.keeper import GroupKeeper

    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, keep_gathered=1.0)
    keeper = GroupKeeper(lambda: ShardGroup(config).start())
    try:
        group = keeper.group
        assert group.mend_refusal == "keep_gathered (or reshard_after_forward: false) gathers at the load"
        os.kill(group.placement[1]["pid"], signal.SIGKILL)
        wait_until(lambda: group.failure is not None, 30, "the group's failure")
        assert "rank 1 died" in group.failure
        rebuilt = keeper.current().result(timeout=120)
        assert rebuilt is not group and not group.mends
        assert ray.get(rebuilt.ranks[1].ping.remote(), timeout=30) == 1
    finally:
        keeper.shutdown()
