"""Whole pipelines of other architectures through a shard group: Wan2.2 two experts, FLUX."""

from pathlib import Path

import pytest
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.random_weights import make_random
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.request import GenerationRequest

WAN22 = ("wan2.2-t2v-a14b", {"transformer", "transformer_2", "text_encoder"})
FLUX = ("flux.1-dev", {"transformer", "text_encoder", "text_encoder_2"})


# FSDP2 on FLUX: the policy test's parity; the whole pipeline once per gather.
# fsdp2 gathers (the CPU default) of two experts: every other two-expert test (test_ticks,
# test_lanes, test_loras); here both architectures gathered in place.
@pytest.mark.parametrize("arch, sharded, gather", [(*FLUX, "in_place"), (*WAN22, "in_place")])
def test_pipeline_sharded_over_two_ranks_equals_unsharded(ray_cluster, tmp_path, arch, sharded, gather):
    folder = Path(make_random(arch, tmp_path / arch, tiny=True, dtype="float32")["path"])
    requests = [
        GenerationRequest(prompt="a red fox", seed=1, num_inference_steps=4, guidance_scale=3.5),
        GenerationRequest(prompt="a blue boat", seed=2, num_inference_steps=4, guidance_scale=3.5),
    ]
    with ShardGroup(GroupConfig(model=str(folder), device="cpu", shard_size=2, gather=gather)) as group:
        results = group.generate(requests)
        ranks = group.memory()
    assert set(ranks[0]["sharded_components"]) == sharded
    for name in sharded:
        local = [r["components"][name]["sharded_local"] for r in ranks]
        assert sum(local) == ranks[0]["components"][name]["sharded_full"] > 0
    # In-place gathers hold their buffers (two units' and each root's); FSDP2 allocates per forward.
    assert (ranks[0]["total"]["gather_buffers"] > 0) == (gather == "in_place")
    plain = load_pipeline(folder, "float32")
    plain.set_progress_bar_config(disable=True)
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(plain, req)) <= 1e-5
