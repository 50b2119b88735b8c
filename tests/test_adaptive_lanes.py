"""Adaptive lanes (issue 39): a group of ``lane_sizes`` gives each request its lane when it takes
it. The policy (``ray_hsdp.group.lanes``), the refusals, and a group that runs lanes of one and of
two ranks at once, each result equal to the unsharded diffusers pipeline's."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import signal
import time

import pytest
from PIL import Image
from support import max_abs_diff, pipeline_with_adapters, reference_frames, reference_with, wait_until

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import GroupFailedError, ShardGroup
from ray_hsdp.group.lanes import (
    LaneAsk,
    LaneRoom,
    LaneTimes,
    LeanLanes,
    LockStep,
    TickModel,
    Waiting,
    as_fast,
    queue_keeps_up,
    serving_order,
)
from ray_hsdp.request import GenerationRequest, InvalidRequestError, RequestCancelledError, StepCache
from ray_hsdp.variant.lane import UnsplittableRequestError, sequence_tokens

TOLERANCE = 1e-5
DIMS = ParallelDims(1, 4, lane_sizes=(1, 2, 4))


def lane_for(sizes, loads, capacity=1, waiting=1, lock_step=None, **ask) -> range | None:
    """The lane ``LeanLanes`` gives a request of ``sizes`` (and ``ask``'s other fields) on ``DIMS``."""
    return LeanLanes(DIMS, capacity).lane(LaneAsk(sizes, **ask), LaneRoom(loads, waiting, lock_step))


def test_an_idle_group_gives_a_lone_request_its_widest_lane():
    assert lane_for((1, 2, 4), [0, 0, 0, 0]) == range(0, 4)
    assert lane_for((1, 2), [0, 0, 0, 0]) == range(0, 2)  # its tokens split over 2 at most
    # A narrower lane measured faster (a split that costs more than it saves) is the lone request's.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], estimates={1: 1.0, 2: 1.5, 4: 2.0}) == range(0, 1)
    # Within EFFICIENT of the fastest, the narrowest (measured on 4 x H200: 480x320 at 21 frames, 2 steps,
    # bound by the weight gathers): as fast, and three ranks stay free for the next request.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], estimates={1: 1.60, 2: 1.62, 4: 1.66}) == range(0, 1)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], estimates={1: 5.29, 2: 3.21, 4: 3.01}) == range(0, 2)


def test_a_backlog_gets_lanes_of_one_rank_and_free_ranks_are_shared():
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4) == range(0, 1)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=2) == range(0, 2)
    assert lane_for((1, 2, 4), [1, 0, 0, 0]) == range(2, 4)  # an aligned free block
    assert lane_for((1, 2, 4), [1, 1, 1, 1]) is None  # it waits


def test_a_request_s_own_lane_size_is_honoured_and_waited_for():
    assert lane_for((1, 2, 4), [0, 0, 0, 0], named=1) == range(0, 1)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=5, named=4) == range(0, 4)
    assert lane_for((1, 2, 4), [0, 1, 0, 0], named=4) is None  # a lane of 4 waits for all four


# Per-forward work in output pixels (GenerationRequest.forward_cost) at 21 frames: the mix of run d.
LARGE, SMALL = 832 * 480 * 21, 480 * 320 * 21


