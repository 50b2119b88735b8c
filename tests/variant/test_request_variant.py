"""The request variant (``ray_hsdp.variant``): every per-request choice read and checked once where
a request reaches its group, a 400 naming the field, nothing carried for what a request does not
ask, and what each choice does on a rank (no Ray: the ranks' side runs in the group tests)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
from support import random_png

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.request import GenerationRequest, InvalidRequestError, StepCache
from ray_hsdp.variant import NO_REQUEST, RankFeatures, RequestVariant
from ray_hsdp.variant.lane import UnsplittableRequestError

CONFIG = GroupConfig(
    model="tiny", loras={"style": "tiny-style", "detail": "tiny-detail"}, max_loras_per_request=1,
    cache={"kind": "first_block"},
)  # fmt: skip
#: A one-expert text-to-video pipeline whose scheduler takes a shift, its tokens split over 2 ranks.
FACTS = {
    "image_input": False,
    "guidance_scale_2": False,
    "flow_shift": "shift",
    "sequence": {"degree": 2, "temporal_stride": 4, "spatial_stride": 16, "temporal_patch": 1},
}
PLAIN = GenerationRequest(prompt="a cat", width=64, height=32, request_id="r")


def test_a_request_that_asks_for_nothing_carries_nothing():
    variant = RequestVariant.build(PLAIN, CONFIG, FACTS)
    assert variant.choices == {} and variant.batch_key == () and variant.pipeline_kwargs() == {}
    assert variant.request is PLAIN and variant.ticket == -1 and variant.with_ticket(7).ticket == 7


def test_each_choice_is_carried_and_only_those_that_change_a_forward_split_batches():
    request = dataclasses.replace(PLAIN, lora=(("style", 0.5),), flow_shift=3.0, cache=StepCache("first_block"))
    variant = RequestVariant.build(request, CONFIG, FACTS).with_ticket(11)
    assert variant.choices == {"lora": (("style", 0.5),), "flow_shift": 3.0, "cache": StepCache("first_block")}
    # The adapters and a step cache of its own (keyed by its ticket) change its forwards; the shift does not.
    assert variant.batch_key == (("lora", (("style", 0.5),)), ("cache", 11))
    shifted_only = RequestVariant.build(dataclasses.replace(PLAIN, flow_shift=3.0), CONFIG, FACTS)
    assert shifted_only.batch_key == RequestVariant.build(PLAIN, CONFIG, FACTS).batch_key == ()


@pytest.mark.parametrize(
    ("change", "facts", "error", "message"),
    [
        ({"lora": (("style", 1.0), ("detail", 1.0))}, {}, InvalidRequestError, "2 adapters in one request; max_loras"),
        ({"lora": (("sepia", 1.0),)}, {}, InvalidRequestError, "unknown lora 'sepia'; this deployment's adapters"),
        ({"guidance_scale_2": 3.0}, {}, InvalidRequestError, "a one-expert model with guidance_scale_2"),
        ({"image": b"png"}, {}, InvalidRequestError, "with a conditioning image"),
        ({}, {"image_input": True}, InvalidRequestError, "makes a video from an image: send the first frame"),
        ({"flow_shift": 2.0}, {"flow_shift": None}, InvalidRequestError, "flow_shift: the scheduler would ignore it"),
        ({"cache": StepCache("taylorseer")}, {}, InvalidRequestError, "a request's step cache of another kind"),
        ({"width": 48, "height": 48}, {}, UnsplittableRequestError, "9 tokens, which do not split over"),
    ],
)
def test_a_choice_the_group_cannot_run_is_refused_naming_it(change, facts, error, message):
    with pytest.raises(error, match=message):
        RequestVariant.build(dataclasses.replace(PLAIN, **change), CONFIG, {**FACTS, **facts})


def test_the_pipeline_gets_the_second_expert_s_guidance_and_the_first_frame():
    facts = {**FACTS, "image_input": True, "guidance_scale_2": True}
    request = dataclasses.replace(PLAIN, guidance_scale_2=2.5, image=random_png(64, 32, 0))
    kwargs = RequestVariant.build(request, CONFIG, facts).pipeline_kwargs()
    assert kwargs["guidance_scale_2"] == 2.5 and kwargs["image"].size == (64, 32)


class Scheduler:
    def __init__(self, **config):
        self.config = config

    @classmethod
    def from_config(cls, config, **overrides):
        return cls(**{**config, **overrides})


class Pipe:
    scheduler = Scheduler(shift=1.0)


def test_a_shift_runs_on_a_scheduler_of_its_own_and_the_slot_gets_its_own_back():
    pipe, own = Pipe(), Pipe.scheduler
    variant = RequestVariant.unchecked(dataclasses.replace(PLAIN, flow_shift=5.0))
    with variant.run(pipe, RankFeatures()):
        assert pipe.scheduler.config == {"shift": 5.0}
    assert pipe.scheduler is own


class Adapters:
    """Records what the variant selects (the rank's ``Adapters``)."""

    def __init__(self):
        self.selected = []

    def adapts(self, module) -> bool:
        return True

    def select(self, selection) -> None:
        self.selected.append(selection)


class StepCaches:
    """Records what the variant asks of the rank's step caches."""

    def __init__(self):
        self.calls = []

    @contextmanager
    def forward(self, module, key, settings, context, sequence_groups=None):
        self.calls.append(("forward", key, settings, context))
        yield

    def release(self, key) -> int:
        self.calls.append(("release", key))
        return 3


def test_around_each_forward_every_feature_is_set_even_for_a_request_that_asks_nothing():
    """A module serves several requests: a forward of a plain request must turn the previous
    request's adapters off and run without its cache."""
    adapters, caches = Adapters(), StepCaches()
    features = RankFeatures(adapters, adapters_per_forward=True, step_caches=caches)
    cached = RequestVariant.unchecked(dataclasses.replace(PLAIN, lora=(("style", 1.0),), cache=StepCache("x")), 4)
    for variant in (cached, RequestVariant.unchecked(PLAIN, 5), NO_REQUEST):
        with variant.forward("module", ("cond", {}), features):
            pass
    assert adapters.selected == [(("style", 1.0),), (), ()]
    assert [call[1:3] for call in caches.calls] == [(4, StepCache("x")), (5, None), (-1, None)]
    assert cached.release(features) == {"cached_forwards": 3}
    assert RequestVariant.unchecked(PLAIN, 5).release(features) == {"cached_forwards": None}


def test_an_unsharded_rank_selects_the_adapters_once_per_request():
    adapters = Adapters()
    features = RankFeatures(adapters, adapters_per_forward=False)
    variant = RequestVariant.unchecked(dataclasses.replace(PLAIN, lora=(("detail", 0.5),)))
    with variant.run(Pipe(), features):
        with variant.forward("module", None, features):
            pass
    assert adapters.selected == [(("detail", 0.5),)]


def test_a_size_that_no_adaptive_lane_splits_is_refused_rather_than_left_waiting():
    adaptive = GroupConfig(model="tiny", shard_size=4, lane_sizes=(2, 4))
    with pytest.raises(UnsplittableRequestError, match="split evenly over none of this group's lanes"):
        RequestVariant.build(dataclasses.replace(PLAIN, width=48, height=48), adaptive, FACTS)
    assert RequestVariant.build(PLAIN, adaptive, FACTS).lane_sizes == (2, 4)  # 8 tokens
