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
