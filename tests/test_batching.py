"""Batched forwards: which calls may share one, and that their split results equal separate runs."""

from pathlib import Path

import pytest
import torch
from support import max_abs_diff, reference_frames

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import load_pipeline
from ray_hsdp.request import GenerationRequest
from ray_hsdp.runtime.batching import compatible, concatenate, split


def wan_call(batch=1, frames=2, seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(
        hidden_states=torch.randn(batch, 16, frames, 8, 8, generator=g),
        timestep=torch.full((batch,), 500),
        encoder_hidden_states=torch.randn(batch, 12, 32, generator=g),
        attention_kwargs=None,
        return_dict=False,
    )
    return (), {**kwargs, **extra}


def test_which_calls_batch():
    assert compatible(wan_call(seed=0), wan_call(seed=1))
    assert compatible(wan_call(batch=2), wan_call(batch=1))  # n=2 and n=1 requests
    assert not compatible(wan_call(frames=2), wan_call(frames=3))  # other shape
    assert not compatible(wan_call(), wan_call(return_dict=True))  # other option
    assert not compatible(wan_call(), wan_call(attention_kwargs={"scale": torch.ones(1)}))  # tensor in a container
    ids = torch.zeros(64, 3)  # a tensor without a batch dimension (Flux's image ids)
    assert not compatible(wan_call(img_ids=ids), wan_call(img_ids=ids))
    assert not compatible(((torch.ones(1, 4),), {}), ((torch.ones(1, 4), 1), {}))


def test_split_results_equal_separate_forwards(tiny_model):
    pipe = load_pipeline(Path(tiny_model), "float32")
    calls = [wan_call(batch=1, seed=0), wan_call(batch=2, seed=1)]
    args, kwargs, sizes = concatenate(calls)
    assert sizes == [1, 2] and kwargs["hidden_states"].shape[0] == 3
    with torch.no_grad():
        together = split(pipe.transformer(*args, **kwargs), sizes)
        for call, part in zip(calls, together):
            alone = pipe.transformer(*call[0], **call[1])
            assert isinstance(part, tuple) and max_abs_diff(part[0].numpy(), alone[0].numpy()) <= 1e-5
        output = pipe.transformer(*args, **{**kwargs, "return_dict": True})
    parts = split(output, sizes)
    assert type(parts[0]) is type(output) and [p.sample.shape[0] for p in parts] == [1, 2]
    with pytest.raises(ValueError, match="cannot split"):
        split(torch.zeros(5, 2), [1, 2])


def test_a_group_batches_same_shape_requests_and_matches_unsharded(ray_cluster, tiny_model, reference_pipe):
    requests = [GenerationRequest(prompt=f"a fox {i}", seed=i, num_inference_steps=3, num_frames=5) for i in range(4)]
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=2, max_forward_batch=2)
    with ShardGroup(config) as group:
        futures = [group.submit(r) for r in requests]
        results = [f.result(timeout=240) for f in futures]
        stats = group.tick_stats()
    for request, result in zip(requests, results):
        # A batched forward sums in another order; the tiny VAE keeps the latents' variation, and
        # with it differences of a few 1e-6 (the images of two inputs differ by 1e-2 and more).
        assert max_abs_diff(result.frames, reference_frames(reference_pipe, request)) <= 3e-5
    assert sum(s["batched"] for s in stats) > 0, stats
