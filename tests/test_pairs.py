"""Features meet in pairs (issue 36): every pair of a group-level setting and a request-level choice
runs and equals its reference, or is refused before any rank runs by the one table of refusals
(``ray_hsdp.config.pairs``).

Cheaply: one group per group-level shape, each with several group-level settings on at once, runs
many requests together, each with its own mix of request-level choices, built from the bodies a
client sends (so adapter defaults apply) and compared at the float level with the unsharded
diffusers pipeline given the same choices (the adaptive shape: lanes of one and two ranks side by
side). Every shape serves the tiny two-expert image-to-video
model (Wan2.2-I2V-A14B's architecture), so every request also brings its conditioning image and
can set guidance_scale_2. ``test_every_pair_is_run_or_refused`` then accounts for every cell."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import max_abs_diff, pipeline_with_adapters, reference_with

from bench.pairs import CPU_SHAPES, GROUP_SETTINGS, LORAS, REQUEST_CHOICES, app_config, pairs_doc, run_shape
from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.group import GroupConfig

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny two-expert image-to-video pipeline folder."""
    return str(make_tiny(tmp_path_factory.mktemp("models") / "wan22-i2v", two_experts=True, image_to_video=True))


@pytest.fixture(scope="module")
def runs(ray_cluster, model):
    """Each shape's group runs its mixes at once; returns shape -> [(mix, request, frames, None)]."""
    return {shape.name: run_shape(app_config(model, shape), shape) for shape in CPU_SHAPES}


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: s.name)
def test_each_mix_equals_the_unsharded_pipeline_with_the_same_choices(shape, runs, model):
    config = app_config(model, shape)
    pipe = pipeline_with_adapters(model, LORAS, config.fuse_loras)
    far = {}
    for mix, request, frames, _ in runs[shape.name]:
        tiled = request.width * request.height > 256 * 256  # several VAE tiles: the lane splits the tiled decode
        diff = max_abs_diff(frames, reference_with(pipe, request, tiled=tiled))
        if diff > TOLERANCE:
            far[mix.name] = diff
    assert not far, far
    # The adapter defaults reached the request (else "defaults" would equal a plain run).
    defaults = [request for mix, request, _, _ in runs[shape.name] if mix.name == "defaults"]
    for request in defaults:
        assert (request.num_inference_steps, request.flow_shift) == (3, 3.0)


ROOT = Path(__file__).resolve().parents[1]
#: The GPU run of the shapes a CPU cannot run (``python -m bench.pairs``: ring lanes, FP8, compile),
#: committed: the pairs each of whose requests equalled itself run alone on the same group.
GPU_RESULTS = ROOT / "bench" / "results" / "pairs-2xNVIDIA-H200.json"
TAKEOVER = "tests/serve/test_autoscaling.py::test_a_job_queued_behind_a_long_one_moves_to_the_group_that_frees_first"
GROUPS = "several groups (autoscaling, takeover)"
#: Pairs other tests run: cell -> the test.
ELSEWHERE: dict[tuple[str, str], str] = {
    # A job moves whole: every choice but the timeout (a video job has none of its own).
    **{(GROUPS, choice): TAKEOVER for choice in REQUEST_CHOICES if choice != "timeout"},
    # One queue deadline from arrival, kept by a retry on another group of a request that never ran.
    (GROUPS, "timeout"): (
        "tests/test_group.py::test_a_queued_request_keeps_the_deadline_it_arrived_with, "
        "tests/test_faults.py::test_killing_a_rank_answers_every_request_at_once"
    ),
}
#: Pairs the table refuses: cell -> a config holding the pair, and the start of its message.
REFUSED: dict[tuple[str, str], tuple[dict, str]] = {
    ("compile", "adapter"): (
        {"loras": LORAS, "compile": True},
        "switched loras (loras not in fuse_loras) with compile",
    ),
    ("fp8", "adapter"): (
        {"loras": LORAS, "quantization": "fp8", "device": "cuda"},
        "switched loras (loras not in fuse_loras) with quantization 'fp8'",
    ),
}
REFUSED[("compile", "several adapters")] = REFUSED[("compile", "adapter")]
REFUSED[("fp8", "several adapters")] = REFUSED[("fp8", "adapter")]


