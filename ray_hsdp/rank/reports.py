"""What a rank reports of itself (``Rank.tick_stats``, ``Rank.memory``): functions of its load, its
configuration and its counters, and the ``torch.compile`` counts they include. Modules that import
torch are imported inside the functions (see ``ray_hsdp.rank.actor``)."""

from __future__ import annotations

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.rank.start import LoadedRank

#: How dynamo's counters name a function that reached the recompile limit.
RECOMPILE_LIMIT_REASON = "Dynamo recompile limit exceeded"


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` built in this process so far: a request of a new shape (or, with
    adaptive lanes, on a new lane size) adds some once; a count that grows with every request means
    recompiles. (dynamo keeps the count in its counters; torch has no public one.)"""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_report(modules: int) -> dict:
    """What ``torch.compile`` did in this process: the modules whose forward it compiles (each
    repeated block), the graphs dynamo built for them, and the graph breaks with their most common
    reasons. A block compiled without breaks is one graph per shape; every break splits it, with
    eager Python between the pieces. (dynamo keeps these in its counters; torch has no public ones.)"""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "modules": modules,
        "graphs": compiled_graphs(),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": dict(breaks.most_common(5)),
    }


def compile_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache in this process so far: graphs found in the cache (``hit``) and
    compiled anew (``miss``). (Inductor keeps them in dynamo's counters; torch has no public ones.)"""
    from torch._dynamo.utils import counters

    return {f"fxgraph_cache_{kind}": int(counters["inductor"][f"fxgraph_cache_{kind}"]) for kind in ("hit", "miss")}


def recompile_limit_hits() -> int:
    """Times a compiled function reached ``torch._dynamo.config.recompile_limit`` graphs in this
    process and so runs eagerly from then on, silently but for one warning (dynamo counts it with
    its "unimplemented" reasons; torch has no public count)."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith(RECOMPILE_LIMIT_REASON))


def tick_stats(rank: int, config: GroupConfig, loaded: LoadedRank | None, last_peak_bytes: int) -> dict[str, int]:
    """What a rank did since it loaded (ticks, idle ticks, real forwards, ghost passes, batched
    calls, forwards it ran as a helper of a widened lane), its device memory (allocated now, and
    ``last_peak_bytes``, the peak of its latest request), and with ``compile`` its graphs and the
    compile cache's hits and misses, and how often a compiled block reached its recompile limit."""
    from ray_hsdp.memory import device_allocated_bytes

    runtime = loaded.runtime if loaded is not None else None
    counts = ("ticks", "idle_ticks", "forwards", "ghosts", "batched", "helped")
    caches = loaded.pipeline.features.step_caches if loaded is not None else None
    return {
        "rank": rank,
        **{name: getattr(runtime, name) if runtime is not None else 0 for name in counts},
        # Forwards run with a request's step cache, and those that reused it.
        "step_cache_forwards": caches.forwards if caches is not None else 0,
        "step_cache_reused": caches.reused if caches is not None else 0,
        "device_allocated_bytes": device_allocated_bytes(config.device),
        "last_request_peak_device_bytes": last_peak_bytes,
        "compiled_graphs": compiled_graphs() if config.compile else 0,
        "recompile_limit_hits": recompile_limit_hits() if config.compile else 0,
        **(compile_cache_counts() if config.compile else {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 0}),
        # Exchanges of the split decodes this rank joined (rows lent, keys gathered).
        "decode_exchanges": sum(lane.exchanges for lane in loaded.pipeline.lane_tiles.values())
        if loaded is not None
        else 0,
    }


def memory_report(
    rank: int, config: GroupConfig, dims: ParallelDims, loaded: LoadedRank | None, extra: dict, units: bool = False
) -> dict:
    """A rank's memory report: where it runs, what its load cost, the device's memory now, the
    pipeline's (``ShardedPipeline.memory``, with each unit's bytes when ``units``), and ``extra``
    (its sleep's bytes, its latest request's peak) before the pipeline's."""
    from ray_hsdp.memory import device_allocated_bytes

    pipeline = loaded.pipeline if loaded is not None else None
    report = pipeline.memory(units=units) if pipeline is not None else {}
    return {
        "rank": rank,
        "shard_index": rank,
        "lane": dims.lane_of(rank),
        "device": config.device,
        "load_s": round(loaded.load_s if loaded is not None else 0.0, 3),
        "load_peak_rss_bytes": loaded.peak_rss_bytes if loaded is not None else 0,
        "load_bytes_read": sum(s["bytes_read"] for s in pipeline.load_stats.values()) if pipeline else 0,
        "device_allocated_bytes": device_allocated_bytes(config.device),
        **extra,
        **report,
        **({"compile": compile_report(pipeline.compiled_modules)} if config.compile and pipeline else {}),
    }
