"""``compile_cache_dir``: what one start compiled, the next start's new processes find."""

from __future__ import annotations

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup


def test_a_second_start_finds_every_compiled_graph_in_the_compile_cache_dir(ray_cluster, tiny_model, tmp_path):
    """The first start of a compiled group (new processes, an empty folder) compiles its warm-up's
    graphs and writes them to the folder; a second start of the same configuration, in new
    processes, finds each of them there (inductor's FX graph cache: hits, no miss). Dynamo still
    traces (the same count of graphs), which is why the warm-up stays."""
    folder = tmp_path / "compile-cache"
    config = GroupConfig(model=tiny_model, device="cpu", shard_size=1, compile=True, compile_cache_dir=str(folder))
    with ShardGroup(config) as group:
        (first,) = group.tick_stats()
    with ShardGroup(config) as group:
        (second,) = group.tick_stats()
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_hit"] == 0, first
    assert (folder / "inductor").is_dir()
    assert second["fxgraph_cache_hit"] >= first["fxgraph_cache_miss"] and second["fxgraph_cache_miss"] == 0, second
    assert second["compiled_graphs"] == first["compiled_graphs"] > 0
