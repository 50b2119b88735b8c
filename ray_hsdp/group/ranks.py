"""A group's rank actors (``RankActors``): its placement group, each rank's actor placed in its
bundle under a name of its own, their rendezvous and load at the start, the ``watch`` call that
tells the scheduler of a rank's death, and their end; ``check_placeable``, which refuses a group no
node can hold before Ray waits for one."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_hsdp.config.topology import PLACEMENT_STRATEGY
from ray_hsdp.group.errors import GroupFailedError, GroupUnplaceableError
from ray_hsdp.group.state import GroupState
from ray_hsdp.rank.actor import CONCURRENCY_GROUPS, Rank

logger = logging.getLogger("ray_hsdp")

#: The share of its bundle's GPU a rank of a GPU share asks Ray for: any number of models' ranks fit
#: on one GPU, and Ray still gives each the bundle's GPU (its CUDA_VISIBLE_DEVICES).
SHARED_GPU = 0.01


def check_placeable(bundles: list[dict[str, float]]) -> None:
    """Fails at once when no alive node of the cluster has the resources of all of a group's
    bundles together, instead of leaving Ray to wait for a node that will never come.

    Raises:
        GroupUnplaceableError: With what a group needs, what the largest node has, and the fix.
    """
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if any(all(node.get(name, 0.0) >= amount for name, amount in need.items()) for node in nodes):
        return
    largest = max(nodes, key=lambda node: tuple(node.get(name, 0.0) for name in need), default={})
    have = ", ".join(f"{name}: {largest.get(name, 0.0):g}" for name in need)
    fixes = []
    if "GPU" in need and largest.get("GPU", 0.0) < need["GPU"]:
        fixes.append(f"a smaller shard_size (at most {int(largest.get('GPU', 0.0))})")
    elif largest.get("CPU", 0.0) < need.get("CPU", 0.0):
        fits = int(100 * largest.get("CPU", 0.0) / len(bundles)) / 100
        fixes.append(f"cpus_per_rank: {fits:g}" if fits > 0 else "a smaller shard_size")
    raise GroupUnplaceableError(
        f"a shard group needs {len(bundles)} x {bundles[0]} on one node; the largest node has {{{have}}} "
        f"(cluster: {ray.cluster_resources()}); set {' or '.join(fixes) or 'smaller bundles'}, or add a node "
        "that large"
    )


def kill_ranks(state: GroupState) -> None:
    """Kills every rank of the group at once (they leave ``state.ranks``)."""
    ranks, state.ranks = state.ranks, []
    for rank in ranks:
        ray.kill(rank, no_restart=True)


class RankActors:
    """The actors of a group's ranks, in its placement group.

    Args:
        state: The group's state, whose ``ranks`` and ``placement`` this fills.
        placement_group: A placement group of S bundles to place the ranks in; when ``None`` one is
            created at the start and removed at the end.
        shares_gpus: The placement group is a GPU share's, whose GPUs other models' groups use too:
            each rank takes a sliver of its bundle's GPU and none of its CPUs.
    """

    def __init__(self, state: GroupState, placement_group: PlacementGroup | None, shares_gpus: bool):
        self.state = state
        self.placement_group = placement_group
        self.owns_placement_group = placement_group is None
        self.shares_gpus = shares_gpus

    def start(self) -> None:
        """Places the ranks, forms their process group, loads and shards the pipeline; the loaded
        pipeline's facts and each rank's start phases go into the state."""
        state, config = self.state, self.state.config
        bundles = state.dims.bundles(config.device, config.cpus_per_rank)
        with state.phases.phase("placement"):
            if self.placement_group is None:
                check_placeable(bundles)
                self.placement_group = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
            if not self.placement_group.wait(timeout_seconds=config.rendezvous_timeout_s):
                raise GroupFailedError(
                    f"could not place {state.dims.shard_size} ranks of {bundles[0]} on one node within "
                    f"{config.rendezvous_timeout_s:.0f}s (cluster resources: {ray.available_resources()})"
                )
        self._spawn_and_join()
        with state.phases.phase("load"):
            reports = ray.get([r.load.remote() for r in state.ranks], timeout=config.load_timeout_s)
        state.pipeline_facts = reports[0]["pipeline"]
        state.mend_refusal = reports[0]["mend_refusal"]
        if self.shares_gpus:
            # Its other ranks may be asleep when one is lost: the group is rebuilt whole.
            state.mend_refusal = state.mend_refusal or "the group is on a GPU share (its ranks may sleep)"
        state.rank_phases = [r["start_phases_s"] for r in reports]

    def spawn(self, index: int, spawned_at: float):
        """Rank ``index``'s actor in bundle ``index`` of the group's placement group."""
        config = self.state.config
        bundle = self.state.dims.bundles(config.device, config.cpus_per_rank)[index]
        if self.shares_gpus:
            bundle = {"CPU": 0, "GPU": SHARED_GPU if "GPU" in bundle else 0}
        return (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Rank)
            .options(
                name=self.name(index),
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=index
                ),
            )
            .remote(index, config, self.state.dims, self.state.group_id, spawned_at)
        )

    def name(self, index: int) -> str:
        """Rank ``index``'s actor name (``ray list actors`` tells the ranks of each group apart by
        it); a replacement's has its mend's number, as Ray may not have freed the lost one's yet."""
        state = self.state
        return f"ray_hsdp-{state.group_id}-rank{index}" + (f"-mend{len(state.mends) + 1}" if state.mending else "")

    def watch(self, index: int) -> None:
        """Keeps rank ``index``'s ``watch`` call open: Ray tells the scheduler at once of its death."""
        watch = self.state.ranks[index].watch.remote()
        self.state.watchers[watch] = index
        self.state.watch("rank", watch)

    def _spawn_and_join(self) -> None:
        state, config = self.state, self.state.config
        names = [self.name(i) for i in range(state.dims.shard_size)]
        with state.phases.phase("rank processes and imports"):
            spawned_at = time.time()  # each rank's "actor start" counts from it
            state.ranks = [self.spawn(i, spawned_at) for i in range(state.dims.shard_size)]
            ray.get([r.prepare.remote() for r in state.ranks], timeout=config.load_timeout_s)
        # Rank 0 binds its rendezvous store first and hands out the port it holds: no port race.
        master, port = ray.get(state.ranks[0].address.remote(), timeout=config.rendezvous_timeout_s)
        with state.phases.phase("rendezvous"):
            joined = ray.get([r.join.remote(master, port) for r in state.ranks], timeout=config.rendezvous_timeout_s)
        state.placement = [
            {**place, "actor_name": name, "bundle": i} for i, (place, name) in enumerate(zip(joined, names))
        ]

    def close(self) -> None:
        """The ranks leave their process group (a healthy group's) and are killed; an owned
        placement group is removed."""
        if self.state.ranks:
            if self.state.failure is None:
                try:
                    ray.get([r.leave.remote() for r in self.state.ranks], timeout=30)
                except Exception as err:  # noqa: BLE001 - a dead rank cannot leave; it is killed below anyway
                    logger.warning("Ranks did not leave cleanly: %s", err)
            kill_ranks(self.state)
        if self.placement_group is not None and self.owns_placement_group:
            remove_placement_group(self.placement_group)
            self.placement_group = None