def test_lanes_open_only_beside_lanes_of_like_work():
    """In lock step a tick lasts as long as the busiest rank's forwards: unlike lanes side by side
    make one of them run at the other's pace, so the request waits for the running lanes to drain."""
    large_on_one = [LARGE, 0, 0, 0]  # a large request on a lane of one rank (rank 0)
    # A small request beside it would run at its pace: it waits, though three ranks are free.
    assert lane_for((1, 2, 4), [1, 0, 0, 0], waiting=3, lock_step=LockStep(large_on_one, SMALL)) is None
    # Another large one opens beside it.
    assert lane_for((1, 2, 4), [1, 0, 0, 0], waiting=3, lock_step=LockStep(large_on_one, LARGE)) == range(1, 2)
    # A small request opens a lane of one rank beside a large one on a lane of two (work 1.3x apart).
    large_on_two = [LARGE / 2, LARGE / 2, 0, 0]
    assert lane_for((1, 2, 4), [1, 1, 0, 0], waiting=2, lock_step=LockStep(large_on_two, SMALL)) == range(2, 3)
    # A large request does not join ranks that run small ones (they would run at its pace).
    small_on_four = [SMALL / 4] * 4
    assert lane_for((1, 2, 4), [1, 1, 1, 1], capacity=2, lock_step=LockStep(small_on_four, LARGE)) is None
    # A small one joins a large one's lane of four (the wide lane's next request, as a fixed wide lane runs).
    large_on_four = [LARGE / 4] * 4
    assert lane_for((1, 2, 4), [1, 1, 1, 1], capacity=2, lock_step=LockStep(large_on_four, SMALL)) == range(0, 4)
    # An idle group opens any lane; a request that names its lane size gets it regardless.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], lock_step=LockStep([0.0] * 4, SMALL)) == range(0, 4)
    assert lane_for((1, 2, 4), [1, 0, 0, 0], named=1, lock_step=LockStep(large_on_one, SMALL)) == range(1, 2)


def test_lock_step_alike_compares_the_tick_with_the_running_one_and_the_lane_s_own_work():
    assert LockStep([0.0, 0.0], 10.0).alike(range(0, 2))  # an idle group
    assert LockStep([10.0, 0.0], 10.0).alike(range(1, 2))  # tick 10 either way
    assert not LockStep([10.0, 0.0], 5.0).alike(range(1, 2))  # it would run at twice its own pace
    assert not LockStep([5.0, 0.0], 10.0).alike(range(1, 2))  # the running lane would run at half its pace
    assert LockStep([6.0, 0.0], 5.0).alike(range(1, 2))  # 1.2x apart: within ALIKE
    # A second request of like work on the ranks of a running wide lane doubles its work: refused while a
    # tick is its work alone, let in once a step's fixed part (the floor) is worth more than the work.
    wide = LockStep([2.5] * 4, 10.0)
    assert not wide.alike(range(0, 4)) and LockStep([2.5] * 4, 10.0, floor=10.0).alike(range(0, 4))
    assert max(wide.with_lane(range(0, 2))) == 7.5


def test_the_tick_model_fits_a_step_s_fixed_part_and_reads_it_as_work():
    model = TickModel()
    for work in (100.0, 200.0, 300.0, 400.0) * 2:
        model.learn(work, 0.3 + 0.001 * work)  # 0.3 s fixed, 1 ms per unit of work
    assert model.floor() == pytest.approx(300.0)
    unknown = TickModel()
    for work in [100.0] * 7:
        unknown.learn(work, 0.4)
    assert unknown.floor() == 0.0  # too few runs
    unknown.learn(120.0, 0.4)
    assert unknown.floor() == 0.0  # eight runs, but their work spread less than SPREAD times
    flat = TickModel()
    for work in (100.0, 400.0) * 4:
        flat.learn(work, 0.45)  # a step that does not grow with the work: the cap
    assert flat.floor() == TickModel.CAP * 400.0
    bound = TickModel()
    for work in (100.0, 400.0) * 4:
        bound.learn(work, 0.002 * work)  # no fixed part: the rule as without a floor
    assert bound.floor() == 0.0
    for _ in range(TickModel.KEPT):
        bound.learn(0.0, 1.0)  # nothing measured: not learnt
    assert bound.floor() == 0.0 and len(bound) == 8


