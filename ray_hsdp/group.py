"""One shard group: S rank actors on one placement group, a cost-aware queue, teardown.

Plain Python, not Serve code: a notebook or a script can own a group directly, and the Serve
deployment wraps one group per replica.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_hsdp.config import GroupConfig
from ray_hsdp.phases import Phases
from ray_hsdp.rank import CONCURRENCY_GROUPS, Rank
from ray_hsdp.request import GenerationRequest, GenerationResult, RequestCancelledError
from ray_hsdp.runtime import SessionFailedError
from ray_hsdp.topology import PLACEMENT_STRATEGY, ParallelDims
from ray_hsdp.variant import RequestVariant

logger = logging.getLogger("ray_hsdp")

_RENDEZVOUS_TRIES = 3
# A survivor's collective breaks the moment a peer dies, often before Ray reports the death;
# this long a failed session waits for that report so that the reason names the dead rank.
_DEATH_REPORT_GRACE_S = 2.0


def remote_cause(err: BaseException) -> BaseException:
    """The remote exception inside a Ray task error (else ``err`` itself)."""
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        return err.cause
    return err


def _describe(err: BaseException) -> str:
    """One line for an error from a rank: the remote cause without Ray's traceback and colours."""
    err = remote_cause(err)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:400]


def _died(rank_index: int, err: BaseException) -> str:
    """The failure reason of a group whose rank ``rank_index`` died."""
    return f"shard group failed: rank {rank_index} died: {_describe(err)}"


