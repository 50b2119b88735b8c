"""A group's sleep and wake (issue 83): every rank parks its weights in host memory and gives the
storage back, the processes stay; the next request wakes them and equals the unsharded pipeline."""

import pytest
import ray
from support import max_abs_diff, reference_frames

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import GroupBusyError, ShardGroup
from ray_hsdp.request import GenerationRequest

TOL = 1e-5


def request(prompt, seed):
    return GenerationRequest(prompt=prompt, seed=seed, width=64, height=64, num_frames=5, num_inference_steps=2)


@pytest.mark.parametrize("gather", ["fsdp2", "in_place"])
def test_a_slept_group_holds_no_weights_and_answers_as_before_after_its_wake(
    ray_cluster, tiny_model, reference_pipe, gather
):
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, gather=gather, requests_per_rank=2)
    with ShardGroup(config) as group:
        first = request("A cat and a dog baking a cake", 11)
        assert max_abs_diff(group.generate([first])[0].frames, reference_frames(reference_pipe, first)) <= TOL
        pids = [place["pid"] for place in group.placement]

        slept = group.sleep()
        assert slept["slept"] and slept["bytes"] > 0 and len(slept["ranks"]) == 2
        for report in group.memory():
            assert report["asleep"] and report["resident_tensor_bytes"] == 0  # collected afresh: none missed
            # Everything the rank holds is parked: its shards, replicated parts, the slots' copies.
            held = report["total"]
            assert report["parked_bytes"] >= held["sharded_local"] + held["replicated"] + held["buffers"]

        woke = group.wake()
        assert woke["woke"] and woke["bytes"] == slept["bytes"]
        for report in group.memory():
            assert not report["asleep"] and report["resident_tensor_bytes"] == report["parked_bytes"]
        second = request("A red fox runs through the snow", 12)
        assert max_abs_diff(group.generate([second])[0].frames, reference_frames(reference_pipe, second)) <= TOL

        # Asleep again, a request wakes the ranks it runs on by itself; nothing restarted.
        group.sleep()
        assert max_abs_diff(group.generate([first])[0].frames, reference_frames(reference_pipe, first)) <= TOL
        assert [place["pid"] for place in group.placement] == pids
        assert ray.get([r.ping.remote() for r in group.ranks]) == [0, 1]


def test_a_group_that_holds_requests_does_not_sleep(ray_cluster, tiny_model):
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=1)
    with ShardGroup(config) as group:
        slow = GenerationRequest(prompt="slow", seed=1, width=64, height=64, num_frames=5, num_inference_steps=30)
        future = group.submit(slow)
        with pytest.raises(GroupBusyError, match="holds 1 requests"):
            group.sleep()
        future.result(timeout=120)
        assert group.sleep()["slept"]
