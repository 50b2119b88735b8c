"""Adaptive lanes: which lane a group gives a request when it takes it (``lane_sizes``).

The rule, from what the group knows at that moment: the ranks free now are shared among the
requests waiting, oldest first. A lone request on an idle group gets the widest lane its tokens
split over; a backlog gets lanes of one rank (the most requests at once); a request that names its
``lane_size`` waits for a free lane of that size. A lane is an aligned block of ranks
(``ParallelDims.blocks``), all of them free.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray_hsdp.topology import ParallelDims


def lane_for(
    dims: ParallelDims, sizes: Sequence[int], named: int | None, loads: Sequence[int], capacity: int, waiting: int
) -> range | None:
    """The ranks of the lane to give the oldest waiting request, or ``None``: it waits.

    Args:
        dims: The group's mesh arithmetic (its lanes: ``blocks``).
        sizes: The lane sizes the request's tokens split over (``RequestVariant.lane_sizes``).
        named: The size the request asks for (``lane_size``); ``None``: the group chooses.
        loads: Requests each rank runs now.
        capacity: Requests a rank runs at once (``requests_per_rank``).
        waiting: Requests waiting for a lane, this one included.
    """
    free = [load < capacity for load in loads]
    share = max(1, sum(free) // max(1, waiting))
    wanted = [named] if named is not None else sorted((s for s in sizes if s <= share), reverse=True)
    for size in wanted:
        block = next((b for b in dims.blocks(size) if all(free[r] for r in b)), None)
        if block is not None:
            return block
    return None