def test_lane_sizes_refuse_fixed_lanes_and_sizes_that_do_not_divide_the_group():
    with pytest.raises(ValueError, match="lane_sizes gives each request its lane"):
        GroupConfig(model="tiny", shard_size=2, lane_sizes=(1, 2), ulysses_degree=2)
    with pytest.raises(ValueError, match="a lane of 3 ranks must divide shard_size=2"):
        GroupConfig(model="tiny", shard_size=2, lane_sizes=(1, 3))
    # Lanes that do not nest: a request on ranks 2-3 would lie across the lanes of three (0-2, 3-5).
    with pytest.raises(ValueError, match=r"lane_sizes \[2, 3\]: a lane of 2 ranks must divide a lane of 3"):
        GroupConfig(model="tiny", shard_size=6, lane_sizes=(2, 3))
    assert GroupConfig(model="tiny", shard_size=6, lane_sizes=(1, 3, 6)).parallel_dims().lane_sizes == (1, 3, 6)
    assert GroupConfig(model="tiny", shard_size=2, lane_sizes=(1, 2), compile=True).compile  # compiles per lane size


MIX = [
    GenerationRequest(prompt="a cat on a roof", seed=3, num_inference_steps=3, width=32, height=32, num_frames=5),
    GenerationRequest(prompt="a dog", seed=4, num_inference_steps=2, width=48, height=32, guidance_scale=1.0),
    GenerationRequest(prompt="rain at night", seed=5, num_inference_steps=4, width=64, height=32, num_frames=9),
    GenerationRequest(prompt="odd tokens", seed=6, num_inference_steps=2, width=48, height=48),  # 9: lanes of 1 only
]


LORAS = {"style": "tiny-style"}


@pytest.fixture(scope="module")
def adapted_pipe(tiny_model):
    return pipeline_with_adapters(tiny_model, LORAS)


def test_a_group_runs_lanes_of_one_and_two_at_once_and_equals_unsharded(ray_cluster, tiny_model, adapted_pipe):
    """Requests of every size at once, some naming their lane, some with an adapter, some with a
    step cache (First Block Cache: its measure reduced over the request's own lane), those on the
    lane of two decoding by bands of rows over it (``vae_parallel: rows``) while lanes of one decode
    alone: each equals the unsharded diffusers run of the same request."""
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), loras=LORAS,
        cache={"kind": "first_block", "every_request": False}, vae_parallel="rows",
    )  # fmt: skip
    records = []
    with ShardGroup(config) as group:
        group.listeners.append(records.append)
        assert group.describe()["lane_sizes"] == [1, 2]
        alone = group.generate([dataclasses.replace(MIX[0], request_id="alone")])
        burst = [
            dataclasses.replace(
                r,
                request_id=f"burst-{i}",
                lora=(("style", 0.7),) if i % 2 == 0 else (),
                cache=StepCache("first_block") if i < 2 else None,
            )  # fmt: skip
            for i, r in enumerate(MIX)
        ]
        named = [
            dataclasses.replace(MIX[2], request_id="named-2", lane_size=2, cache=StepCache("first_block")),
            dataclasses.replace(MIX[0], request_id="named-1", lane_size=1),
        ]
        results = group.generate(burst + named)
        with pytest.raises(InvalidRequestError, match="lane_size=4: this group's lanes are of 1, 2 ranks"):
            group.submit(dataclasses.replace(MIX[0], lane_size=4))
        with pytest.raises(UnsplittableRequestError, match="lane_size=2: 48x48 with 1 frames does not split"):
            group.submit(dataclasses.replace(MIX[3], lane_size=2))
        exchanges = [stats["decode_exchanges"] for stats in group.tick_stats()]
        # A long request on a lane of one rank, then a short one on the lane of two beside it: the
        # short one's shared decode does not wait for the long one (which its other rank never runs).
        long = group.submit(dataclasses.replace(MIX[0], request_id="long", lane_size=1, num_inference_steps=150))
        short = group.submit(dataclasses.replace(MIX[2], request_id="short", lane_size=2, num_inference_steps=2))
        first, _ = concurrent.futures.wait([long, short], timeout=300, return_when=concurrent.futures.FIRST_COMPLETED)
        assert first == {short}
        assert long.result(timeout=300).frames is not None
    assert exchanges[0] == exchanges[1] > 0  # both ranks of the lane of two shared its decodes
    # The tick model read every answered request's mean step against the work it was taken beside.
    assert len(group.tick_model) == sum(1 for r in records if r.status == "ok" and r.step_s) > 0
    # Each record says where its run went: before the loop, its steps, after it (the decode).
    for record in (r for r in records if r.status == "ok" and r.steps > 1):
        assert 0 <= record.before_loop_s < record.run_s and 0 < record.after_loop_s < record.run_s, record
        assert record.before_loop_s + record.steps * record.step_s + record.after_loop_s < 1.5 * record.run_s, record
    assert all(r.cached_forwards is not None for r, q in zip(results, [*burst, *named]) if q.cache)
    for request, result in zip([MIX[0], *burst, *named], [*alone, *results]):
        assert max_abs_diff(result.frames, reference_with(adapted_pipe, request)) <= TOLERANCE, request
    sizes = {r.request_id: r.lane_size for r in records if r.status == "ok"}
    assert sizes["alone"] == 2 and sizes["named-2"] == 2 and sizes["named-1"] == 1  # idle group: its widest lane
    assert sizes["burst-3"] == 1  # 9 tokens split over no lane of 2
    assert 1 in {sizes[f"burst-{i}"] for i in range(4)}  # a backlog: lanes of one rank


