"""A rank: the Ray actor on one GPU (``actor.Rank``), its start (``start.RankStart``: rendezvous, load,
rejoin after a mend), its sleep (``sleep.RankSleep``), its reports, its offers' waits and its profiler.
Below the group: may import the pipeline, runtime, variant, loading, sharding, config and the shared
modules; not the group, serve or cli."""
