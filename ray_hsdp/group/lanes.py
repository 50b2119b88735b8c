"""Which waiting request a group serves first, and, with adaptive lanes (``lane_sizes``), which
lane it gives it (``LeanLanes``).

**Order** (every group): a request that carries a target (``deadline``, counted from its arrival)
is served before one that does not, earliest target first, unless the group's measured times say
that it can no longer make it on any lane it may run on: such a request waits behind those that
still can (it is still served; nothing is dropped). A request passed over for ``queue_max_skip_s``
is served next regardless, oldest first, so nothing starves. Without targets this is arrival
order.

**Lane** (adaptive groups): the ranks free now are shared among the requests waiting, and a request
gets the fastest lane within its share (by the group's measured times for its work; of those within
``EFFICIENT`` of the fastest, the narrowest: ``as_fast``; a size never measured counts as fastest,
so the group learns it). A lone request on an idle group thus gets the widest lane its tokens split
over where that is faster, and a lane of one where it is not (a small request, bound by the weight
gathers that every rank joins, runs as fast on one rank and leaves the others free); a backlog gets
lanes of one rank (the most requests at once), unless the group measured that a wider lane costs no
more rank-seconds for a request of this work (within ``EFFICIENT``: its split scales). A request
with a target is given a lane only where the group's measured time for its work on that lane size
says it finishes in time: the fastest such lane within its share, else the narrowest such lane
free; when no free lane would make it but a busy wider one would, it waits for that one; when none
would, it is served like a request without a target. **Lean lanes first**: while every waiting
request that can still make its target would make it on its *lean* lane (the narrowest as fast as
its fastest), the group's ranks taken in turn (``queue_keeps_up``), a request with a target gets
its lean lane (or another as fast), or waits for one: slower narrow lanes side by side slow each
other in lock step, so they are given only to a backlog that the lean lanes cannot clear by its
targets. A request that names its ``lane_size`` waits for a free lane of that size (alike its
neighbours or not: it asked for it). A lane is an aligned block of ranks (``ParallelDims.blocks``),
all of them free. The runs that chose this policy over others are in
``bench/results/slo-lane-policy-history.md``.

**Neighbours** (adaptive groups): the lanes of a group run in one lock step, so a tick lasts as long
as its busiest rank's forwards (every request a rank runs adds its share of a forward's work), plus
a part that does not grow with the work (the weight gathers and exchanges every tick pays, which
the group fits from its requests' measured steps: ``TickModel``), and every lane waits for it. A
lane opens only where it is alike its neighbours (``LockStep.alike``): it neither lengthens the
tick the running lanes have by more than ``ALIKE`` times, nor runs at a tick more than ``ALIKE``
times its own ranks' work. A small request thus does not open a lane of one rank beside a large
request's lane of one (it would run at the large one's pace), nor a large one beside small ones
(they would run at its pace): it waits until the running lanes drain, and requests of like work
share the group. Where the fixed part dominates, a second request on a running lane's ranks is
alike it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ray_hsdp.config.topology import ParallelDims

#: A lane size is as efficient as the best when its rank-seconds for a request are at most this
#: many times the best measured size's, and as fast as the fastest (``as_fast``) when its seconds are.
EFFICIENT = 1.1
#: A lane opens beside running ones only when the tick it makes is at most this many times both the
#: running lanes' tick and its own ranks' work (``LockStep.alike``).
ALIKE = 1.5


@dataclass(frozen=True)
class LockStep:
    """The per-forward work of a group's tick, and of a request that waits for a lane.

    Attributes:
        rank_work: Each rank's share of the forwards that its denoising requests put into every
            tick (``GenerationRequest.forward_cost`` over the lane's ranks, summed per rank).
        cost: The waiting request's ``forward_cost``.
        floor: The part of a step that does not grow with the work, in the same units
            (``TickModel.floor``: the weight gathers and exchanges every tick pays); 0: none known.
    """

    rank_work: Sequence[float]
    cost: float
    floor: float = 0.0

    def alike(self, block: range) -> bool:
        """Whether a lane of the ranks ``block`` for the waiting request is alike its neighbours:
        the tick it makes (its floor plus its busiest rank's work) is at most ``ALIKE`` times the
        tick the group runs now (when it runs one) and at most ``ALIKE`` times its own ranks' (it
        does not wait on heavier neighbours)."""
        after = self.with_lane(block)
        running = max(self.rank_work, default=0.0)
        tick, before = self.floor + max(after), self.floor + running
        own = self.floor + max(after[rank] for rank in block)
        return tick <= ALIKE * own and (running <= 0 or tick <= ALIKE * before)

    def with_lane(self, block: range) -> list[float]:
        """Each rank's work once the waiting request runs on the ranks ``block``."""
        share = self.cost / len(block)
        return [work + (share if rank in block else 0.0) for rank, work in enumerate(self.rank_work)]


class TickModel:
    """A step's seconds as a part that does not grow with the work and one that does:
    ``step_s = fixed_s + per_work_s x work``, where ``work`` is the group's busiest rank's work
    (``LockStep.rank_work``) when a request was taken and ``step_s`` its mean seconds per step,
    fitted by least squares over the ``KEPT`` most recent requests. On 4 x H200 (run k) the wide lane
    ran two requests at once at 0.45-0.55 s a step and one alone at 0.42-0.6: the fixed part
    dominates there, which a tick modelled as work alone (floor 0) does not know."""

    KEPT = 64
    #: Requests, and how many times the most work exceeds the least among them, before a fit is used.
    MIN_RUNS = 8
    SPREAD = 1.5
    #: The floor is at most this many times the most work measured (a fit whose step does not grow
    #: with the work, or barely, means: neighbours cost a step little).
    CAP = 4.0

    def __init__(self) -> None:
        self._runs: deque[tuple[float, float]] = deque(maxlen=self.KEPT)
        self._floor = 0.0  # fitted once per request learnt: the scheduler reads it at every assignment

    def __len__(self) -> int:
        """Requests the fit reads."""
        return len(self._runs)

    def learn(self, work: float, step_s: float) -> None:
        if work > 0 and step_s > 0:
            self._runs.append((work, step_s))
            self._floor = self._fit()

    def floor(self) -> float:
        """``fixed_s / per_work_s`` in work units: the work a step's fixed part is worth; 0 while
        fewer than ``MIN_RUNS`` requests, or work spread less than ``SPREAD`` times, were measured."""
        return self._floor

    def _fit(self) -> float:
        """``floor``'s value from the requests kept now."""
        runs = self._runs
        works = [work for work, _ in runs]
        if len(works) < self.MIN_RUNS or max(works) < self.SPREAD * min(works):
            return 0.0
        mean_w = sum(works) / len(works)
        mean_s = sum(step for _, step in runs) / len(works)
        variance = sum((w - mean_w) ** 2 for w in works)
        per_work_s = sum((w - mean_w) * (step - mean_s) for w, step in runs) / variance
        fixed_s = mean_s - per_work_s * mean_w
        if fixed_s <= 0:
            return 0.0
        cap = self.CAP * max(works)
        return cap if per_work_s <= 0 else min(cap, fixed_s / per_work_s)


class LaneTimes:
    """Seconds a request ran (from a lane taking it to its answer), measured per lane size and
    work (tokens x steps x outputs): an average that weighs the newest run half, so that it follows
    the group's load (in lock step a lane's forward waits for its neighbours'). The ``KEPT`` most
    recently measured (size, work) pairs are kept: the order reads them for every queued request."""

    KEPT = 256

    def __init__(self) -> None:
        self._runs: OrderedDict[tuple[int, int], float] = OrderedDict()

    def learn(self, size: int, work: int, run_s: float) -> None:
        previous = self._runs.pop((size, work), None)
        self._runs[(size, work)] = run_s if previous is None else (previous + run_s) / 2
        if len(self._runs) > self.KEPT:
            self._runs.popitem(last=False)

    def estimate(self, size: int, work: int) -> float | None:
        """Seconds a request of ``work`` takes on a lane of ``size``: measured for that work, else
        scaled from the nearest work measured on that size; ``None``: that size never ran one."""
        if (size, work) in self._runs:
            return self._runs[(size, work)]
        measured = [w for s, w in self._runs if s == size and w]
        if not measured or not work:
            return None
        nearest = min(measured, key=lambda w: abs(w - work))
        return self._runs[(size, nearest)] * work / nearest

    def estimates(self, sizes: Sequence[int], work: int) -> dict[int, float]:
        """Lane size -> estimated seconds, for the sizes of ``sizes`` that ran a request."""
        out = {size: self.estimate(size, work) for size in sizes}
        return {size: seconds for size, seconds in out.items() if seconds is not None}

    def as_dict(self) -> dict[str, float]:
        return {f"{size}x{work}": round(s, 3) for (size, work), s in sorted(self._runs.items())}


@dataclass(frozen=True)
class Waiting:
    """What the order needs of one waiting request."""

    waited_s: float
    due_s: float | None  # seconds until its target; None: none
    fastest_s: float | None  # its estimated time on the fastest lane it may run on; None: unknown


def serving_order(waiting: Sequence[Waiting], max_skip_s: float) -> list[int]:
    """Indices of ``waiting`` (oldest first) in the order the group serves them (module doc)."""

    def key(i: int) -> tuple:
        w = waiting[i]
        if w.waited_s >= max_skip_s:
            return (0, 0, -w.waited_s)
        if w.due_s is None:
            return (2, 0, -w.waited_s)
        hopeless = w.due_s < (w.fastest_s or 0.0)
        return (1, hopeless, w.due_s)

    return sorted(range(len(waiting)), key=key)


def as_fast(sizes: Sequence[int], estimates: Mapping[int, float]) -> list[int]:
    """The lane sizes of ``sizes`` as fast as the fastest, narrowest first: those whose measured
    time is within ``EFFICIENT`` of the least (a narrower one leaves the most ranks to other
    requests: a small request's forward is bound by the group's weight gathers, which every rank
    joins at each tick, so a lane of one runs it as fast as a lane of four). While a size has never
    run a request of this work, the widest of those (the group learns it)."""
    unmeasured = [s for s in sizes if s not in estimates]
    if unmeasured:
        return [max(unmeasured)]
    least = min(estimates[s] for s in sizes)
    return sorted(s for s in sizes if estimates[s] <= EFFICIENT * least)


def queue_keeps_up(queue: Sequence[tuple[float, float, int]], backlog_s: float, ranks: int, capacity: int) -> bool:
    """Whether each request of ``queue`` (seconds until its target, its measured seconds on its
    lean lane (``as_fast``), that lane's size; in serving order, those that no lane can make left
    out) finishes by its target when each runs on its lean lane as soon as that many of the group's
    ``ranks`` x ``capacity`` places are free, every place first free once the ``backlog_s`` seconds
    of work the group runs now have drained."""
    free = [backlog_s] * (ranks * capacity)
    for due_s, lane_s, size in queue:
        free.sort()
        start = free[size - 1]
        if start + lane_s > due_s:
            return False
        free[:size] = [start + lane_s] * size
    return True


@dataclass(frozen=True)
class LaneAsk:
    """What the lane policy reads of the first request in the serving order.

    Attributes:
        sizes: The lane sizes its tokens split over (``RequestVariant.lane_sizes``).
        named: The size it asks for (``lane_size``); ``None``: the group chooses.
        due_s: Seconds until its target; ``None``: none.
        estimates: Lane size -> the seconds the group measured a request of its work takes there
            (``LaneTimes.estimates``); sizes that never ran one are absent.
        keeps_up: Whether the queue makes its targets on its lean lanes (``queue_keeps_up``).
    """

    sizes: Sequence[int]
    named: int | None = None
    due_s: float | None = None
    estimates: Mapping[int, float] = field(default_factory=dict)
    keeps_up: bool = False


@dataclass(frozen=True)
class LaneRoom:
    """What the lane policy reads of the group now.

    Attributes:
        loads: Requests each rank runs now.
        waiting: Requests waiting for a lane, the asking one included.
        lock_step: The tick's work and the request's; ``None``: lanes open wherever ranks are free.
    """

    loads: Sequence[int]
    waiting: int = 1
    lock_step: LockStep | None = None


@dataclass(frozen=True)
class LeanLanes:
    """The group's lane policy (the module doc's **Lane**): ``lane`` gives the first request in the
    serving order its lane, or ``None`` while it waits.

    Attributes:
        dims: The group's mesh arithmetic (its lanes: ``blocks``).
        capacity: Requests a rank runs at once (``requests_per_rank``).
    """

    dims: ParallelDims
    capacity: int

    def lane(self, ask: LaneAsk, room: LaneRoom) -> range | None:
        """The ranks of the lane to give ``ask``'s request now, or ``None``: it waits."""
        if ask.named is not None:
            return self._block(room, ask.named, beside_any=True)
        if ask.due_s is not None and ask.keeps_up:  # its lean lane, or it waits for one, in time for its target
            lean = as_fast(ask.sizes, ask.estimates)
            return next((b for b in (self._block(room, s) for s in lean) if b is not None), None)
        open_sizes = [s for s in sorted(ask.sizes) if self._block(room, s) is not None]
        if ask.due_s is not None and ask.estimates and any(self._in_time(ask, s) for s in ask.sizes):
            timely = [s for s in open_sizes if self._in_time(ask, s)]
            within = [s for s in timely if self._allowed(ask, room, s)]
            if within:
                return self._block(room, as_fast(within, ask.estimates)[0])
            if timely:
                return self._block(room, timely[0])
            return None  # a busy lane would make it: wait for it
        fitting = [s for s in open_sizes if self._allowed(ask, room, s)]  # no target, or none that a lane makes
        return self._block(room, as_fast(fitting, ask.estimates)[0]) if fitting else None

    def _block(self, room: LaneRoom, size: int, beside_any: bool = False) -> range | None:
        """The first aligned lane of ``size`` whose ranks all have room: one alike its neighbours
        unless ``beside_any``."""
        alike = room.lock_step.alike if room.lock_step is not None and not beside_any else (lambda block: True)
        return next(
            (b for b in self.dims.blocks(size) if all(room.loads[r] < self.capacity for r in b) and alike(b)), None
        )

    def _allowed(self, ask: LaneAsk, room: LaneRoom, size: int) -> bool:
        """Whether ``size`` is within the request's share of the free ranks, or costs no throughput
        (its rank-seconds within ``EFFICIENT`` of the best measured size's)."""
        free = sum(load < self.capacity for load in room.loads)
        share = max(1, free // max(1, room.waiting))
        measured = ask.estimates
        best = min((s * measured[s] for s in ask.sizes if s in measured), default=None)
        return size <= share or (size in measured and size * measured[size] <= EFFICIENT * best)

    @staticmethod
    def _in_time(ask: LaneAsk, size: int) -> bool:
        """Whether a lane of ``size`` makes the target by its measured time (unmeasured: it may)."""
        return size not in ask.estimates or ask.estimates[size] <= ask.due_s