def test_the_warm_up_fills_every_place_of_every_lane_of_each_size_in_turn():
    from ray_hsdp.group.warm_up import warm_up_requests

    batches = warm_up_requests(DIMS, requests_per_rank=2, image_input=False)
    assert [[r.lane_size for r in batch] for batch in batches] == [[1] * 8, [2] * 4, [4] * 2]
    assert len({r.request_id for batch in batches for r in batch}) == 14
    assert {r.num_inference_steps for batch in batches for r in batch} == {1}
    fixed = warm_up_requests(ParallelDims(1, 4, ulysses=2), requests_per_rank=2, image_input=True, steps=2)
    assert [[r.lane_size for r in batch] for batch in fixed] == [[None, None]]  # one per lane
    assert all(r.image is not None for r in fixed[0])
    assert all(r.num_inference_steps == 2 for r in fixed[0])  # a two-expert pipeline's warm-up reaches both
    # Each warm-up splits over its lane's sequence ranks (Wan's token grid: 16 pixels a token): a lane of
    # 3 or 6 Ulysses ranks, or a fixed lane of 5, gets no 64x64 request (16 tokens), which none of them splits.
    wan = {"spatial_stride": 16, "temporal_stride": 4, "temporal_patch": 1}
    odd = warm_up_requests(ParallelDims(1, 6, lane_sizes=(1, 3, 6)), 1, image_input=True, sequence=wan)
    for batch in odd:
        for r in batch:
            tokens = sequence_tokens(wan, r.height, r.width, r.num_frames)
            assert tokens % r.lane_size == 0 and r.width * r.height <= 96 * 64, r
            assert Image.open(io.BytesIO(r.image)).size == (r.width, r.height)
    assert {(r.width, r.height) for r in odd[1]} == {(96, 64)}
    (fifths,) = warm_up_requests(ParallelDims(1, 5, ulysses=5), 1, image_input=False, sequence=wan)
    assert [(r.width, r.height) for r in fifths] == [(80, 64)]


