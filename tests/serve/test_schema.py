"""What a request becomes on arrival, and how an error is answered: no server needed (issue 37)."""

from __future__ import annotations

import time

import pytest

from ray_hsdp.config.app import AppConfig
from ray_hsdp.group import GroupFailedError, QueueTimeoutError
from ray_hsdp.request import InvalidRequestError, RequestCancelledError
from ray_hsdp.serve.errors import RequestLimitError, error_response, job_error_code
from ray_hsdp.serve.schema import ImageGenerationRequest, to_generation_request
from ray_hsdp.variant.lane import UnsplittableRequestError

CONFIG = AppConfig(
    model="tiny",
    loras={"turbo": "tiny-style"},
    lora_defaults={"turbo": {"guidance_scale": 1.0, "guidance_scale_2": 1.0, "num_inference_steps": 4}},
    queue_timeout_s=100,
)


def arrive(**body):
    return to_generation_request(ImageGenerationRequest(prompt="a fox", **body), CONFIG, "r")


def test_an_adapters_guidance_of_the_second_expert_yields_to_the_requests_guidance():
    """An omitted guidance_scale_2 follows guidance_scale: an adapter's default for it applies only
    where the request gives neither (it used to override a request's guidance_scale of 7)."""
    given = arrive(lora="turbo", guidance_scale=7)
    assert (given.guidance_scale, given.guidance_scale_2) == (7.0, None)
    assert arrive(lora="turbo").guidance_scale_2 == 1.0  # the adapter's pair of defaults
    assert arrive(lora="turbo", guidance_scale=7, guidance_scale_2=2).guidance_scale_2 == 2.0


def test_every_request_arrives_with_a_seed_and_a_deadline():
    """Every request is seeded (drawn when the client sends none), so every one is retried and handed
    over; its queue deadline counts from its arrival."""
    before = time.time()
    request = arrive()
    assert isinstance(request.seed, int)
    assert before + 100 <= request.queue_deadline <= time.time() + 100


@pytest.mark.parametrize(
    "error, status, code",
    [
        (RequestLimitError("size 8x8"), 400, "invalid_request"),
        (InvalidRequestError("guidance_scale_2 for one expert"), 400, "invalid_request"),
        (UnsplittableRequestError("tokens do not split"), 400, "invalid_request"),
        (GroupFailedError("rank 0 died"), 503, "group_failed"),
        (QueueTimeoutError("no rank took it"), 504, "timeout"),
        (TimeoutError("missed its deadline"), 504, "timeout"),
        (RequestCancelledError("deleted"), 409, "cancelled"),
        # A ValueError of diffusers, of the CFG split or of ours is not the client's fault.
        (ValueError("CFG parallel defers a forward's result"), 500, "internal_error"),
        (RuntimeError("boom"), 500, "internal_error"),
    ],
)
def test_an_error_is_blamed_on_the_client_only_for_what_the_client_sent(error, status, code):
    response = error_response(error, retry_after_s=2)
    assert response.status_code == status
    assert str(error) in response.body.decode()
    assert job_error_code(error) == code


def test_a_request_s_lane_size_and_target_arrive_with_it():
    """Adaptive lanes' fields (issue 39): the lane a request asks for, and its target from arrival."""
    before = time.time()
    request = arrive(lane_size=2, deadline_s=30)
    assert request.lane_size == 2 and before + 30 <= request.deadline <= time.time() + 30
    assert arrive().deadline is None and arrive().lane_size is None
    with pytest.raises(ValueError, match="lane_size"):
        ImageGenerationRequest(prompt="a fox", lane_size=0)


def test_the_request_fields_page_is_what_the_bodies_declare():
    """docs/requests.md is what ``python -m ray_hsdp.serve.schema_docs`` writes from the two bodies."""
    from pathlib import Path

    from ray_hsdp.serve.schema_docs import markdown

    page = Path(__file__).resolve().parents[2] / "docs" / "requests.md"
    assert page.read_text() == markdown(), "docs/requests.md is stale: python -m ray_hsdp.serve.schema_docs > it"


def test_a_field_both_routes_take_is_declared_once_and_means_the_same_on_each():
    """The shared fields come from one declaration (``GenerationFields``): the same bounds and words on
    both routes; only the image route's JSON body refuses numbers as text."""
    from pydantic import ValidationError

    from ray_hsdp.serve.request_fields import GenerationFields
    from ray_hsdp.serve.schema import VideoCreateRequest

    for name, field in GenerationFields.model_fields.items():
        for model in (ImageGenerationRequest, VideoCreateRequest):
            assert model.model_fields[name].description == field.description, (model.__name__, name)
            assert model.model_fields[name].metadata == field.metadata, (model.__name__, name)
    video = VideoCreateRequest.model_validate({"prompt": "a fox", "flow_shift": "3", "true_cfg_scale": "4"})
    assert (video.flow_shift, video.generation_fields()["guidance_scale"]) == (3.0, 4.0)
    with pytest.raises(ValidationError, match="flow_shift"):
        ImageGenerationRequest.model_validate({"prompt": "a fox", "flow_shift": "3"})
    for model in (ImageGenerationRequest, VideoCreateRequest):
        with pytest.raises(ValidationError, match="greater than 0"):
            model.model_validate({"prompt": "a fox", "flow_shift": 0})


@pytest.mark.parametrize("field, value, read", [("cache", 1, True), ("cache", "true", True), ("cache", 0, False),
                                                ("lora", ("a", "b:0.5"), ["a", "b:0.5"])])  # fmt: skip
def test_the_strict_image_body_still_reads_a_cache_switch_and_adapter_names_as_it_did(field, value, read):
    """The image body is strict (numbers of their type), but not where it never was: a step cache's
    switch as 1 or "true", a Python caller's tuple of adapter names. The video body reads the same."""
    from ray_hsdp.serve.schema import VideoCreateRequest

    for model in (ImageGenerationRequest, VideoCreateRequest):
        assert getattr(model.model_validate({"prompt": "a fox", field: value}), field) == read, model.__name__
