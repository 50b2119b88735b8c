"""Lane widening (issue 39, resizing at step boundaries): while no request waits, a running
request's forwards also run on the idle ranks of a wider lane around its own, and a request that
arrives takes them back. The protocol's agreement with helpers, the refusals, and a group whose
widened request still equals the unsharded diffusers pipeline's result."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time

import pytest
from support import max_abs_diff, pipeline_with_adapters, reference_frames, reference_with, wait_until

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import GroupFailedError, ShardGroup
from ray_hsdp.group.lanes import LaneTimes, TickModel
from ray_hsdp.protocol import STOP, agreed_keys, help_key, key_of, lane_ticket, widened
from ray_hsdp.request import GenerationRequest, RequestCancelledError

TOLERANCE = 1e-5
LORAS = {"style": "tiny-style"}


def test_a_wider_lane_agrees_on_a_call_its_helpers_offer_their_help_to():
    home = lane_ticket(5, 2, 2)  # ranks 2 and 3
    wide = widened(home, 0, 4)
    call = key_of(1, wide)
    assert agreed_keys([help_key(wide), help_key(wide), call, call]) == {0: call}
    # A helper that leads the wider lane, for a request of a lane of one rank (rank 1).
    alone = widened(lane_ticket(6), 0, 2)
    assert agreed_keys([help_key(alone), key_of(0, alone)]) == {0: key_of(0, alone)}
    assert agreed_keys([help_key(wide)] * 4) == {}  # helpers alone agree on nothing
    assert agreed_keys([help_key(wide), -1, call, call]) == {}  # a helper missing
    assert agreed_keys([help_key(wide), help_key(wide), call, key_of(0, wide)]) == {}  # two calls
    # A stop of the request's own lane stops its calls on the wider lane at the same tick.
    assert agreed_keys([help_key(wide), help_key(wide), call, call, STOP - home]) == {}


def test_lane_widening_needs_adaptive_lanes_and_refuses_cfg_halves_and_step_caches():
    with pytest.raises(ValueError, match="lane_widening widens adaptive lanes: set lane_sizes too"):
        GroupConfig(model="tiny", shard_size=2, lane_widening=True)
    with pytest.raises(ValueError, match="lane_widening with cfg_parallel"):
        GroupConfig(model="tiny", shard_size=4, lane_sizes=(1, 2, 4), cfg_parallel=True, lane_widening=True)
    with pytest.raises(ValueError, match=r"lane_widening with a step cache \(cache kind\)"):
        GroupConfig(model="tiny", shard_size=2, lane_sizes=(1, 2), cache={"kind": "first_block"}, lane_widening=True)


def test_a_request_on_a_lane_of_one_is_widened_when_its_neighbour_ends_and_gives_the_rank_back(ray_cluster, tiny_model):
    """Rank 0 runs a short request that names a lane of one, rank 1 a long one the group gave a
    lane of one (its neighbour took the other rank). Once the short one ends and nothing waits,
    rank 0 helps the long one: its forwards run on the lane of two. A third request then takes rank
    0 back at once, and is answered before the long one. Each result equals the unsharded run (the
    long one's with its adapter, which the helper's forwards select too)."""
    config = GroupConfig(
        model=tiny_model,
        device="cpu",
        shard_size=2,
        lane_sizes=(1, 2),
        lane_widening=True,
        requests_per_rank=1,
        loras=LORAS,
    )
    # Of like work per forward: a lane of one opens beside the other (``lanes.LockStep``).
    long = GenerationRequest(
        prompt="rain at night",
        seed=5,
        num_inference_steps=80,
        width=64,
        height=32,
        num_frames=9,
        lora=(("style", 0.7),),
    )
    short = dataclasses.replace(long, prompt="a dog", seed=4, num_inference_steps=2, lane_size=1, lora=())
    third = dataclasses.replace(short, prompt="a cat", seed=6, lane_size=None)
    records = []
    with ShardGroup(config) as group:
        group.listeners.append(records.append)
        futures = {
            "short": group.submit(dataclasses.replace(short, request_id="short")),
            "long": group.submit(dataclasses.replace(long, request_id="long")),
        }
        wait_until(lambda: group.tick_stats()[0]["helped"] > 0, 120, "rank 0 helps the long request")
        progress = group.progress()["long"]
        assert progress["step"] < long.num_inference_steps and progress["helpers"] == [0], progress
        futures["third"] = group.submit(dataclasses.replace(third, request_id="third"))
        done, _ = concurrent.futures.wait(futures.values(), timeout=300, return_when=concurrent.futures.FIRST_COMPLETED)
        assert futures["long"] not in done
        assert futures["third"].result(timeout=300).frames is not None
        assert not futures["long"].done()  # the third took rank 0 back while the long one ran
        results = {name: future.result(timeout=300) for name, future in futures.items()}
        stats = group.tick_stats()
    by_id = {record.request_id: record for record in records}
    assert (by_id["long"].lane_size, by_id["long"].widened_to) == (1, 2)
    assert by_id["short"].widened_to is None and by_id["third"].widened_to is None
    assert stats[0]["helped"] > 0 and stats[1]["helped"] == 0
    pipe = pipeline_with_adapters(tiny_model, LORAS)
    for name, request in (("short", short), ("long", long), ("third", third)):
        assert max_abs_diff(results[name].frames, reference_with(pipe, request)) <= TOLERANCE, name


def test_a_widened_request_is_cancelled_and_a_helper_s_death_fails_the_group_at_once(ray_cluster, tiny_model):
    """A widened request is cancelled like any other (its helpers go back, and the next request runs
    on the group); a helper killed while it helps fails the group at once, not at a collective's
    timeout."""
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), lane_widening=True, requests_per_rank=1,
        collective_timeout_s=120,
    )  # fmt: skip
    long = GenerationRequest(prompt="long", num_inference_steps=2000, width=32, height=32)
    short = dataclasses.replace(long, prompt="short", num_inference_steps=2, lane_size=1)

    def widened_long(group: ShardGroup, name: str, request: GenerationRequest = long) -> concurrent.futures.Future:
        """A long request on rank 1's lane of one, helped by rank 0 once a short one there ended:
        returned once rank 0 ran one of its forwards on the lane of two."""
        helped = group.tick_stats()[0]["helped"]
        # Of like work: a lane of one opens beside the other (``lanes.LockStep``).
        group.submit(dataclasses.replace(request, request_id=f"short-{name}", num_inference_steps=2, lane_size=1))
        future = group.submit(dataclasses.replace(request, request_id=name))
        wait_until(lambda: group.progress().get(name, {}).get("helpers") == [0], 60, f"{name} is widened")
        wait_until(lambda: group.tick_stats()[0]["helped"] > helped, 60, f"{name} runs a forward widened")
        return future

    with ShardGroup(config) as group:
        future = widened_long(group, "cancelled")
        assert group.cancel("cancelled")
        with pytest.raises(RequestCancelledError):
            future.result(timeout=60)
        # On a lane of one: a measured lane of two no faster here (CPU) would end widening.
        after = group.generate([dataclasses.replace(short, request_id="after")])[0]
        assert after.frames.shape == (1, 1, 32, 32, 3)
        # The helper goes back when the widened request's loop ends: its decode (about a second here)
        # runs on its own lane of one.
        large = dataclasses.replace(long, num_inference_steps=60, width=128, height=128, num_frames=17)
        decoded = widened_long(group, "decoded", large)
        wait_until(lambda: decoded.done() or group.progress()["decoded"]["step"] >= 60, 120, "its loop ends")
        wait_until(lambda: decoded.done() or group.progress()["decoded"]["helpers"] == [], 60, "the helper goes back")
        assert not decoded.done(), "the helper stayed through the decode"
        print("decode", decoded.result(timeout=120).after_loop_s)
        doomed = widened_long(group, "doomed")
        killed_at = time.monotonic()
        os.kill(group.placement[0]["pid"], signal.SIGKILL)  # the helper
        with pytest.raises(GroupFailedError, match="rank 0 died"):
            doomed.result(timeout=60)
        assert time.monotonic() - killed_at < 30  # not the collective timeout


def test_a_request_the_neighbour_rule_admits_beside_a_widened_one_takes_its_helpers_back(
    ray_cluster, tiny_model, reference_pipe
):
    """With two places per rank and a fitted tick floor, a newcomer is admitted on the ranks of a
    widened request's wider lane (a helper's load of one is below capacity): the helpers still go
    back at their next tick, and both results equal the unsharded run."""
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), lane_widening=True, requests_per_rank=2
    )
    long = GenerationRequest(prompt="rain at night", seed=5, num_inference_steps=60, width=32, height=32)
    short = dataclasses.replace(long, prompt="a dog", seed=4, num_inference_steps=10, lane_size=1)
    third = dataclasses.replace(long, prompt="a cat", seed=6, num_inference_steps=3)
    with ShardGroup(config) as group:
        work = group.check(long).work
        for size in (1, 2):  # a lane of one as fast as the lane of two: the long one gets rank 1
            group.lane_times.learn(size, work, 1.0)
        short_future = group.submit(dataclasses.replace(short, request_id="short"))
        long_future = group.submit(dataclasses.replace(long, request_id="long"))
        wait_until(lambda: group.progress().get("long", {}).get("step", 0) >= 1, 60, "the long one runs")
        with group._cond:  # nothing measured: widening is tried once the short one ends
            group.lane_times = LaneTimes()
        assert short_future.result(timeout=120).frames is not None
        wait_until(lambda: group.progress()["long"]["helpers"] == [0], 60, "rank 0 helps the long one")
        assert group.idle_lanes() == 1  # the helper's rank: a newcomer takes it back at once
        cost = group.check(long).request.forward_cost
        fitted = TickModel()
        for step_work in (cost, 4 * cost) * 4:
            fitted.learn(step_work, 0.5)  # a step that does not grow with the work: the floor is capped
        with group._cond:
            group.tick_model = fitted
        third_future = group.submit(dataclasses.replace(third, request_id="third"))
        wait_until(lambda: group.progress().get("third", {}).get("state") == "running", 60, "the third one runs")
        assert group.progress()["long"]["helpers"] == [], "the helper was not given back"
        results = {"third": third_future.result(timeout=120), "long": long_future.result(timeout=300)}
    for name, request in (("third", third), ("long", long)):
        assert max_abs_diff(results[name].frames, reference_frames(reference_pipe, request)) <= TOLERANCE, name
