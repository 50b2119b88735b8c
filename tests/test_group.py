"""Shard groups on real Ray placement groups with gloo: parity, memory, queue choice, teardown."""

import pytest
import ray
from ray.util.placement_group import placement_group_table
from support import max_abs_diff, reference_frames, wait_until

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup, pick_next
from ray_hsdp.request import GenerationRequest

TOL = 1e-5


def request(prompt, seed, **overrides):
    fields = dict(prompt=prompt, seed=seed, width=64, height=64, num_frames=5, num_inference_steps=2)
    return GenerationRequest(**{**fields, **overrides})


@pytest.fixture(scope="module")
def batch_group(ray_cluster, tiny_model):
    with ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2, mode="batch")) as group:
        yield group


@pytest.fixture(scope="module")
def replicated_group(ray_cluster, tiny_model):
    with ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2, mode="replicated")) as group:
        yield group


def test_batch_mode_runs_two_prompts_at_once_each_equal_to_unsharded(batch_group, reference_pipe):
    requests = [request("A cat and a dog baking a cake", 11), request("A red fox runs through the snow", 12)]
    results = batch_group.generate(requests)
    assert sorted(r.rank for r in results) == [0, 1]  # one request per rank, at the same time
    for req, result in zip(requests, results):
        ref = reference_frames(reference_pipe, req)
        assert result.frames.shape == ref.shape == (1, 5, 64, 64, 3)
        assert max_abs_diff(result.frames, ref) <= TOL
    # The two prompts really differ: parity is not trivially satisfied.
    assert max_abs_diff(results[0].frames, results[1].frames) > 1e-3


def test_the_start_says_where_its_time_went(batch_group):
    """Issue 23: the group's phases as it waited on them (one log line each) and each rank's own,
    in /v1/pool's describe()."""
    start = batch_group.describe()["start"]
    group = start["phases_s"]
    assert list(group) == ["placement", "rank processes and imports", "rendezvous", "load", "total"]
    assert all(seconds >= 0 for seconds in group.values())
    assert sum(v for k, v in group.items() if k != "total") <= group["total"]
    assert len(start["ranks_phases_s"]) == 2
    for rank in start["ranks_phases_s"]:
        # The rank's own: its imports, process group, each sharded component's slices, the rest.
        assert {"imports", "process group", "shards of transformer", "shards of text_encoder"} <= set(rank)
        assert {"other components", "request slots"} <= set(rank)
        # Ray's worker start and the rank's class imports, then its own imports: within the group's wait.
        assert 0 < rank["actor start"] and rank["actor start"] + rank["imports"] <= group["rank processes and imports"]
        # Its loading phases happen inside the group's "load" wait.
        loading = ("shards of transformer", "shards of text_encoder", "other components", "parallel setup")
        assert sum(rank[k] for k in loading if k in rank) <= group["load"]


def test_replicated_mode_equals_unsharded(replicated_group, reference_pipe):
    req = request("An astronaut rides a horse on the moon", 7, negative_prompt="low quality", num_frames=1)
    (result,) = replicated_group.generate([req])
    assert result.rank == 0
    assert max_abs_diff(result.frames, reference_frames(reference_pipe, req)) <= TOL


def test_pick_next_prefers_similar_cost_but_never_starves():
    small, big = request("s", 1), request("b", 2, width=96, num_frames=9)
    pending = [big, small, big]
    assert pick_next(pending, 0.0, [small], lookahead=16, max_skip_s=10) == 1
    assert pick_next(pending, 0.0, [big], lookahead=16, max_skip_s=10) == 0
    assert pick_next(pending, 11.0, [small], lookahead=16, max_skip_s=10) == 0  # waited too long
    assert pick_next(pending, 0.0, [small], lookahead=1, max_skip_s=10) == 0
    assert pick_next(pending, 0.0, [], lookahead=16, max_skip_s=10) == 0
    assert pick_next([], 0.0, [small], lookahead=16, max_skip_s=10) is None


