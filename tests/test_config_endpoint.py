"""An application of several models (``ray_hsdp.config.endpoint``): the endpoint's fields set once,
each model's in its block, each misplacement refused with where it belongs."""

from __future__ import annotations

import pytest

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.endpoint import ENDPOINT_FIELDS, EndpointConfig, served_models


def test_one_models_args_are_one_model_and_its_endpoint():
    served = served_models({"model": "tiny", "device": "cpu", "retry_after_s": 7})
    assert served.names == ["tiny-wan"] and served.endpoint.retry_after_s == 7


def test_the_endpoints_fields_reach_every_model_and_ids_default_to_the_folders_name():
    served = served_models(
        {
            "allow_unauthenticated": True,
            "max_video_jobs": 9,
            "models": [{"model": "tiny", "device": "cpu"}, {"model": "tiny-i2v", "device": "cpu", "model_name": "i2v"}],
        }
    )
    assert served.names == ["tiny-wan", "i2v"]
    assert all(m.allow_unauthenticated and m.max_video_jobs == 9 for m in served.models)
    assert served.endpoint.max_video_jobs == 9 and set(type(served.endpoint).model_fields) == set(ENDPOINT_FIELDS)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"models": [{"model": "tiny", "retry_after_s": 3}]}, "\\(tiny\\) sets retry_after_s, which belongs to the"),
        ({"shard_size": 2, "models": [{"model": "tiny"}]}, "shard_size belongs to a model, not to the endpoint"),
        ({"models": [{"model": "tiny"}, {"model": "tiny"}]}, "two models are named tiny-wan: give each its own"),
        ({"models": []}, "models must be a list of at least one model"),
        ({"models": [{"model": "tiny", "shard_size": 0}]}, "(?s)models\\[0\\] \\(tiny\\): .*shard_size must be"),
    ],
)
def test_a_field_in_the_wrong_place_is_refused_with_where_it_belongs(args, message):
    with pytest.raises(ValueError, match=message):
        served_models(args)


def test_a_lasting_job_store_needs_a_lasting_media_store():
    """Records that outlive the Ray cluster beside MP4s in its session folder would answer every
    download with an error after a restart: refused at build, naming both fields."""
    for build in (lambda **f: EndpointConfig(**f), lambda **f: AppConfig(model="tiny", **f)):
        with pytest.raises(ValueError, match="job_store is set .* media_store is not"):
            build(job_store="postgresql+psycopg://ray_hsdp@db/ray_hsdp")
        assert build(job_store="postgresql+psycopg://ray_hsdp@db/ray_hsdp", media_store="s3://bucket/videos")
        assert build(media_store="/shared/videos")  # lasting media beside the default records: no loss
