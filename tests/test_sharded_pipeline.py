"""One rank's pipeline: a request stopped by its step callback never decodes."""

from pathlib import Path

import pytest

from ray_hsdp.request import GenerationRequest, RequestCancelledError
from ray_hsdp.sharded_pipeline import ShardedPipeline


def test_a_stopped_request_raises_at_its_step_and_skips_the_decode(tiny_model):
    pipeline = ShardedPipeline.load(
        Path(tiny_model),
        dtype="float32",
        device="cpu",
        rank=0,
        mesh=None,
        shard_components=("transformer",),
        min_num_params=10**9,
        reshard_after_forward=True,
        forward_prefetch=1,
    )
    vae = pipeline.pipe.vae
    decodes = []
    decode = vae.decode
    vae.decode = lambda *args, **kwargs: decodes.append(1) or decode(*args, **kwargs)
    request = GenerationRequest(prompt="stop me", num_inference_steps=10, num_frames=5, request_id="r")
    steps = []
    with pytest.raises(RequestCancelledError, match="stopped after step 3 of 10, not decoded"):
        pipeline.run(request, on_step=lambda done, total: steps.append(done) or done == 3)
    assert steps == [1, 2, 3] and decodes == []
    result = pipeline.run(request, on_step=lambda done, total: False)
    assert decodes == [1] and result.frames.shape == (1, 5, 64, 64, 3)
    assert pipeline.facts == {
        "video": True,
        "temporal_compression": 4,
        "sequence": None,
        "cfg_split": [],
        "guidance_scale_2": False,  # one expert
        "image_input": False,  # text to video
    }