def test_each_rank_holds_about_half_of_every_sharded_module(batch_group):
    ranks = batch_group.memory(units=True)
    assert [r["shard_index"] for r in ranks] == [0, 1]
    assert set(ranks[0]["sharded_components"]) == {"transformer", "text_encoder"}
    for component in ("transformer", "text_encoder"):
        full = ranks[0]["components"][component]["sharded_full"]
        assert full > 0
        local = [r["components"][component]["sharded_local"] for r in ranks]
        assert sum(local) == full
        assert all(0.45 <= x / full <= 0.55 for x in local), (component, local, full)
        for unit, sizes in ranks[0]["units"][component].items():
            unit_local = [r["units"][component][unit]["local"] for r in ranks]
            assert sum(unit_local) == sizes["full"] > 0
            assert all(x / sizes["full"] <= 0.6 for x in unit_local), (component, unit, unit_local)
    # The VAE is not sharded: every rank holds all of it.
    vae = [r["components"]["vae"] for r in ranks]
    assert all(v["sharded_full"] == 0 and v["replicated"] > 0 for v in vae)


def test_shutdown_with_a_request_running_answers_it_removes_everything_and_is_safe_twice(ray_cluster, tiny_model):
    import time

    from ray_hsdp.group import GroupFailedError

    group = ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2)).start()
    ranks, pg = list(group.ranks), group._pg
    running = group.submit(request("a long one", 1, num_inference_steps=2000, request_id="long"))
    wait_until(lambda: group.progress().get("long", {}).get("step", 0) >= 1, what="the first step")
    started = time.monotonic()
    group.shutdown()  # the rank's session sits in its loop: leave must not wait behind it
    assert time.monotonic() - started < 10
    with pytest.raises(GroupFailedError, match="shut down"):
        running.result(timeout=0)
    group.shutdown()
    assert placement_group_table(pg)["state"] == "REMOVED"
    for rank in ranks:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(rank.ping.remote(), timeout=30)
    with pytest.raises(RuntimeError, match="shut down"):
        group.submit(request("a", 1))


def test_max_queue_zero_takes_what_the_ranks_can_run_and_no_more(ray_cluster, tiny_model):
    from ray_hsdp.group import GroupOverloadedError

    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=1, max_queue=0)
    with ShardGroup(config) as group:
        running = [group.submit(request(f"runs {i}", i)) for i in range(2)]
        with pytest.raises(GroupOverloadedError, match="max_queue=0"):
            group.submit(request("one too many", 3))
        assert all(f.result(timeout=120).frames.shape == (1, 5, 64, 64, 3) for f in running)
        (after,) = group.generate([request("room again", 4)])
        assert after.frames.shape == (1, 5, 64, 64, 3)


def test_a_cancelled_request_stops_at_its_next_step_without_decoding(batch_group, reference_pipe):
    from ray_hsdp.request import RequestCancelledError

    batch_group.start_profile()
    long = request("cancelled", 5, num_inference_steps=200, request_id="cancel-me")
    beside = request("beside it", 6, num_inference_steps=3)
    doomed, other = batch_group.submit(long), batch_group.submit(beside)
    wait_until(lambda: batch_group.progress().get("cancel-me", {}).get("step", 0) >= 3, what="step 3")
    step = batch_group.progress()["cancel-me"]["step"]
    assert batch_group.cancel("cancel-me")
    with pytest.raises(RequestCancelledError):
        doomed.result(timeout=30)
    wait_until(lambda: "cancel-me" not in batch_group.progress(), 30, "the cancelled request leaving its rank")
    result = other.result(timeout=120)
    profiles = batch_group.stop_profile()
    (record,) = [p["requests"]["cancel-me"] for p in profiles if "cancel-me" in p["requests"]]
    assert len(record["steps"]) <= step + 2  # it stopped within two steps of the cancel
    assert max_abs_diff(result.frames, reference_frames(reference_pipe, beside)) <= TOL
    assert not batch_group.cancel("cancel-me")  # gone


def test_idle_lanes_are_lanes_that_run_nothing_not_free_places(batch_group):
    """What video takeover takes jobs for (issue 54): a lane whose rank runs a request is not idle,
    though ``requests_per_rank`` (2) leaves it a second place: a job taken there would run beside
    another at its pace."""
    from ray_hsdp.request import RequestCancelledError

    assert batch_group.idle_lanes() == 2
    names = ["idle-0", "idle-1"]
    futures = [batch_group.submit(request(name, 3, num_inference_steps=500, request_id=name)) for name in names]
    wait_until(lambda: all(batch_group.progress().get(n, {}).get("state") == "running" for n in names), 60, "both run")
    assert batch_group.running_capacity == 4 and batch_group.idle_lanes() == 0
    for name, future in zip(names, futures):
        batch_group.cancel(name)
        with pytest.raises(RequestCancelledError):
            future.result(timeout=60)
    wait_until(lambda: batch_group.idle_lanes() == 2, 30, "both lanes idle again")