def test_a_compiled_group_warms_every_lane_size_and_learns_no_time_from_a_run_that_compiled(
    ray_cluster, tiny_model, adapted_pipe
):
    """``compile`` with ``lane_sizes``: the start compiles each lane size on every rank (warm-up
    requests named for each size), each size's forwards its own graphs (its parallel config), and
    requests of the warm-up's shape on a lane of one, on the lane of two, and where the group puts
    them equal the unsharded run without compiling. The warm-up is no user's request (no listener
    hears of it) and teaches the group's lane times and tick model nothing; nor does a request of a
    new shape, which compiles (its record says so); the next request of that shape does teach."""
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), compile=True)
    shape = {"width": 64, "height": 64, "num_frames": 1}  # the warm-up's: nothing compiles in a request
    requests = [
        GenerationRequest(prompt="a cat", seed=7, lane_size=1, request_id="one-a", **shape),
        GenerationRequest(prompt="a dog", seed=8, lane_size=1, request_id="one-b", **shape),
        GenerationRequest(prompt="rain", seed=9, lane_size=2, request_id="two", **shape),
        GenerationRequest(prompt="snow", seed=10, request_id="placed", **shape),
    ]
    new_shape = GenerationRequest(prompt="hail", seed=11, lane_size=1, width=96, height=64, request_id="new-shape")
    records = []
    group = ShardGroup(config)
    group.listeners.append(records.append)  # before the start, as a Serve replica attaches its metrics
    with group:
        assert records == [] and group.lane_times.as_dict() == {} and len(group.tick_model) == 0
        warmed = [stats["compiled_graphs"] for stats in group.tick_stats()]
        results = group.generate(requests)
        assert [stats["compiled_graphs"] for stats in group.tick_stats()] == warmed  # no compile in a request
        learnt = group.lane_times.as_dict()
        (compiled,) = group.generate([new_shape])
        assert group.lane_times.as_dict() == learnt  # the run that compiled taught nothing
        work = group.check(new_shape).work
        group.generate([dataclasses.replace(new_shape, request_id="new-shape-again")])
        assert f"1x{work}" in group.lane_times.as_dict()
        # Each sharded block compiled whole: its gather hooks and the lane's splits stay outside.
        compiled_blocks = [rank["compile"] for rank in group.memory()]
    assert all(c["modules"] > 0 and c["graph_breaks"] == 0 for c in compiled_blocks), compiled_blocks
    assert all(count > 0 for count in warmed)
    by_id = {r.request_id: r for r in records}
    assert not any(name.startswith("warm-up") for name in by_id)
    assert by_id["new-shape"].compiled and not by_id["new-shape-again"].compiled
    assert not any(by_id[r.request_id].compiled for r in requests)
    sizes = {name: r.lane_size for name, r in by_id.items()}
    assert sizes["one-a"] == sizes["one-b"] == 1 and sizes["two"] == 2
    for request, result in zip([*requests, new_shape], [*results, compiled]):
        assert max_abs_diff(result.frames, reference_with(adapted_pipe, request)) <= TOLERANCE, request


def test_a_fixed_group_refuses_a_request_s_lane_size(ray_cluster, tiny_model):
    from ray_hsdp.variant import RequestVariant

    with pytest.raises(InvalidRequestError, match="fixed lanes .* with a request's lane_size"):
        RequestVariant.build(dataclasses.replace(MIX[0], lane_size=1), GroupConfig(model=tiny_model), {})


def test_a_request_on_a_lane_of_two_is_cancelled_and_a_rank_s_death_fails_the_group_at_once(ray_cluster, tiny_model):
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), collective_timeout_s=120)
    long = GenerationRequest(prompt="long", num_inference_steps=2000, width=32, height=32, request_id="long")
    with ShardGroup(config) as group:
        future = group.submit(long)
        wait_until(lambda: group.progress().get("long", {}).get("step", 0) >= 1, 60, "the request runs")
        assert group.progress()["long"]["lane_size"] == 2  # a lone request: the widest lane
        assert group.idle_lanes() == 0  # its lane holds every rank: no lane for a video job taken over
        assert group.cancel("long")
        with pytest.raises(RequestCancelledError):
            future.result(timeout=60)
        after = group.generate([dataclasses.replace(MIX[0], request_id="after")])[0]
        assert after.frames.shape == (1, 5, 32, 32, 3)
        doomed = group.submit(dataclasses.replace(long, request_id="doomed"))
        wait_until(lambda: group.progress().get("doomed", {}).get("step", 0) >= 1, 60, "the request runs")
        killed_at = time.monotonic()
        os.kill(group.placement[1]["pid"], signal.SIGKILL)  # the lane's follower
        with pytest.raises(GroupFailedError, match="rank 1 died"):
            doomed.result(timeout=60)
        assert time.monotonic() - killed_at < 30  # not the collective timeout


