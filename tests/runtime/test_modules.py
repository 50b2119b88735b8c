"""The real modules' seams that need a process group: a widened forward's inputs, broadcast from
one rank of the wider lane to the others (``runtime.modules.broadcast_inputs``), over gloo."""

from __future__ import annotations

import torch


def _inputs_of(rank: int):
    """What a rank holds before the broadcast: a forward's args, kwargs and cache context, each
    rank's different (only the source's may arrive)."""
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    kwargs = {
        "hidden_states": x.to(torch.bfloat16),
        "timestep": torch.tensor([rank], dtype=torch.int64),
        "attention_kwargs": None,
        "return_dict": False,
        "nested": [{"first_row": x[0]}, rank],
    }
    return (x.t(),), kwargs, ("cache", {"rank": rank})  # a transposed (non-contiguous) tensor


def _broadcast_from_rank_1(mesh, rank):
    import torch.distributed as dist

    from ray_hsdp.runtime.modules import broadcast_inputs

    return broadcast_inputs(_inputs_of(rank), dist.group.WORLD, 1, torch.device("cpu"))


def test_a_widened_forward_s_inputs_reach_every_rank_of_its_lane_from_the_source(ray_cluster):
    from gloo import GlooGroup

    with GlooGroup(3) as group:
        received = group.run(_broadcast_from_rank_1)
    (args, kwargs, cache) = _inputs_of(1)
    for got_args, got_kwargs, got_cache in received:
        assert torch.equal(got_args[0], args[0]) and got_args[0].is_contiguous()
        for name in ("hidden_states", "timestep"):
            assert got_kwargs[name].dtype == kwargs[name].dtype and torch.equal(got_kwargs[name], kwargs[name])
        assert (got_kwargs["attention_kwargs"], got_kwargs["return_dict"]) == (None, False)
        assert torch.equal(got_kwargs["nested"][0]["first_row"], kwargs["nested"][0]["first_row"])
        assert got_kwargs["nested"][1] == 1 and got_cache == ("cache", {"rank": 1})
