"""Adaptive lanes: which lane a group gives a request when it takes it (``lane_sizes``).

The rule, from what the group knows at that moment: the ranks free now are shared among the
requests waiting, oldest first. A lone request on an idle group gets the widest lane its tokens
split over; a backlog gets lanes of one rank (the most requests at once), unless the group measured
that a wider lane costs no more rank-seconds per unit of work (within ``EFFICIENT``: its split
scales), which then costs no throughput and is given; a request that names its ``lane_size`` waits
for a free lane of that size. A request with a deadline (``deadline``, from its
arrival) is given a lane only where the group's measured speed of that lane size says it finishes
in time: the widest such lane within its share, else the narrowest such lane free; when no free lane
would make it but a busy wider one would, it waits for that one. A lane is an aligned block of
ranks (``ParallelDims.blocks``), all of them free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ray_hsdp.topology import ParallelDims

#: A lane size is as efficient as the best when its rank-seconds per unit of work are at most this
#: many times the best measured size's.
EFFICIENT = 1.1


def lane_for(
    dims: ParallelDims,
    sizes: Sequence[int],
    named: int | None,
    loads: Sequence[int],
    capacity: int,
    waiting: int,
    due_s: float | None = None,
    work: int = 0,
    speed: Mapping[int, float] | None = None,
) -> range | None:
    """The ranks of the lane to give the oldest waiting request, or ``None``: it waits.

    Args:
        dims: The group's mesh arithmetic (its lanes: ``blocks``).
        sizes: The lane sizes the request's tokens split over (``RequestVariant.lane_sizes``).
        named: The size the request asks for (``lane_size``); ``None``: the group chooses.
        loads: Requests each rank runs now.
        capacity: Requests a rank runs at once (``requests_per_rank``).
        waiting: Requests waiting for a lane, this one included.
        due_s: Seconds until its deadline; ``None``: none.
        work: Its tokens x steps (``RequestVariant.work``).
        speed: Lane size -> measured seconds per unit of work on a lane of that size.
    """
    free = [load < capacity for load in loads]

    def block(size: int) -> range | None:
        return next((b for b in dims.blocks(size) if all(free[r] for r in b)), None)

    if named is not None:
        return block(named)
    share = max(1, sum(free) // max(1, waiting))
    open_sizes = [s for s in sorted(sizes) if block(s) is not None]
    speed = speed or {}
    best = min((s * speed[s] for s in sizes if s in speed), default=None)

    def allowed(size: int) -> bool:  # within the request's share, or costing no throughput
        return size <= share or (size in speed and size * speed[size] <= EFFICIENT * best)

    if due_s is None or not work or not speed:
        fitting = [s for s in open_sizes if allowed(s)]
        return block(fitting[-1]) if fitting else None
    in_time = [s for s in open_sizes if s not in speed or speed[s] * work <= due_s]
    within = [s for s in in_time if allowed(s)]
    if within:
        return block(within[-1])
    if in_time:
        return block(in_time[0])
    if any(s in speed and speed[s] * work <= due_s for s in sizes):
        return None  # a busy wider lane would make it: wait for it
    return block(open_sizes[-1]) if open_sizes else None  # none would: the fastest free one