def _resolve(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Answers ``future`` unless it was answered already (every path may try; the first wins)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


def _gray_png(width: int, height: int) -> bytes:
    """A plain gray PNG: the first frame of an image-to-video warm-up request."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


class GroupFailedError(RuntimeError):
    """The group can no longer run requests (a rank died, missed its deadline, or the group shut down).

    Attributes:
        ran: Whether a rank had taken the request it fails: a retry elsewhere of one that had not
            goes on waiting against its arrival's ``queue_deadline``; one that had ran its wait.
    """

    def __init__(self, message: str, ran: bool = True):
        super().__init__(message)
        self.ran = ran


class GroupOverloadedError(RuntimeError):
    """The group's queue is full; the request was not accepted."""


class QueueTimeoutError(TimeoutError):
    """No rank took the request within ``queue_timeout_s`` (HTTP 504)."""


class GroupUnplaceableError(RuntimeError):
    """No node of the Ray cluster can hold a group's bundles (a group never spans nodes)."""


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


@dataclass
class _Job:
    variant: RequestVariant  # takes its ticket when a lane takes it
    future: Future
    enqueued: float
    deadline: float  # time.time() by which a lane must take it (its queue_deadline)
    taken: float | None = None  # when a lane took it
    lane: int | None = None

    @property
    def request(self) -> GenerationRequest:
        return self.variant.request


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one accepted request: one per request, on every path.

    Attributes:
        request_id: The request's id.
        status: ``ok``, ``cancelled``, ``error`` (its own: bad input, deadline) or ``failed`` (its
            group failed under it).
        steps: Denoising steps it asked for.
        queued_s: Seconds in the group's queue (to its end when it never left the queue).
        run_s: Seconds from a lane taking it to its answer; ``None`` when it never ran.
        lane: The lane that ran it, and ``rank`` its leader (the rank that answered).
        step_s: Mean seconds per denoising step, as the rank measured them.
        error: The error's type and first line, when it did not succeed.
    """

    request_id: str
    status: str
    steps: int
    queued_s: float
    run_s: float | None = None
    lane: int | None = None
    rank: int | None = None
    step_s: float | None = None
    error: str | None = None


def pick_next(
    pending: Sequence[GenerationRequest],
    waited_s: float,
    running: Sequence[GenerationRequest],
    lookahead: int,
    max_skip_s: float,
) -> int | None:
    """Index of the queued request a free rank should take next.

    Ranks in lock step wait for the slowest forward of each tick, so a free rank takes, among the
    first ``lookahead`` queued requests, the one whose per-forward cost is closest to what the
    other ranks are running (ties: the oldest). The oldest request is taken regardless once it
    has waited ``max_skip_s``, so nothing starves.

    Args:
        pending: Queued requests, oldest first.
        waited_s: How long the oldest has waited.
        running: Requests the other ranks are running.
        lookahead: How many queued requests to consider.
        max_skip_s: Longest the oldest request may be passed over.
    """
    if not pending:
        return None
    if not running or waited_s >= max_skip_s:
        return 0
    target = sum(r.forward_cost for r in running) / len(running)
    window = range(min(lookahead, len(pending)))
    return min(window, key=lambda i: (abs(math.log(pending[i].forward_cost / target)), i))


class ShardGroup:
    """S ranks that together hold one copy of the pipeline and run requests from one queue.

    The ranks form lanes (``ParallelDims``): a lane runs each of its requests on all its ranks
    (split by sequence and CFG parallel in combined mode; the whole request on every rank when
    replicated), its leader answers, and it takes the next queued request as soon as it has room.
    In ``batch`` mode without splits a lane is one rank. The tick protocol keeps any mix of
    requests on the lanes in lock step.

    Args:
        config: Group configuration.
        placement_group: A placement group of S bundles to place the ranks in (a Serve replica's
            own); when ``None`` the group creates one and removes it at shutdown.
        dims: The pool's mesh arithmetic; built from ``config`` when not given.
        labels: Said in each request's log line and in ``describe`` (a Serve replica passes its id).

    Use ``start()`` (or a ``with`` block), then ``generate`` (blocking) or ``submit`` (a future).
    """

    def __init__(
        self,
        config: GroupConfig,
        placement_group: PlacementGroup | None = None,
        dims: ParallelDims | None = None,
        labels: dict[str, str] | None = None,
    ):
        self.config = config
        self.dims = dims or config.parallel_dims()
        #: This group's id: in its ranks' actor names, their log prefixes and every request's log line.
        self.group_id = uuid.uuid4().hex[:8]
        self.labels = dict(labels or {})
        #: Called with a ``RequestRecord`` once per accepted request, when it is answered (metrics).
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self._tickets = itertools.count()
        self._pg = placement_group
        self._owns_pg = placement_group is None
        self.ranks: list = []
        self.placement: list[dict] = []
        #: What the loaded pipeline tells its callers (``ShardedPipeline.facts``).
        self.pipeline_facts: dict = {}
        self._pending: list[_Job] = []
        self._inflight: dict[ray.ObjectRef, tuple[int, _Job]] = {}  # offer -> (rank index, job)
        self._sessions: dict[ray.ObjectRef, int] | None = None  # running session -> rank index
        self._sessions_done: set[ray.ObjectRef] = set()
        self._watchers: dict[ray.ObjectRef, int] = {}  # each rank's open ``watch`` call -> rank index
        # Offers and sessions that completed, as Ray reports them; the scheduler handles them.
        self._events: deque[tuple[str, ray.ObjectRef, Future]] = deque()
        self._wake = False  # a request was submitted
        self._cond = threading.Condition()
        self._scheduler: threading.Thread | None = None
        self._failure: str | None = None
        self._closed = False
        self.phases = Phases(f"group {self.group_id}")
        self.rank_phases: list[dict[str, float]] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ShardGroup:
        """Places the ranks, forms the process group, loads and shards the pipeline, starts intake."""
        if not ray.is_initialized():
            ray.init()
        started = time.perf_counter()
        self.config = self.config.resolve_device(ray.cluster_resources().get("GPU", 0) > 0)
        bundles = self.dims.bundles(self.config.device, self.config.cpus_per_rank)
        try:
            with self.phases.phase("placement"):
                if self._pg is None:
                    check_placeable(bundles)
                    self._pg = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
                if not self._pg.wait(timeout_seconds=self.config.rendezvous_timeout_s):
                    raise GroupFailedError(
                        f"could not place {self.dims.shard_size} ranks of {bundles[0]} on one node within "
                        f"{self.config.rendezvous_timeout_s:.0f}s (cluster resources: {ray.available_resources()})"
                    )
            self._spawn_and_join()
            with self.phases.phase("load"):
                reports = ray.get([r.load.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
            self.pipeline_facts = reports[0]["pipeline"]
            self.rank_phases = [r["start_phases_s"] for r in reports]
        except BaseException:
            self.shutdown()
            raise
        for rank_index, rank in enumerate(self.ranks):
            watch = rank.watch.remote()
            self._watchers[watch] = rank_index
            self._watch("rank", watch)
        self._scheduler = threading.Thread(target=self._schedule, name="ray_hsdp-scheduler", daemon=True)
        self._scheduler.start()
        if self.config.compile:
            # The first forwards compile: here, one small request per lane, not in a user's request.
            # An image-to-video pipeline takes no request without its first frame.
            image = _gray_png(64, 64) if self.pipeline_facts.get("image_input") else None
            warm = [
                GenerationRequest(prompt="warm up", num_inference_steps=1, request_id=f"warm-up-{lane}", image=image)
                for lane in range(self.dims.num_lanes)
            ]
            try:
                with self.phases.phase("warm-up"):
                    self.generate(warm)
            except BaseException:
                self.shutdown()
                raise
        self.phases.seconds["total"] = round(time.perf_counter() - started, 3)
        logger.info(
            "Shard group ready in %.1f s: %d ranks on %s, mode=%s",
            self.phases.seconds["total"],
            self.dims.shard_size,
            sorted({p["node_ip"] for p in self.placement}),
            self.config.mode,
        )
        return self

    def _spawn_and_join(self) -> None:
        bundle = self.dims.bundles(self.config.device, self.config.cpus_per_rank)[0]
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Rank)
        for attempt in range(1, _RENDEZVOUS_TRIES + 1):
            # Named, so that `ray list actors` and operators can tell the ranks of each group apart.
            names = [f"ray_hsdp-{self.group_id}-{attempt}-rank{i}" for i in range(self.dims.shard_size)]
            self.ranks = [
                actor.options(
                    name=names[i],
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=i
                    ),
                ).remote(i, self.config, self.dims, self.group_id)
                for i in range(self.dims.shard_size)
            ]
            with self.phases.phase("rank processes and imports"):
                ray.get([r.prepare.remote() for r in self.ranks], timeout=self.config.load_timeout_s)
            master, port = ray.get(self.ranks[0].address.remote(), timeout=self.config.rendezvous_timeout_s)
            try:
                with self.phases.phase("rendezvous"):
                    joined = ray.get(
                        [r.join.remote(master, port) for r in self.ranks], timeout=self.config.rendezvous_timeout_s
                    )
                self.placement = [{**place, "actor_name": name} for place, name in zip(joined, names)]
                return
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as err:
                # The port was free when rank 0 picked it; another process may have taken it since.
                if "address already in use" not in str(err).lower() or attempt == _RENDEZVOUS_TRIES:
                    raise
                logger.warning("Rendezvous port %d taken (try %d), retrying on a new port", port, attempt)
                self._kill_ranks()

    def _kill_ranks(self) -> None:
        ranks, self.ranks = self.ranks, []
        for r in ranks:
            ray.kill(r, no_restart=True)

    def shutdown(self) -> None:
        """Fails queued and running requests, destroys the process group, kills the ranks,
        removes an owned placement group. Safe to call more than once."""
        with self._cond:
            self._closed = True
            jobs = self._pending + [j for _, j in self._inflight.values()]
            self._pending, self._inflight = [], {}
            self._cond.notify_all()
        for job in jobs:
            _resolve(job.future, error=GroupFailedError("the shard group was shut down before the request finished"))
        if self._scheduler is not None and self._scheduler is not threading.current_thread():
            self._scheduler.join(timeout=30)
        if self.ranks:
            if self._failure is None:
                try:
                    ray.get([r.leave.remote() for r in self.ranks], timeout=30)
                except Exception as err:  # noqa: BLE001 - a dead rank cannot leave; it is killed below anyway
                    logger.warning("Ranks did not leave cleanly: %s", err)
            self._kill_ranks()
        if self._pg is not None and self._owns_pg:
            remove_placement_group(self._pg)
            self._pg = None

    @property
    def failure(self) -> str | None:
        """Why the group failed, or ``None`` while it is healthy."""
        return self._failure

    def __enter__(self) -> ShardGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Future:
        """Queues a request; the future resolves to its ``GenerationResult``, or to the error that
        ended it (``GroupFailedError`` when the group failed under it), exactly once.

        Raises:
            GroupFailedError: The group is shut down or broken.
            GroupOverloadedError: Every rank is busy and ``max_queue`` requests are already waiting.
            InvalidRequestError: The group cannot run what the request asks (see ``check``).
        """
        variant = self.check(request)
        future: Future = Future()
        with self._cond:
            if self._closed or self._failure:
                raise GroupFailedError(self._failure or "the shard group is shut down")
            running = len({id(job) for _, job in self._inflight.values()})
            if len(self._pending) + running >= self.running_capacity + self.config.max_queue:
                raise GroupOverloadedError(
                    f"the shard group's queue is full: {running} requests running, {len(self._pending)} waiting "
                    f"(max_queue={self.config.max_queue}); retry later"
                )
            deadline = request.queue_deadline or time.time() + self.config.queue_timeout_s
            job = _Job(variant, future, time.monotonic(), deadline)
            self._pending.append(job)
            self._wake = True
            self._cond.notify_all()
        future.add_done_callback(lambda done: self._record(job, done))
        return future

    def _record(self, job: _Job, future: Future) -> None:
        """Logs the request's one structured line and tells the listeners."""
        now = time.monotonic()
        error = None if future.cancelled() else future.exception()
        result = future.result() if not future.cancelled() and error is None else None
        if result is not None:
            status = "ok"
        elif future.cancelled() or isinstance(error, RequestCancelledError):
            status = "cancelled"
        else:
            status = "failed" if isinstance(error, GroupFailedError) else "error"
        record = RequestRecord(
            request_id=job.request.request_id,
            status=status,
            steps=job.request.num_inference_steps,
            queued_s=round((job.taken or now) - job.enqueued, 4),
            run_s=round(now - job.taken, 4) if job.taken is not None else None,
            lane=job.lane,
            rank=result.rank if result is not None else None,
            step_s=result.step_s if result is not None else None,
            error=_describe(error) if error is not None else None,
        )
        line = {"event": "request", "group": self.group_id, **self.labels, **dataclasses.asdict(record)}
        logger.info("request %s", json.dumps(line))
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a listener's bug must not break the answer path
                logger.exception("A request listener failed")

    def check(self, request: GenerationRequest) -> RequestVariant:
        """The request's variant: every per-request choice read and checked once
        (``RequestVariant.build``: the pairs of the table of refusals, each feature's field, the
        split of its tokens over a lane).

        Raises:
            InvalidRequestError: Naming the field and what to send instead
                (``UnsplittableRequestError`` for tokens that do not split over a lane).
        """
        return RequestVariant.build(request, self.config, self.pipeline_facts)

    @property
    def running_capacity(self) -> int:
        """Requests the ranks run at once: ``requests_per_rank`` per lane."""
        return self.dims.num_lanes * self.config.requests_per_rank

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Runs requests through the queue and waits for all of them, in the order given."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def _take(self, index: int) -> _Job | None:
        job = self._pending.pop(index)
        return job if job.future.set_running_or_notify_cancel() else None

    def _offer(self, lane: int, job: _Job) -> None:
        """Hands ``job`` to every rank of ``lane`` under one ticket (called with the lock held)."""
        job.variant = job.variant.with_ticket(next(self._tickets))
        job.taken, job.lane = time.monotonic(), lane
        for rank_index in self.dims.lane_ranks(lane):
            ref = self.ranks[rank_index].offer.remote(job.variant)
            self._inflight[ref] = (rank_index, job)
            self._watch("offer", ref)

    def _watch(self, kind: str, ref: ray.ObjectRef) -> None:
        """Hands ``ref``'s completion to the scheduler thread (Ray calls back; nothing polls)."""

        def completed(future: Future) -> None:
            with self._cond:
                self._events.append((kind, ref, future))
                self._cond.notify_all()

        ref.future().add_done_callback(completed)

    def _assign(self) -> None:
        """Hands queued requests to lanes with room (called with the lock held)."""
        while self._pending:
            # The least loaded lane first, so that every lane has work before any has two.
            lane = min(range(self.dims.num_lanes), key=self._load)
            if self._load(lane) >= self.config.requests_per_rank:
                return
            others = list(
                {id(job): job.request for i, job in self._inflight.values() if self.dims.lane_of(i) != lane}.values()
            )
            index = pick_next(
                [j.request for j in self._pending],
                time.monotonic() - self._pending[0].enqueued,
                others,
                self.config.queue_lookahead,
                self.config.queue_max_skip_s,
            )
            job = self._take(index)
            if job is not None:
                self._offer(lane, job)

    def _load(self, lane: int) -> int:
        """Requests on ``lane``: its busiest rank's (a leader still decodes after its lane moved on)."""
        ranks = self.dims.lane_ranks(lane)
        return max(sum(1 for i, _ in self._inflight.values() if i == r) for r in ranks)

    def _schedule(self) -> None:
        """The scheduler thread: hands requests to ranks, answers them, starts sessions.

        Wakes on a submitted request, a completed offer or session, or a rank's death. If it
        crashes, the group fails (and so answers every request it holds) rather than go quiet.
        """
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._events or self._wake):
                        if not self._cond.wait(self._until_queue_timeout()):
                            break  # the oldest queued request's time is up
                    if self._closed:
                        return
                    self._wake = False
                    events = list(self._events)
                    self._events.clear()
                for kind, ref, future in events:
                    if kind == "offer":
                        self._offer_done(ref, future)
                    elif kind == "session":
                        self._session_done(ref, future)
                    elif isinstance(future.exception(), ray.exceptions.RayActorError):  # a rank, idle or not
                        rank_index = self._watchers[ref]
                        self._fail(_died(rank_index, future.exception()))
                self._expire_queued()
                with self._cond:
                    if self._failure or self._closed:
                        continue
                    self._assign()
                    if self._inflight and self._sessions is None:
                        # Every rank ticks, with work or without, until all are idle.
                        self._sessions = {r.session.remote(): i for i, r in enumerate(self.ranks)}
                        for ref in self._sessions:
                            self._watch("session", ref)
        except BaseException as err:
            logger.exception("The shard group's scheduler crashed")
            self._fail(f"shard group failed: its scheduler crashed: {type(err).__name__}: {err}")

    def _until_queue_timeout(self) -> float | None:
        """Seconds until the first queued request's deadline passes (lock held)."""
        if not self._pending:
            return None
        return max(0.0, min(job.deadline for job in self._pending) - time.time())

    def _expire_queued(self) -> None:
        """Answers the queued requests no lane took by their deadline (504): ``queue_timeout_s``
        from their arrival, however long of it they spent waiting elsewhere first."""
        now = time.time()
        with self._cond:
            expired = [j for j in self._pending if now >= j.deadline]
            self._pending = [j for j in self._pending if j not in expired]
        for job in expired:
            waited = time.monotonic() - job.enqueued
            error = QueueTimeoutError(
                f"request {job.request.request_id!r} waited {waited:.0f}s in this group's queue, and no rank took "
                f"it by its deadline (queue_timeout_s={self.config.queue_timeout_s:g} from its arrival)"
            )
            _resolve(job.future, error=error)

    def _offer_done(self, ref: ray.ObjectRef, future: Future) -> None:
        with self._cond:
            entry = self._inflight.pop(ref, None)
        if entry is None:
            return  # the group failed or shut down meanwhile, and answered the request then
        rank_index, job = entry
        error = future.exception()
        if isinstance(error, ray.exceptions.RayActorError):
            self._fail(_died(rank_index, error), also=job)
        elif error is not None and isinstance(remote_cause(error), SessionFailedError):
            self._fail(self._session_failure(error), also=job)
        elif not self.dims.leads(rank_index):
            if error is not None:  # its own error, which stopped the lane: the cause, not the leader's stop
                _resolve(job.future, error=remote_cause(error))
        elif error is None:
            _resolve(job.future, result=future.result())
        else:  # the request's own error (bad input, deadline): the group is fine
            _resolve(job.future, error=remote_cause(error))

    def _session_done(self, ref: ray.ObjectRef, future: Future) -> None:
        error = future.exception()
        with self._cond:
            if self._sessions is None or ref not in self._sessions:
                return  # a session of a group that failed already
            rank_index = self._sessions[ref]
            if error is None:
                self._sessions_done.add(ref)
                if len(self._sessions_done) == len(self._sessions):
                    self._sessions, self._sessions_done = None, set()
                return
        if isinstance(error, ray.exceptions.RayActorError):
            self._fail(_died(rank_index, error))
        else:
            self._fail(self._session_failure(error))

    def _session_failure(self, error: BaseException) -> str:
        """The reason for a failed session: a dead peer's, if Ray reports one within a short grace.

        Without the grace, a survivor's broken all-gather would name the survivor, and the
        operator would look for the fault on the wrong rank.
        """
        if self._failure is None:
            ready, _ = ray.wait(list(self._watchers), num_returns=1, timeout=_DEATH_REPORT_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as err:
                    return _died(self._watchers[ref], err)
        return f"shard group failed: {remote_cause(error)}"

    def _fail(self, reason: str, also: _Job | None = None) -> None:
        """Marks the group broken, fails every queued and running request (and ``also``) with
        ``reason`` and kills every rank at once: survivors would otherwise sit in a collective
        with a dead or out-of-step peer until its timeout."""
        with self._cond:
            first = self._failure is None
            self._failure = self._failure or reason
            queued = {id(j) for j in self._pending}
            jobs = [*self._pending, *(j for _, j in self._inflight.values()), *([also] if also else [])]
            self._pending, self._inflight = [], {}
            self._sessions, self._sessions_done = None, set()
            self._cond.notify_all()
        for job in jobs:
            _resolve(job.future, error=GroupFailedError(self._failure, ran=id(job) not in queued))
        if first:
            logger.error("Shard group failed: %s", self._failure)
            self._kill_ranks()

    def cancel(self, request_id: str) -> bool:
        """Cancels a request: a queued one is dropped, a running one stops at the end of its
        current denoising step without decoding (its lock step is not broken: the other ranks
        just stop seeing its forwards). Its future fails with ``RequestCancelledError``.

        Returns:
            Whether the group held the request.
        """
        with self._cond:
            queued = [j for j in self._pending if j.request.request_id == request_id]
            self._pending = [j for j in self._pending if j.request.request_id != request_id]
            # The leader decides for its lane: it stops the request on all the lane's ranks at one tick.
            holders = {
                i for i, j in self._inflight.values() if j.request.request_id == request_id and self.dims.leads(i)
            }
            ranks = list(self.ranks)
        for job in queued:
            _resolve(job.future, error=RequestCancelledError(f"request {request_id!r} was cancelled while queued"))
        for rank_index in holders:
            ranks[rank_index].cancel.remote(request_id)  # the offer then fails with RequestCancelledError
        return bool(queued or holders)

    def load(self) -> tuple[int, int]:
        """``(queued, running)``: requests waiting in the queue, and those the lanes run now."""
        with self._cond:
            return len(self._pending), len({id(job) for _, job in self._inflight.values()})

    def progress(self) -> dict[str, dict]:
        """Request id -> ``{"state": "queued"}`` or ``{"state": "running", "rank": i, "lane": l,
        "step": s, "total": n}`` (``rank`` is the lane's leader, which answers)."""
        with self._cond:
            out = {j.request.request_id: {"state": "queued"} for j in self._pending}
            running = {
                j.request.request_id: (i, j.request.num_inference_steps)
                for i, j in self._inflight.values()
                if self.dims.leads(i)
            }
            ranks = list(self.ranks)
        for request_id, (rank_index, total) in running.items():
            lane = self.dims.lane_of(rank_index)
            out[request_id] = {"state": "running", "rank": rank_index, "lane": lane, "step": 0, "total": total}
        leaders = [i for i in range(len(ranks)) if self.dims.leads(i)]
        reports = ray.get([ranks[i].progress.remote() for i in leaders], timeout=self.config.request_timeout_s)
        for report in reports:
            for request_id, (step, total) in report.items():
                if request_id in running:
                    out[request_id].update(step=step, total=total)
        return out

    # ---- inspection ------------------------------------------------------------------------

    def memory(self, units: bool = False) -> list[dict]:
        """Each rank's memory report merged with where it runs."""
        reports = ray.get([r.memory.remote(units) for r in self.ranks], timeout=self.config.request_timeout_s)
        return [{**place, **report} for place, report in zip(self.placement, reports)]

    def tick_stats(self) -> list[dict]:
        """Each rank's counts of ticks, ghost passes and batched calls since it loaded."""
        return ray.get([r.tick_stats.remote() for r in self.ranks], timeout=self.config.request_timeout_s)

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Starts every rank's profile window (tick log, request phases, GPU kernels)."""
        ray.get([r.start_profile.remote(trace_dir) for r in self.ranks], timeout=self.config.request_timeout_s)

    def stop_profile(self) -> list[dict]:
        """Ends the profile windows; each rank's summary (see ``ray_hsdp.profiling``)."""
        return ray.get([r.stop_profile.remote() for r in self.ranks], timeout=self.config.request_timeout_s)

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Pings every rank with a deadline.

        Raises:
            GroupFailedError: The group is broken, or a rank died or did not answer in time (the
                group then fails, naming the rank).
        """
        ranks = list(self.ranks)
        if self._failure or not ranks:
            raise GroupFailedError(self._failure or "the shard group is shut down")
        pings = [r.ping.remote() for r in ranks]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for rank_index, ping in enumerate(pings):
            if ping not in answered:
                self._fail(f"shard group failed: rank {rank_index} did not answer its health check in {timeout_s:g}s")
                break
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as err:
                self._fail(_died(rank_index, err))
                break
        if self._failure:
            raise GroupFailedError(self._failure)

    def describe(self) -> dict:
        """Topology of this group: sizes, mode, device, where each rank runs."""
        return {
            **self.dims.describe(),
            "group": self.group_id,
            **self.labels,
            "mode": self.config.mode,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "model": self.config.served_model_name,
            "pipeline": self.pipeline_facts,
            "ranks": self.placement,
            # Where the start went: the group's phases as it waited on them, and each rank's own.
            "start": {"phases_s": dict(self.phases.seconds), "ranks_phases_s": list(self.rank_phases)},
        }
