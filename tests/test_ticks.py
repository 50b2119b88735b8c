"""The tick protocol: any mix of requests in one group, never a hang, every result equal to unsharded."""

import time
from pathlib import Path

import pytest
import torch
from gloo import GlooGroup
from support import max_abs_diff, reference_frames

from ray_hsdp.checkpoints.tiny import make_tiny
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.request import GenerationRequest
from ray_hsdp.variant import RequestVariant

DEADLINE_S = 240  # the whole mix; a hang fails the test instead of blocking the suite

MIX = [
    dict(prompt="a cat bakes a cake", num_inference_steps=2, guidance_scale=5.0, width=64, num_frames=1),
    dict(prompt="a red fox in the snow", num_inference_steps=5, guidance_scale=1.0, width=96, num_frames=5),
    dict(prompt="a small boat", num_inference_steps=3, guidance_scale=4.0, width=64, num_frames=5),
    dict(prompt="a robot paints", num_inference_steps=2, guidance_scale=1.0, width=96, num_frames=1),
    dict(prompt="waves on rocks", num_inference_steps=5, guidance_scale=6.0, width=96, num_frames=5, n=2),
    dict(prompt="an astronaut rides", num_inference_steps=3, guidance_scale=1.0, width=64, num_frames=1),
]


def submit_staggered(group, requests):
    futures = []
    for i, req in enumerate(requests):
        futures.append(group.submit(req))
        time.sleep(0.05 * (i % 3))  # arrivals while other ranks are mid-request
    return [f.result(timeout=DEADLINE_S) for f in futures]


def test_a_mixed_workload_never_hangs_and_matches_unsharded(ray_cluster, tiny_model, reference_pipe):
    # 3 ranks: uneven shards, and more ranks to fall out of step than 2 (which every other test runs).
    shard_size = 3
    requests = [GenerationRequest(seed=i, height=64, **fields) for i, fields in enumerate(MIX)]
    with ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=shard_size)) as group:
        results = submit_staggered(group, requests)
        stats = group.tick_stats()
    assert len({r.rank for r in results}) == shard_size  # work spread over every rank
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(reference_pipe, req)) <= 1e-5, req
    assert sum(s["ghosts"] for s in stats) > 0  # ranks ran ghost passes for each other


def test_two_experts_at_different_experts_in_one_tick(ray_cluster, tmp_path):
    folder = make_tiny(tmp_path / "wan22", two_experts=True)
    plain = load_pipeline(Path(folder), "float32")
    plain.set_progress_bar_config(disable=True)
    # boundary_ratio 0.5: the 2-step request switches experts long before the 8-step one does.
    requests = [
        GenerationRequest(prompt="a cat", seed=1, num_inference_steps=8, num_frames=5),
        GenerationRequest(prompt="a dog", seed=2, num_inference_steps=2, num_frames=5),
    ]
    # Half of each expert's blocks kept gathered: their results still equal unsharded ones.
    with ShardGroup(GroupConfig(model=str(folder), device="cpu", shard_size=2, keep_gathered=0.5)) as group:
        results = submit_staggered(group, requests)
        stats = group.tick_stats()
    for req, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(plain, req)) <= 1e-5
    assert sum(s["ghosts"] for s in stats) > 0


def in_place_params(model_dir, kept_blocks=()) -> int:
    """Parameters the tiny transformer gathers in place per forward: all but its scalars and
    those of the blocks kept gathered."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(Path(model_dir) / "transformer")
    kept = tuple(f"blocks.{i}." for i in kept_blocks)
    return sum(1 for name, p in model.named_parameters() if p.dim() > 0 and not name.startswith(kept))


def count_collectives(mesh, rank, model_dir, forward_prefetch, gather, keep_gathered=0.0):
    """Rank 0 runs a real transformer forward while rank 1 ghosts it; both record their collectives."""
    import torch.distributed as dist

    from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline
    from ray_hsdp.runtime import RankRuntime
    from ray_hsdp.runtime.modules import ProcessGroupExchange, ShardedModules

    pipe = ShardedPipeline.load(
        Path(model_dir),
        LoadOptions(
            dtype="float32",
            device="cpu",
            rank=rank,
            mesh=mesh,
            shard_components=("transformer", "text_encoder"),
            min_num_params=10**9,
            reshard_after_forward=True,
            forward_prefetch=forward_prefetch,
            keep_gathered=keep_gathered,
            gather=gather,
        ),
    )
    record = []
    originals = {
        name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
    }
    for name, original in originals.items():

        def counted(output, input, *args, _original=original, **kwargs):
            record.append((tuple(output.shape), output.dtype))
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counted)
    torch.manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 12, 32),
    )

    def run_request(request, on_step):  # what a pipeline does: call the (proxied) transformer, twice
        for step in range(2):
            pipe.pipe.transformer(**inputs)
            on_step(step + 1, 2)

    modules = ShardedModules(pipe.sharded_modules, "cpu", pipe.shardings)
    runtime = RankRuntime(run_request, rank=rank, modules=modules, exchange=ProcessGroupExchange("cpu"))
    pipe.route_calls(modules.proxies(runtime.call))
    try:
        if rank == 0:
            job = runtime.submit(RequestVariant.unchecked(GenerationRequest(prompt="two forwards", request_id="r")))
        runtime.session()
        if rank == 0:
            job.get()
    finally:
        for name, original in originals.items():  # the pair of processes serves the next case too
            setattr(dist, name, original)
    return record


@pytest.fixture(scope="module")
def gloo_pair(ray_cluster):
    with GlooGroup(2) as group:
        yield group


# FSDP2's implicit order and the default explicit one; in-place gathers with and without prefetch.
@pytest.mark.parametrize("gather, forward_prefetch", [("fsdp2", 0), ("fsdp2", 1), ("in_place", 0), ("in_place", 1)])
def test_a_ghost_pass_issues_exactly_the_collectives_of_the_real_forward(
    gloo_pair, tiny_model, gather, forward_prefetch
):
    real, ghost = gloo_pair.run(count_collectives, tiny_model, forward_prefetch, gather)
    units = 4 + 1  # the tiny transformer's blocks and its root
    gathers = [c for c in real if c[0] != (2,)]  # leave out the ticks' own all-gathers of two integers
    # Two forwards, each gathering every unit once: FSDP2 in one collective per unit, in-place
    # gathers in one per sharded parameter.
    per_forward = units if gather == "fsdp2" else in_place_params(tiny_model)
    assert len(gathers) == 2 * per_forward
    assert real == ghost  # the same collectives, ticks included, in the same order


@pytest.mark.parametrize("gather", ["fsdp2", "in_place"])
def test_units_kept_gathered_gather_nothing_in_a_forward_or_a_ghost_pass(gloo_pair, tiny_model, gather):
    real, ghost = gloo_pair.run(count_collectives, tiny_model, 1, gather, 0.5)
    gathers = [c for c in real if c[0] != (2,)]
    # Blocks 1 and 3 of the four were gathered once at the load; blocks 0 and 2 and the root still
    # gather for each of the two forwards.
    per_forward = 2 + 1 if gather == "fsdp2" else in_place_params(tiny_model, kept_blocks=(1, 3))
    assert len(gathers) == 2 * per_forward
    assert real == ghost