def test_a_backlog_keeps_a_wide_lane_when_its_split_costs_no_throughput():
    """Measured on 4 x H100 (Wan2.1-14B, 21 frames): a lane of 4 ran a request in about a quarter of
    the time of a lane of 1, so lanes of one rank under a backlog only lost latency."""
    scales = {1: 7.0, 2: 3.6, 4: 1.85}  # seconds on each lane: rank-seconds 7.0, 7.2, 7.4
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, estimates=scales) == range(0, 4)
    sublinear = {1: 7.0, 4: 3.0}  # rank-seconds 7 against 12: the backlog's lanes of one
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, estimates=sublinear) == range(0, 1)


def test_a_request_with_a_target_gets_a_lane_that_its_measured_time_says_makes_it():
    times = {1: 4.0, 2: 2.4, 4: 1.5}  # seconds on each lane: rank-seconds 4.0, 4.8, 6.0
    # A backlog would get lanes of one rank; one that would then miss its target gets a wider one.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=3.0, estimates=times) == range(0, 2)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=5.0, estimates=times) == range(0, 1)
    # No free lane makes it but a busy wider one would: it waits.
    assert lane_for((1, 2, 4), [0, 1, 1, 1], due_s=3.0, estimates=times) is None
    # None would: it is served like a request without a target (its share of the free ranks).
    assert lane_for((1, 2, 4), [0, 1, 1, 1], due_s=1.0, estimates=times) == range(0, 1)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=1.0, estimates=times) == range(0, 1)
    # A size not measured yet counts as in time (the group learns it from the first request on it).
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=3.0, estimates={1: 4.0}) == range(0, 2)


def test_lean_lanes_are_the_narrowest_as_fast_as_the_fastest():
    assert as_fast((1, 2, 4), {1: 1.60, 2: 1.62, 4: 1.66}) == [1, 2, 4]
    assert as_fast((1, 2, 4), {1: 5.29, 2: 3.21, 4: 3.01}) == [2, 4]
    assert as_fast((1, 2, 4), {1: 4.0, 2: 2.4, 4: 1.5}) == [4]
    assert as_fast((1, 2, 4), {1: 1.0}) == [4]  # a size never measured: the widest of those, to learn it


def test_a_backlog_that_the_lean_lanes_clear_in_time_runs_there():
    # Two requests of 2 s on the widest lane (of 4 ranks), due in 6 s: they finish at 2 and 4 s; four at 8 s.
    assert queue_keeps_up([(6.0, 2.0, 4)] * 2, 0.0, 4, 1)
    assert not queue_keeps_up([(6.0, 2.0, 4)] * 4, 0.0, 4, 1)
    assert queue_keeps_up([(6.0, 2.0, 4)] * 4, 0.0, 4, 2)  # two at a time: they finish at 2, 2, 4 and 4 s
    assert not queue_keeps_up([(6.0, 2.0, 4)] * 2, 3.0, 4, 1)  # the work running now drains first
    assert queue_keeps_up([(2.5, 2.0, 1)] * 4, 0.0, 4, 1)  # lanes of one: four side by side
    assert not queue_keeps_up([(2.5, 2.0, 1)] * 5, 0.0, 4, 1)  # the fifth waits for a rank
    times = {1: 4.0, 2: 2.4, 4: 1.5}
    # A backlog of four would get lanes of one rank (4 s, in time); keeping up, they run on the lean lane.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=5.0, estimates=times) == range(0, 1)
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, due_s=5.0, estimates=times, keeps_up=True) == range(0, 4)
    # ... or wait for it while it is busy, rather than open a slower narrow lane beside it.
    assert lane_for((1, 2, 4), [0, 0, 1, 1], waiting=4, due_s=5.0, estimates=times, keeps_up=True) is None
    # A lane as fast as the lean one is taken while the lean one is busy.
    flat = {1: 1.60, 2: 1.62, 4: 1.66}
    assert lane_for((1, 2, 4), [1, 0, 0, 0], waiting=4, due_s=5.0, estimates=flat, keeps_up=True) == range(1, 2)
    assert lane_for((2, 4), [1, 0, 0, 0], waiting=4, due_s=5.0, estimates=flat, keeps_up=True) == range(2, 4)
    # A request without a target, or one that names its size, is not held to it.
    assert lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, estimates=times, keeps_up=True) == range(0, 1)
    named = lane_for((1, 2, 4), [0, 0, 0, 0], waiting=4, named=1, due_s=5.0, estimates=times, keeps_up=True)
    assert named == range(0, 1)


