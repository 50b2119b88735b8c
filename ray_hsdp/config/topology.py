"""The mesh arithmetic of a pool: R x S ranks, the lanes of a group, placement-group bundles.

``ParallelDims`` is built once, from the configuration, and passed down to the group and its
ranks; nothing below it recomputes sizes, lanes or mesh shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Dims of a group's lane mesh, outermost first. diffusers' ``ContextParallelConfig`` indexes the
#: dims named exactly ``ring`` and ``ulysses``.
LANE_MESH_DIM_NAMES = ("lane", "cfg", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """Replicate x shard sizes of a pool, the lanes of each group and what follows from them.

    A group of ``shard_size`` ranks holds one copy of the weights, FSDP-sharded over all of them.
    It is split into lanes: the ranks that run one request together. In ``batch`` mode a lane is
    ``cfg x ring x ulysses`` ranks (one rank when all are 1); in ``replicated`` mode the whole
    group is one lane whose ranks each compute the whole request.

    Attributes:
        replicate_size: Number of shard groups (R).
        shard_size: Ranks per shard group (S).
        cfg: 2 when the conditional and unconditional forwards of a step run on different ranks.
        ring: Ring-attention degree of a lane (sequence split, K/V passed around).
        ulysses: Ulysses degree of a lane (sequence split, heads exchanged by all-to-all).
        replicated: Every rank of the group runs every request (memory-only HSDP).
        lane_sizes: Adaptive lanes: the sizes of the lanes a request may be given (aligned blocks
            of ranks, each splitting its tokens by Ulysses); empty for fixed lanes. An adaptive
            group's fixed lanes are of one rank: its ``num_lanes`` are its ranks.
    """

    replicate_size: int
    shard_size: int
    cfg: int = 1
    ring: int = 1
    ulysses: int = 1
    replicated: bool = False
    lane_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.replicate_size < 1 or self.shard_size < 1:
            raise ValueError(
                f"replicate_size and shard_size must be >= 1, got {self.replicate_size} x {self.shard_size}"
            )
        if self.cfg not in (1, 2):
            raise ValueError(f"cfg_parallel splits a step in 2 (cond, uncond); got a cfg degree of {self.cfg}")
        if self.ring < 1 or self.ulysses < 1:
            raise ValueError(f"ring_degree and ulysses_degree must be >= 1, got {self.ring} and {self.ulysses}")
        if self.replicated and self.split_size > 1:
            raise ValueError(
                "mode 'replicated' runs the whole request on every rank; it cannot be combined with "
                "ulysses_degree, ring_degree or cfg_parallel (use mode 'batch')"
            )
        if self.lane_sizes and (self.ring > 1 or self.ulysses > 1 or self.replicated):
            raise ValueError(
                "lane_sizes gives each request its lane; it cannot be combined with ulysses_degree, ring_degree "
                "or mode 'replicated' (leave them at their defaults; cfg_parallel makes lanes of 2 or more CFG 2 x "
                "Ulysses)"
            )
        for size in self.lane_sizes:
            if size < 1 or self.shard_size % size:
                raise ValueError(f"lane_sizes: a lane of {size} ranks must divide shard_size={self.shard_size}")
            if self.cfg == 2 and size > 1 and size % 2:
                raise ValueError(f"lane_sizes with cfg_parallel: a lane of {size} ranks cannot hold 2 CFG halves")
        sizes = sorted(set(self.lane_sizes))
        for narrow, wide in zip(sizes, sizes[1:]):
            if wide % narrow:
                # A request's lane must lie inside every wider aligned lane: widening and the lanes'
                # blocks both assume that lanes nest.
                raise ValueError(
                    f"lane_sizes {sizes}: a lane of {narrow} ranks must divide a lane of {wide}, so that every lane "
                    "lies inside each wider one (e.g. [1, 2, 4] or [1, 3, 6])"
                )
        if self.shard_size % self.split_size:
            raise ValueError(
                f"a lane of cfg x ring x ulysses = {self.cfg} x {self.ring} x {self.ulysses} = {self.split_size} "
                f"ranks must divide shard_size={self.shard_size}"
            )

    @property
    def world_size(self) -> int:
        """All ranks of the pool."""
        return self.replicate_size * self.shard_size

    @property
    def split_size(self) -> int:
        """Ranks one request is split over: ``cfg x ring x ulysses``."""
        return self.cfg * self.ring * self.ulysses

    @property
    def sequence_degree(self) -> int:
        """Parts a request's token sequence is split into (``ring x ulysses``); 1 without context parallel."""
        return self.ring * self.ulysses

    @property
    def splits_sequence(self) -> bool:
        """Whether a lane of the group splits a request's token sequence (a fixed lane's ring or
        Ulysses degree, or an adaptive lane with Ulysses ranks)."""
        return self.sequence_degree > 1 or max((self.lane_shape(s)[1] for s in self.lane_sizes), default=1) > 1

    @property
    def lane_size(self) -> int:
        """Ranks of one fixed lane: the whole group when replicated, else ``cfg x ring x ulysses``;
        with adaptive lanes 1 (a request's own lane comes with it: ``lane_shape``)."""
        if self.adaptive:
            return 1
        return self.shard_size if self.replicated else self.split_size

    def lane_shape(self, size: int) -> tuple[int, int]:
        """``(cfg, ulysses)`` of an adaptive lane of ``size`` ranks: with ``cfg_parallel`` a lane of
        two or more is two CFG halves of ``size / 2`` Ulysses ranks each, else ``size`` Ulysses ranks."""
        cfg = 2 if self.cfg == 2 and size > 1 else 1
        return cfg, size // cfg

    @property
    def num_lanes(self) -> int:
        """Lanes of one group; each runs its own requests."""
        return self.shard_size // self.lane_size

    @property
    def widest_lanes(self) -> int:
        """Lanes of one group when each request runs on its widest lane: ``num_lanes`` for fixed
        lanes; with adaptive lanes ``shard_size / max(lane_sizes)`` (a lone request gets the widest;
        ``num_lanes`` counts lanes of one rank, which only a backlog gets)."""
        return self.shard_size // max(self.lane_sizes) if self.adaptive else self.num_lanes

    def lane_of(self, rank: int) -> int:
        """The lane of group rank ``rank`` (lanes are consecutive blocks of ranks)."""
        return rank // self.lane_size

    def lane_ranks(self, lane: int) -> range:
        """The group ranks of lane ``lane``; the first one leads it."""
        return range(lane * self.lane_size, (lane + 1) * self.lane_size)

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its lane's leader: its answer is the lane's, its decisions (deadlines,
        cancellations) the whole lane applies."""
        return rank % self.lane_size == 0

    def cfg_index(self, rank: int) -> int:
        """0 on the ranks that run a step's conditional forward, 1 on those that run the unconditional one."""
        return (rank % self.lane_size) // (self.ring * self.ulysses)

    @property
    def adaptive(self) -> bool:
        """Whether each request gets its lane when a lane takes it (``lane_sizes``)."""
        return bool(self.lane_sizes)

    def blocks(self, size: int) -> list[range]:
        """The lanes of ``size`` ranks an adaptive group may give: aligned blocks, leader first."""
        return [range(first, first + size) for first in range(0, self.shard_size, size)]

    @property
    def lane_mesh_shape(self) -> tuple[int, int, int, int] | None:
        """Shape of the group's ``LANE_MESH_DIM_NAMES`` mesh of fixed lanes; ``None`` when replicated
        (no lane splits) or adaptive."""
        if self.replicated or self.adaptive:  # adaptive lanes: one mesh per size (adaptive_lane_meshes)
            return None
        return (self.num_lanes, self.cfg, self.ring, self.ulysses)

    def describe(self) -> dict:
        """The layout as ``/v1/pool`` and the demo show it."""
        return {
            "replicate_size": self.replicate_size,
            "shard_size": self.shard_size,
            "lanes": self.num_lanes,
            "lane_size": self.lane_size,
            "cfg_parallel": self.cfg == 2,
            "ring_degree": self.ring,
            "ulysses_degree": self.ulysses,
            "lane_sizes": list(self.lane_sizes),  # with cfg_parallel: lanes of 2 or more are CFG 2 x Ulysses
        }

    def bundles(self, device: str, cpus_per_rank: float) -> list[dict[str, float]]:
        """Placement-group bundles of one group: one per rank, a GPU each on cuda hosts.

        Args:
            device: ``"cuda"`` or ``"cpu"``.
            cpus_per_rank: CPUs reserved per rank.
        """
        bundle = {"GPU": 1.0, "CPU": float(cpus_per_rank)} if device == "cuda" else {"CPU": float(cpus_per_rank)}
        return [dict(bundle) for _ in range(self.shard_size)]


#: A shard group never spans nodes: its all-gathers run every layer and need the fast local links.
PLACEMENT_STRATEGY = "STRICT_PACK"
