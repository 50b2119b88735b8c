"""A rank: the Ray actor on one GPU (``actor.Rank``), its start (rendezvous, load, rejoin after a mend)
and its profiler. Below the group: may import the pipeline, runtime, variant, loading, sharding,
config and the shared modules; not the group, serve or cli."""