def test_every_pair_is_run_or_refused(runs):
    """Every cell of group-level settings x request-level choices ran above and equalled its
    reference, runs in another test or ran on a GPU, or is refused by the table with a message that
    names both. ``docs/pairs.md`` prints the matrix and the table (``RAY_HSDP_WRITE_DOCS=1`` writes
    it)."""
    where = {
        (setting, choice): "CPU"
        for shape in CPU_SHAPES
        for setting in shape.settings
        for mix, _, _, _ in runs[shape.name]
        for choice in mix.choices
    }
    for cell in json.loads(GPU_RESULTS.read_text())["pairs"]:
        where.setdefault(tuple(cell), "GPU")
    for cell, test in ELSEWHERE.items():
        where.setdefault(cell, "HTTP" if test == TAKEOVER else "CPU")
    for cell, (fields, message) in REFUSED.items():
        with pytest.raises(ValueError) as refused:
            GroupConfig(**fields)
        assert message in str(refused.value), (message, str(refused.value))
        where.setdefault(cell, "refused")
    missing = sorted({(s, c) for s in GROUP_SETTINGS for c in REQUEST_CHOICES} - set(where))
    assert not missing, f"{len(missing)} pairs neither run nor refused: {missing}"
    doc = ROOT / "docs" / "pairs.md"
    text = pairs_doc(where)
    if os.environ.get("RAY_HSDP_WRITE_DOCS"):
        doc.write_text(text)
    assert doc.read_text() == text, "docs/pairs.md is stale: run this test with RAY_HSDP_WRITE_DOCS=1"


#: Every pipeline class a shipped YAML or an embedded model serves (``pipeline_class`` included).
SERVED_PIPELINES = (
    "WanPipeline",
    "WanImageToVideoPipeline",
    "QwenImagePipeline",
    "Flux2Pipeline",
    "HunyuanVideo15Pipeline",
    "HunyuanVideo15ImageToVideoPipeline",
)


@pytest.mark.parametrize("pipeline", SERVED_PIPELINES)
def test_a_choice_the_request_gave_reaches_the_call_or_is_refused_naming_it(pipeline):
    """Never dropped: a request that gives its size or a negative prompt either gets it into its
    pipeline's call, or is refused per request (HTTP 400) by a row of the table that names it; the
    call itself refuses it too, where a request got past the table. HunyuanVideo-1.5's
    image-to-video takes no size (its output follows the image); FLUX.2 no negative prompt."""
    import inspect

    import diffusers

    from ray_hsdp.config.pairs import refuse_request
    from ray_hsdp.pipeline.args import call_kwargs, call_takes
    from ray_hsdp.request import GenerationRequest, InvalidRequestError
    from ray_hsdp.sharding.pipeline_call import pipeline_call_for
    from ray_hsdp.variant import RequestVariant

    cls = getattr(diffusers, pipeline)
    params = set(inspect.signature(cls.__call__).parameters)
    facts = call_takes(params)
    config = GroupConfig(model="tiny", device="cpu")
    requests = {
        "size": GenerationRequest(prompt="a fox", width=96, height=64, size_given=True),
        "negative_prompt": GenerationRequest(prompt="a fox", negative_prompt="blurry", size_given=False),
    }
    for choice, request in requests.items():
        call = pipeline_call_for(cls)
        if facts[choice]:
            refuse_request(config, facts, request)
            kwargs = call_kwargs(call, params, pipeline, RequestVariant(request))
            assert (kwargs["width"], kwargs["height"]) == (96, 64) if choice == "size" else kwargs[choice] == "blurry"
            continue
        with pytest.raises(InvalidRequestError, match=f"with a request's {choice}|\\bwith {choice}"):
            refuse_request(config, facts, request)
        with pytest.raises(InvalidRequestError, match=f"{pipeline} takes no {choice}"):
            call_kwargs(call, params, pipeline, RequestVariant(request))
    assert facts["size"] == (pipeline != "HunyuanVideo15ImageToVideoPipeline")
    assert facts["negative_prompt"] == (pipeline != "Flux2Pipeline")
    # Without a size of its own, a request runs at the size the pipeline picks (where it takes none).
    refuse_request(config, facts, GenerationRequest(prompt="a fox", size_given=False))
