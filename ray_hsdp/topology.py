"""The R x S arithmetic of a pool: placement-group bundles and the mesh shape of one group."""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class ParallelDims:
    """Replicate x shard sizes of a pool and what follows from them.

    Attributes:
        replicate_size: Number of shard groups (R).
        shard_size: Ranks per shard group (S).
    """

    replicate_size: int
    shard_size: int

    def __post_init__(self) -> None:
        if self.replicate_size < 1 or self.shard_size < 1:
            raise ValueError(
                f"replicate_size and shard_size must be >= 1, got {self.replicate_size} x {self.shard_size}"
            )

    @property
    def world_size(self) -> int:
        """All ranks of the pool."""
        return self.replicate_size * self.shard_size

    @property
    def group_mesh_shape(self) -> tuple[int, int]:
        """Mesh shape of one group: groups never talk to each other at run time, so replicate is 1 inside it."""
        return (1, self.shard_size)

    def bundles(self, device: str, cpus_per_rank: float) -> list[dict[str, float]]:
        """Placement-group bundles of one group: one per rank, a GPU each on cuda hosts.

        Args:
            device: ``"cuda"`` or ``"cpu"``.
            cpus_per_rank: CPUs reserved per rank.
        """
        if device == "cuda":
            bundle = {"GPU": 1.0, "CPU": float(cpus_per_rank)}
        else:
            # A CPU rank needs at least one CPU slot in its bundle, else nothing pins it.
            bundle = {"CPU": float(max(cpus_per_rank, 1.0))}
        return [dict(bundle) for _ in range(self.shard_size)]


#: A shard group never spans nodes: its all-gathers run every layer and need the fast local links.
PLACEMENT_STRATEGY = "STRICT_PACK"
