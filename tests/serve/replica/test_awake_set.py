"""Who is awake on a GPU share (issue 83): least recently used idle models sleep first, never one
with work in flight or a resident one; an unknown size leaves room for nothing else."""

import pytest

from ray_hsdp.config.app import AppConfig
from ray_hsdp.serve.replica.awake_set import READY, SLEEPING, AwakeSet

GIB = 2**30


def ready(awake: AwakeSet, model: str, gib: float, resident: bool = False, used: float = 0.0):
    member = awake.join(model, model, resident)
    member.bytes, member.state, member.last_used = int(gib * GIB), READY, used
    return member


def test_the_least_recently_used_idle_models_sleep_until_the_next_fits():
    awake = AwakeSet(40 * GIB)
    ready(awake, "a", 15, used=3.0)
    ready(awake, "b", 15, used=1.0)
    c = ready(awake, "c", 30)
    c.state = SLEEPING
    assert [m.model for m in awake.victims("c")] == ["b", "a"]  # 15 + 15 + 30 and 15 + 30 > 40: both, older first
    c.bytes = 12 * GIB  # 15 + 15 + 12 > 40, 15 + 12 fits
    assert [m.model for m in awake.victims("c")] == ["b"]
    awake.enter("b", "request-1")  # work in flight: never put to sleep; the other goes instead
    assert [m.model for m in awake.victims("c")] == ["a"]
    awake.enter("a", "request-2")
    assert awake.victims("c") is None  # not until one of them is done


def test_without_a_budget_one_model_is_awake_and_a_resident_one_needs_a_budget():
    awake = AwakeSet(None)
    ready(awake, "a", 1)
    b = ready(awake, "b", 1)
    b.state = SLEEPING
    assert [m.model for m in awake.victims("b")] == ["a"]
    with pytest.raises(ValueError, match="resident: true needs gpu_share_budget_gib"):
        awake.join("c", "c", resident=True)


def test_a_resident_model_never_sleeps_and_one_too_large_is_named():
    awake = AwakeSet(30 * GIB)
    ready(awake, "r", 20, resident=True)
    b = ready(awake, "b", 15)
    b.state = SLEEPING
    assert awake.victims("b") is None
    assert "b holds 15.00 GiB per GPU awake beside 20.00 GiB of resident models" in awake.too_large("b")
    loading = awake.join("d", "d", resident=False)
    loading.state = "loading"
    # Its size unknown while it loads: the resident model stays beside it, every other sleeps first.
    assert awake.victims("d") == [] and not awake.fits(b)
    b.state = READY
    assert [m.model for m in awake.victims("d")] == ["b"]


def test_a_gpu_share_holds_one_group_of_each_model():
    for pair in ({"replicate_size": 2}, {"autoscaling": {"min_groups": 1, "max_groups": 2}}):
        with pytest.raises(ValueError, match="gpu_share holds one group of each of its models; it cannot be combined"):
            AppConfig(model="tiny", gpu_share="s", **pair)
    with pytest.raises(ValueError, match="set gpu_share"):
        AppConfig(model="tiny", resident=True)
    with pytest.raises(ValueError, match="resident: true needs gpu_share_budget_gib"):
        AppConfig(model="tiny", gpu_share="s", resident=True)
