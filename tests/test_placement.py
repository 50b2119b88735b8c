"""Placement on Ray's simulated two-node cluster: a shard group never spans nodes."""

from support import NODE_CPUS, max_abs_diff, reference_frames

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest


def test_each_group_lands_on_one_node_and_groups_spread(ray_cluster, tiny_model, reference_pipe):
    # Two groups of 2 ranks of 1.5 CPUs each on two nodes of 4 CPUs: they cannot share a node, and
    # STRICT_PACK must keep each group whole on its own node instead of splitting a rank off.
    shard_size, cpus = 2, 1.5
    assert 2 * shard_size * cpus > NODE_CPUS
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=shard_size, replicate_size=2, cpus_per_rank=cpus)
    groups = [ShardGroup(config) for _ in range(2)]
    try:
        for group in groups:
            group.start()
        nodes = [{rank["node_id"] for rank in group.placement} for group in groups]
        assert all(len(n) == 1 for n in nodes), nodes
        assert nodes[0] != nodes[1]
        prompts = ["a cat", "a dog", "a fox"]
        requests = [GenerationRequest(prompt=p, seed=i, num_frames=1) for i, p in enumerate(prompts)]
        for req, result in zip(requests, groups[1].generate(requests)):
            assert max_abs_diff(result.frames, reference_frames(reference_pipe, req)) <= 1e-5
    finally:
        for group in groups:
            group.shutdown()