def test_a_queued_request_keeps_the_deadline_it_arrived_with(batch_group):
    """Issue 37: one deadline from arrival. A request that already waited elsewhere (a rebuild, a
    queue on another group) comes with its ``queue_deadline``; this group's queue ends its wait
    there, not ``queue_timeout_s`` (30 minutes) after it was queued here. (A retry elsewhere of a
    request that never ran keeps it: test_faults' killed rank.)"""
    import time

    from ray_hsdp.group import QueueTimeoutError

    running = [
        batch_group.submit(request(f"busy {i}", i, num_inference_steps=200, request_id=f"busy-{i}")) for i in range(4)
    ]
    wait_until(lambda: sum(p["state"] == "running" for p in batch_group.progress().values()) == 4, 60, "4 running")
    late = request("late", 9, request_id="late", queue_deadline=time.time() + 1.0)
    queued_at = time.monotonic()
    with pytest.raises(QueueTimeoutError, match="by its deadline .queue_timeout_s=1800 from its arrival"):
        batch_group.submit(late).result(timeout=30)
    assert time.monotonic() - queued_at < 10
    for i, future in enumerate(running):
        batch_group.cancel(f"busy-{i}")
        with pytest.raises(Exception):  # noqa: B017 - cancelled, whichever step it was at
            future.result(timeout=60)


def test_requests_with_targets_are_served_earliest_first_and_the_late_ones_last(ray_cluster, tiny_model):
    """Issue 39: the serving order. One lane stays busy; the other serves the queue one request at
    a time, so the order they are answered in is the order the group served them."""
    import time

    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, requests_per_rank=1, queue_max_skip_s=600)
    with ShardGroup(config) as group:
        answered = []
        group.listeners.append(lambda record: answered.append(record.request_id))
        busy = [group.submit(request(f"busy {i}", i, num_inference_steps=500, request_id=f"busy-{i}")) for i in (0, 1)]
        wait_until(lambda: sum(p["state"] == "running" for p in group.progress().values()) == 2, 60, "2 running")
        now = time.time()
        targets = {"none": None, "far": now + 1000, "late": now - 1, "near": now + 100, "mid": now + 500}
        queued = [group.submit(request(n, 7, request_id=n, deadline=t)) for n, t in targets.items()]
        group.cancel("busy-0")
        for future in queued:
            future.result(timeout=120)
        group.cancel("busy-1")
        for future in busy:
            with pytest.raises(Exception):  # noqa: B017 - cancelled
                future.result(timeout=60)
    assert [r for r in answered if not r.startswith("busy")] == ["near", "mid", "far", "late", "none"]


def test_units_kept_gathered_are_counted_once(ray_cluster, tiny_model):
    """Issue 37: with in-place gathers, a kept unit's whole weights were counted as replicated
    parameters and again as gather buffers. Now they are ``kept_whole`` alone: the replicated bytes
    are those of a group that keeps nothing, and the kept bytes are the transformer's full size."""
    totals = {}
    for keep in (0.0, 1.0):
        config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, gather="in_place", keep_gathered=keep)
        with ShardGroup(config) as group:
            (rank0, _) = group.memory()
        totals[keep] = rank0
    plain, kept = totals[0.0], totals[1.0]
    assert kept["total"]["replicated"] == plain["total"]["replicated"]
    assert kept["total"]["kept_whole"] == plain["components"]["transformer"]["sharded_full"] > 0
    assert plain["total"]["kept_whole"] == 0
    # Every unit and the root are kept: the transformer gathers nothing per forward.
    assert kept["total"]["gather_buffers"] < plain["total"]["gather_buffers"]


def test_a_checked_request_s_variant_is_built_once(batch_group, reference_pipe, monkeypatch):
    """Issue 85: a caller that checked a request (a replica, to refuse it before anything else) hands
    the variant to ``submit``, which builds none again."""
    from ray_hsdp.variant import RequestVariant

    built = []
    build = RequestVariant.build.__func__
    monkeypatch.setattr(
        RequestVariant, "build", classmethod(lambda cls, *a, **k: built.append(1) or build(cls, *a, **k))
    )
    ask = request("A lighthouse at dusk", 21)
    variant = batch_group.check(ask)
    result = batch_group.submit(variant).result(timeout=120)
    assert len(built) == 1 and max_abs_diff(result.frames, reference_frames(reference_pipe, ask)) <= TOL
    assert result.request_id == ask.request_id