def test_measured_times_are_kept_per_lane_size_and_work_and_follow_the_load():
    times = LaneTimes()
    assert times.estimate(4, 100) is None
    times.learn(4, 100, 2.0)
    times.learn(4, 100, 4.0)  # the newest run weighs half
    times.learn(1, 400, 8.0)
    assert times.estimate(4, 100) == 3.0
    assert times.estimate(4, 300) == 9.0  # scaled from the nearest work measured on that size
    assert times.estimate(1, 100) == 2.0
    assert times.estimates((1, 2, 4), 100) == {1: 2.0, 4: 3.0}  # a size that never ran: absent
    for work in range(1000, 1000 + LaneTimes.KEPT - 1):  # one too many: the least recently measured goes
        times.learn(2, work, 1.0)
    assert times.estimate(4, 100) is None and times.estimate(1, 400) == 8.0


def test_requests_are_served_earliest_target_first_and_those_that_cannot_make_it_last():
    order = serving_order(
        [
            Waiting(waited_s=5.0, due_s=None, fastest_s=None),  # no target: after every target
            Waiting(waited_s=4.0, due_s=9.0, fastest_s=2.0),
            Waiting(waited_s=3.0, due_s=1.0, fastest_s=2.0),  # no lane makes it: behind those that can
            Waiting(waited_s=2.0, due_s=4.0, fastest_s=None),  # never measured: counts as in time
            Waiting(waited_s=1.0, due_s=-1.0, fastest_s=None),  # its target passed
        ],
        max_skip_s=10.0,
    )
    assert order == [3, 1, 4, 2, 0]
    assert serving_order([Waiting(3.0, None, None), Waiting(2.0, None, None)], 10.0) == [0, 1]  # arrival order
    # One passed over for max_skip_s goes first, however late its target.
    starved = serving_order([Waiting(1.0, 2.0, 1.0), Waiting(11.0, None, None), Waiting(12.0, 50.0, 1.0)], 10.0)
    assert starved == [2, 1, 0]


