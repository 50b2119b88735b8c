"""One rank's pipeline: a request stopped by its step callback never decodes; a request's own
scheduler shift."""

from pathlib import Path

import pytest

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline, steps_reaching_every_expert
from ray_hsdp.request import GenerationRequest, RequestCancelledError
from ray_hsdp.variant import RequestVariant


def one_rank(tiny_model) -> ShardedPipeline:
    """The tiny pipeline as a group of one rank loads it (nothing sharded)."""
    return ShardedPipeline.load(
        Path(tiny_model),
        LoadOptions(
            dtype="float32",
            device="cpu",
            rank=0,
            mesh=None,
            shard_components=("transformer",),
            min_num_params=10**9,
            reshard_after_forward=True,
            forward_prefetch=1,
        ),
    )


def test_a_stopped_request_raises_at_its_step_and_skips_the_decode(tiny_model):
    pipeline = one_rank(tiny_model)
    vae = pipeline.pipe.vae
    decodes = []
    decode = vae.decode
    vae.decode = lambda *args, **kwargs: decodes.append(1) or decode(*args, **kwargs)
    request = GenerationRequest(prompt="stop me", num_inference_steps=10, num_frames=5, request_id="r")
    steps = []
    with pytest.raises(RequestCancelledError, match="stopped after step 3 of 10, not decoded"):
        pipeline.run(RequestVariant.unchecked(request), on_step=lambda done, total: steps.append(done) or done == 3)
    assert steps == [1, 2, 3] and decodes == []
    result = pipeline.run(RequestVariant.unchecked(request), on_step=lambda done, total: False)
    assert decodes == [1] and result.frames.shape == (1, 5, 64, 64, 3)
    assert pipeline.facts == {
        "video": True,
        "temporal_compression": 4,
        "sequence": None,
        "cfg_split": [],
        "guidance_scale_2": False,  # one expert
        "image_input": False,  # text to video
        "image_reference": False,
        "negative_prompt": True,
        "size": True,  # its call takes height and width
        "lora": True,  # diffusers' Wan LoRA loader
        "flow_shift": "shift",  # the tiny model's flow-match Euler scheduler
        "euler": True,  # which takes a request's sigmas
        "min_steps": 1,
        "warm_up_steps": 1,  # one denoiser: a 1-step warm-up reaches it
    }


def test_a_request_s_flow_shift_sets_its_timesteps_and_no_other_s(tiny_model):
    """The transformer sees the timesteps of the scheduler shifted as the request asks (what a
    diffusers user gets with ``from_config(..., shift=...)``); the next request, the pipeline's."""
    pipeline = one_rank(tiny_model)
    seen = []
    pipeline.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(float(kwargs["timestep"].flatten()[0])), with_kwargs=True
    )
    own = pipeline.pipe.scheduler

    def timesteps(shift):
        scheduler = type(own).from_config(own.config, shift=shift) if shift else type(own).from_config(own.config)
        scheduler.set_timesteps(3)
        return [float(t) for t in scheduler.timesteps]

    for shift in (2.0, None):
        seen.clear()
        request = GenerationRequest(prompt="shift", num_inference_steps=3, guidance_scale=1.0, flow_shift=shift)
        pipeline.run(RequestVariant.unchecked(request))
        assert seen == pytest.approx(timesteps(shift)), shift
        assert pipeline.pipe.scheduler is own
    assert timesteps(2.0) != pytest.approx(timesteps(None))


def test_a_scheduler_whose_shift_is_dynamic_takes_no_flow_shift():
    """Issue 37: FLUX.1's scheduler follows the image size (use_dynamic_shifting) and ignores a
    static shift, so shifts 3 and 1.5 gave the same sigmas while the response said the shift ran.
    Its pipeline now says it takes none, and the table of refusals turns such a request away."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.config.pairs import refuse_request
    from ray_hsdp.request import InvalidRequestError
    from ray_hsdp.variant.shift import shift_key

    dynamic = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    assert shift_key(dynamic) is None
    assert shift_key(FlowMatchEulerDiscreteScheduler(shift=3.0)) == "shift"
    assert shift_key(UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0)) == "flow_shift"
    request = GenerationRequest(prompt="a fox", flow_shift=1.5)
    with pytest.raises(InvalidRequestError, match=r"without a static shift .* with flow_shift: the scheduler would"):
        refuse_request(GroupConfig(), {"flow_shift": shift_key(dynamic)}, request)


def test_frames_that_are_not_finite_fail_the_request_as_the_model_s_fault(tiny_model):
    """A numeric fault of the model (here a NaN weight, as a kernel that breaks on a model gives)
    fails the request with a server error naming it, instead of answering frames of noise."""
    import torch

    from ray_hsdp.request import NonFiniteOutputError

    pipeline = one_rank(tiny_model)
    request = GenerationRequest(prompt="a fox", num_inference_steps=2, num_frames=5, request_id="nan")
    assert pipeline.run(RequestVariant.unchecked(request)).frames.shape == (1, 5, 64, 64, 3)
    with torch.no_grad():
        pipeline.pipe.transformer.proj_out.bias[0] = float("nan")
    with pytest.raises(NonFiniteOutputError, match=r"request 'nan': the model made \d+ NaN or infinite values"):
        pipeline.run(RequestVariant.unchecked(request))


def test_a_channels_last_vae_decodes_the_same_frames(tiny_model):
    """``vae_channels_last`` moves the VAE's Conv3d weights to NDHWC memory, a layout for cuDNN's
    channels-last kernels: the same convolutions in another summation order, so on CPU the frames
    agree to float rounding."""
    import numpy as np
    import torch

    pipeline = one_rank(tiny_model)
    request = GenerationRequest(prompt="a fox", num_inference_steps=2, num_frames=5, request_id="cl")
    before = pipeline.run(RequestVariant.unchecked(request)).frames
    assert pipeline.vae_channels_last() > 0
    convs = [m for m in pipeline.pipe.vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last_3d) for c in convs)
    np.testing.assert_allclose(pipeline.run(RequestVariant.unchecked(request)).frames, before, atol=1e-5)


def test_a_warm_up_of_the_steps_reaching_every_expert_runs_both_experts_and_one_step_fewer_does_not(tmp_path):
    """A two-expert pipeline (Wan2.2's boundary) switches experts within a request: the warm-up's
    steps are the fewest whose timesteps fall on both sides of the boundary, so the group's
    compile warm-up runs the second expert's first forwards before a user's request does."""
    pipe = load_pipeline(make_tiny(tmp_path / "wan22", two_experts=True), "float32")
    pipe.set_progress_bar_config(disable=True)
    ran = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda module, args, name=name: ran.append(name))

    def experts_run(steps: int) -> set[str]:
        ran.clear()
        pipe(prompt="warm up", num_inference_steps=steps, width=32, height=32, num_frames=1, output_type="latent")
        return set(ran)

    steps = steps_reaching_every_expert(pipe)
    assert steps > 1  # one step runs the high-noise expert alone
    assert experts_run(steps) == {"transformer", "transformer_2"}
    assert experts_run(steps - 1) == {"transformer"}
