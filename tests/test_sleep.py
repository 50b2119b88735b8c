"""A group's sleep and wake (issue 83): every rank parks its weights in host memory (level 2: in a
file of its own) and gives the storage back, the processes stay; the next request wakes them and
equals the unsharded pipeline."""

import pytest
import ray
from support import max_abs_diff, reference_frames

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import GroupBusyError, ShardGroup
from ray_hsdp.group.residency import check_spill_disk, reserve_host
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


def test_a_level_2_sleep_rests_in_a_file_written_once_and_answers_as_before(
    ray_cluster, tiny_model, reference_pipe, tmp_path
):
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=2, sleep_level=2, sleep_dir=str(tmp_path), requests_per_rank=2
    )
    with ShardGroup(config) as group:
        first = request("A cat and a dog baking a cake", 11)
        assert max_abs_diff(group.generate([first])[0].frames, reference_frames(reference_pipe, first)) <= TOL

        reserved = reserve_host(group.ranks, 120)  # level 2 writes each rank's file ahead of its first sleep
        files = sorted(tmp_path.glob("rank-*.bin"))
        assert len(files) == 2 and max(f.stat().st_size for f in files) == reserved["bytes"] > 0
        written = [f.stat().st_mtime_ns for f in files]

        slept = group.sleep()
        assert slept["slept"] and all(r["level"] == 2 and "file write" not in r["parts_s"] for r in slept["ranks"])
        for report in group.memory():
            assert report["asleep"] and report["resident_tensor_bytes"] == 0
        second = request("A red fox runs through the snow", 12)  # wakes the ranks by itself, from the files
        assert max_abs_diff(group.generate([second])[0].frames, reference_frames(reference_pipe, second)) <= TOL

        group.sleep()
        woke = group.wake()
        assert woke["woke"] and woke["bytes"] == slept["bytes"]
        assert max_abs_diff(group.generate([first])[0].frames, reference_frames(reference_pipe, first)) <= TOL
        assert [f.stat().st_mtime_ns for f in files] == written  # the sleeps after the first wrote nothing
    assert not list(tmp_path.glob("rank-*.bin"))  # each rank removed its file as it left


def test_a_level_2_sleep_that_the_disk_cannot_hold_is_refused_with_the_bytes():
    needs = [{"disk_bytes": 3 * 2**30, "disk_free": 5 * 2**30, "folder": "/spill"} for _ in range(2)]
    with pytest.raises(OSError, match=r"2 rank\(s\) on node n1 need 6.00 GiB .* of disk in /spill .* 5.00 GiB free"):
        check_spill_disk("n1", needs)
    check_spill_disk("n1", needs[:1])  # one rank fits