def test_lanes_of_one_two_and_four_with_cfg_halves_run_at_once_and_equal_unsharded(
    ray_cluster, tiny_model, reference_pipe
):
    """On 4 CPU ranks (the tiny model has 2 heads: a lane of 4 is CFG 2 x Ulysses 2, a lane of 2 is
    CFG 2): requests on lanes of every size at once, guided and not (an unguided request runs on
    both CFG halves), each equal to the unsharded run. A request with a target gets its lean lane
    by the group's measured times (here set to 10 / 2 / 1.5 s on lanes of 1 / 2 / 4: the lane of 4)."""
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=4, lane_sizes=(1, 2, 4), cfg_parallel=True)
    requests = [
        dataclasses.replace(MIX[0], request_id="four", lane_size=4),
        dataclasses.replace(MIX[3], request_id="two-9-tokens", lane_size=2),  # no Ulysses split on a lane of 2
        dataclasses.replace(MIX[1], request_id="unguided-four", lane_size=4),
        dataclasses.replace(MIX[2], request_id="one", lane_size=1),
        dataclasses.replace(MIX[2], request_id="chosen"),
        dataclasses.replace(MIX[0], request_id="two", lane_size=2),
    ]
    records = []
    with ShardGroup(config) as group:
        group.listeners.append(records.append)
        results = group.generate(requests)
        with pytest.raises(UnsplittableRequestError, match="lane_size=4: 48x48"):
            group.submit(dataclasses.replace(MIX[3], lane_size=4))
        targeted = dataclasses.replace(MIX[2], request_id="targeted", deadline=time.time() + 120)
        work = group.check(targeted).work
        for _ in range(16):  # each learn weighs the newest half: this sets the times
            for size, seconds in {1: 10.0, 2: 2.0, 4: 1.5}.items():
                group.lane_times.learn(size, work, seconds)
        requests, results = [*requests, targeted], [*results, *group.generate([targeted])]
    assert next(r.lane_size for r in records if r.request_id == "targeted") == 4
    for request, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(reference_pipe, request)) <= TOLERANCE, request
    sizes = {r.request_id: r.lane_size for r in records}
    assert [sizes[r.request_id] for r in requests if r.lane_size] == [r.lane_size for r in requests if r.lane_size]


def test_a_fitted_floor_lets_a_second_request_run_beside_one_on_the_wide_lane(ray_cluster, tiny_model):
    """A long request holds the idle group's wide lane. With no floor known, the neighbour rule keeps
    a second one of like work waiting (it would double the tick's work) until the long one ends; once
    the group's tick model has fitted a step that barely grows with the work, the second is taken
    beside the long one at once. The test decides what the model learns (steps whose fixed part
    dominates, as on CPU ranks and on 4 x H200), so that it asserts what the scheduler decides, not
    what a loaded host's clock measured; that a request's measured step feeds the model is asserted
    too."""
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, lane_sizes=(1, 2), requests_per_rank=2)
    long = dataclasses.replace(MIX[2], num_inference_steps=40, lane_size=2)
    second = dataclasses.replace(MIX[2], seed=7)  # the same work per forward, the group chooses its lane

    def taken_beside(group: ShardGroup, tag: str) -> bool:
        """Whether the second request was taken in the first half of the long one's steps (else it
        waited until they were done: the long one's lane then decodes, and takes it)."""
        held = group.submit(dataclasses.replace(long, request_id=f"long-{tag}"))
        wait_until(lambda: group.progress().get(f"long-{tag}", {}).get("step", 0) >= 1, 120, "the long one runs")
        other = group.submit(dataclasses.replace(second, request_id=f"second-{tag}"))
        seen: list[dict] = []

        def second_runs() -> bool:
            seen.append(group.progress())
            return held.done() or seen[-1].get(f"second-{tag}", {}).get("state") == "running"

        wait_until(second_runs, 300, "the second one runs or the long one ends")
        beside = not held.done() and seen[-1].get(f"long-{tag}", {}).get("step", long.num_inference_steps) < 20
        assert held.result(timeout=300).frames is not None and other.result(timeout=300).frames is not None
        return beside

    with ShardGroup(config) as group:
        assert group.tick_model.floor() == 0.0
        assert not taken_beside(group, "no-floor")
        assert len(group.tick_model) == 2  # both requests' measured steps
        # Steps of work 6 times apart that cost 1 s plus a millionth of a second per work unit.
        cost = group.check(long).request.forward_cost
        learnt = TickModel()
        for i in range(TickModel.MIN_RUNS):
            work = cost if i % 2 else cost / 6
            learnt.learn(work, 1.0 + 1e-6 * work)
        with group._cond:  # the scheduler reads the model under the group's lock
            group.tick_model = learnt
        # A second request alike beside the first needs a floor of half its cost (lanes.LockStep).
        assert group.tick_model.floor() >= cost
        assert taken_beside(group, "floor")
