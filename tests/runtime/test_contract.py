"""The rank runtime's contract, without Ray: plain threads stand in for the ranks of a group and
a barrier for the tick's all-gather.

Random mixes of requests (different modules, step counts, arrival times, batches) run on 2-4
ranks, with errors injected at random points: a request's own error, and a forward, ghost pass or
all-gather that raises on one rank. Whatever happens, every request and every forward call
completes exactly once; calls without an injected error return their real results; ranks that
did not fail ran the same modules in the same order; no request thread is left behind.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from ray_hsdp.protocol import KEY_SPACE, lane_ticket, widened
from ray_hsdp.runtime import ForwardCall, RankRuntime, SessionFailedError
from ray_hsdp.runtime.core import Completion

MODULES = ("text_encoder", "transformer", "transformer_2")
DEADLINE_S = 60


class InjectedError(RuntimeError):
    pass


def real_result(module_id: int, x: torch.Tensor) -> torch.Tensor:
    """What module ``module_id`` computes: something that depends on both."""
    return x * (module_id + 2) + module_id


@dataclass(frozen=True)
class FakeRequest:
    request_id: str
    calls: tuple[tuple[int, float], ...]  # (module id, input) per denoising step
    own_error_at: int | None = None  # the request raises its own error before this step
    num_inference_steps: int = field(init=False, default=0)
    batch_key = None  # no per-request choices: any of its calls may batch with any other

    def __post_init__(self):
        object.__setattr__(self, "num_inference_steps", len(self.calls))

    def expected(self) -> float:
        return float(sum(real_result(m, torch.tensor([x])).item() for m, x in self.calls))


class FakeAllGather:
    """The tick's all-gather between threads; ``abort`` is what the group's kill does to the others."""

    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=DEADLINE_S)
        self.slots = [0] * world_size

    def for_rank(self, rank: int):
        def gather(state: int) -> list[int]:
            self.slots[rank] = state
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


class FakeModules:
    """Modules that log what ran (real or ghost) and can raise at a chosen forward or ghost pass.

    Each call's outcome is checked where it lands: a call answered with a value got the result of
    its own input (batched forwards must not mix up their calls' results)."""

    names = MODULES

    def __init__(self, fail_forward_at: int | None = None, fail_ghost_at: int | None = None):
        self.ran: list[int] = []
        self.forwards = 0
        self.ghosts = 0
        self.fail_forward_at = fail_forward_at
        self.fail_ghost_at = fail_ghost_at
        self.calls: list[ForwardCall] = []
        self.wrong_results: list[tuple[int, float, object]] = []
        self._lock = threading.Lock()

    def before_call(self, call: ForwardCall) -> None:
        with self._lock:
            self.calls.append(call)

        def landed(done: ForwardCall) -> None:
            if done.error is None and not torch.equal(done.value, real_result(done.module_id, done.args[0])):
                with self._lock:
                    self.wrong_results.append((done.module_id, done.args[0].item(), done.value))

        call.add_done_callback(landed)

    def after_call(self, call: ForwardCall) -> None:
        pass

    def forward(self, calls: list[ForwardCall]) -> list:
        self.forwards += 1
        self.ran.append(calls[0].module_id)
        if self.forwards == self.fail_forward_at:
            raise InjectedError(f"forward {self.forwards} failed")
        time.sleep(0.001)
        return [real_result(c.module_id, c.args[0]) for c in calls]

    def ghost(self, module_id: int) -> None:
        self.ghosts += 1
        self.ran.append(module_id)
        if self.ghosts == self.fail_ghost_at:
            raise InjectedError(f"ghost pass {self.ghosts} failed")


class FailingExchange:
    def __init__(self, inner, at: int):
        self.inner, self.at, self.count = inner, at, 0

    def __call__(self, state: int) -> list[int]:
        self.count += 1
        if self.count == self.at:
            raise InjectedError(f"all-gather {self.count} failed")
        return self.inner(state)


def make_request(rng: random.Random, name: str, own_errors: bool) -> FakeRequest:
    steps = rng.randint(1, 6)
    # A text encoder call first, then one expert per step (as Wan2.2 switches experts).
    calls = [(0, float(rng.randint(1, 9)))]
    calls += [(rng.choice((1, 2)), float(rng.randint(1, 9))) for _ in range(steps)]
    own_error_at = rng.randrange(len(calls)) if own_errors and rng.random() < 0.3 else None
    return FakeRequest(name, tuple(calls), own_error_at)


def build_ranks(rng: random.Random, world_size: int, fault: str | None, gather: FakeAllGather):
    """``world_size`` thread ranks over ``gather``, one of them failing as ``fault`` says."""
    failing_rank = rng.randrange(world_size)
    runtimes: list[RankRuntime] = []
    modules: list[FakeModules] = []
    for rank in range(world_size):
        faulty = fault is not None and rank == failing_rank
        mods = FakeModules(
            fail_forward_at=rng.randint(1, 6) if faulty and fault == "forward" else None,
            fail_ghost_at=rng.randint(1, 4) if faulty and fault == "ghost" else None,
        )
        exchange = gather.for_rank(rank)
        if faulty and fault == "exchange":
            exchange = FailingExchange(exchange, rng.randint(1, 30))
        holder: dict = {}

        def run_request(request: FakeRequest, on_step, holder=holder):
            total = 0.0
            for step, (module_id, x) in enumerate(request.calls):
                if request.own_error_at == step:
                    raise InjectedError(f"{request.request_id}: its own error")
                total += holder["runtime"].call(module_id, (torch.tensor([x]),), {}).item()
                if step:  # the text encoder call is not a denoising step
                    time.sleep(rng.random() * 0.002)
                on_step(step + 1, len(request.calls))
            return total

        runtime = RankRuntime(
            run_request,
            rank=rank,
            slots=rng.randint(1, 3),
            modules=mods,
            exchange=exchange,
            patience_s=0.01,
            max_batch=rng.randint(1, 2),
        )
        holder["runtime"] = runtime
        runtimes.append(runtime)
        modules.append(mods)
    return runtimes, modules


def run_group(rng: random.Random, world_size: int, fault: str | None):
    """One group of ``world_size`` thread ranks running a random mix; returns what happened."""
    gather = FakeAllGather(world_size)
    runtimes, modules = build_ranks(rng, world_size, fault, gather)
    jobs: list[tuple[FakeRequest, object]] = []
    lock = threading.Lock()

    def submit(rank: int, request: FakeRequest) -> None:
        job = runtimes[rank].submit(request)
        with lock:
            jobs.append((request, job))

    # Some ranks start with work, some without (they ghost); more arrives while sessions run.
    for rank in range(world_size):
        for i in range(rng.randint(0, 3)):
            submit(rank, make_request(rng, f"r{rank}-early{i}", own_errors=True))
    late = [(rng.randrange(world_size), make_request(rng, f"late{i}", own_errors=True)) for i in range(4)]
    stop = threading.Event()
    failed: list[int] = []
    # The group's part: all ranks run sessions together, and stop together.
    decision = [False]
    between = threading.Barrier(world_size, action=lambda: decision.__setitem__(0, stop.is_set()))

    def rank_thread(rank: int) -> None:
        while True:
            try:
                runtimes[rank].session()
            except SessionFailedError:
                failed.append(rank)  # the group kills every rank
                gather.barrier.abort()
                between.abort()
                return
            try:
                between.wait()
            except threading.BrokenBarrierError:
                return
            if decision[0]:
                return
            time.sleep(0.001)  # idle between sessions, as the group is until work arrives

    def arrivals() -> None:
        for rank, request in late:
            time.sleep(rng.random() * 0.05)
            submit(rank, request)

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"fake-rank{r}") for r in range(world_size)]
    feeder = threading.Thread(target=arrivals)
    for t in [*threads, feeder]:
        t.start()
    feeder.join()
    deadline = time.monotonic() + DEADLINE_S
    while not all(job.done for _, job in list(jobs)) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    return runtimes, modules, jobs, failed, threads


@pytest.mark.parametrize("seed", range(60))
def test_every_call_and_request_completes_exactly_once(seed):
    rng = random.Random(seed)
    fault = [None, "forward", "ghost", "exchange"][seed % 4]
    world_size = rng.randint(2, 4)
    runtimes, modules, jobs, failed, threads = run_group(rng, world_size, fault)

    assert not any(t.is_alive() for t in threads), "a rank's tick thread hangs"
    assert all(job.done for _, job in jobs), [r.request_id for r, job in jobs if not job.done]
    # No thread left behind: every request thread ends (a failed rank refuses their next call).
    deadline = time.monotonic() + 10
    while any(rt.request_threads() for rt in runtimes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(rt.request_threads() for rt in runtimes)
    for mods in modules:
        assert all(call.done for call in mods.calls)
        assert not mods.wrong_results, mods.wrong_results

    session_failed = bool(failed)
    for request, job in jobs:
        if job.error is None:
            # A real result, never a made-up one: calls without an injected error return theirs.
            assert job.value == pytest.approx(request.expected()), request
            assert request.own_error_at is None
        elif isinstance(job.error, SessionFailedError):
            assert session_failed, (request, job.error)
        else:
            assert isinstance(job.error, InjectedError) and "its own error" in str(job.error)
            assert request.own_error_at is not None
    if not session_failed:
        # Lock step: every rank ran (or ghosted) the same modules in the same order.
        assert all(m.ran == modules[0].ran for m in modules), [m.ran for m in modules]
        assert any(job.error is None for _, job in jobs) or not jobs
    else:
        assert fault is not None
        assert all(rt.failure is not None for rt in runtimes)
        # A failed rank refuses new work at once, with the reason.
        refused = runtimes[failed[0]].submit(FakeRequest("after", ((0, 1.0),)))
        assert refused.done and isinstance(refused.error, SessionFailedError)


def test_a_forward_error_fails_every_request_of_the_rank_at_once():
    """Two ranks: a forward raises on rank 0; its requests, queued and running, fail within
    moments, and rank 1's session fails as soon as the group aborts the exchange."""
    gather = FakeAllGather(2)
    modules = [FakeModules(fail_forward_at=3), FakeModules()]
    holders: list[dict] = [{}, {}]

    def runner(holder):
        def run_request(request, on_step):
            total = 0.0
            for step, (module_id, x) in enumerate(request.calls):
                total += holder["runtime"].call(module_id, (torch.tensor([x]),), {}).item()
                on_step(step + 1, len(request.calls))
            return total

        return run_request

    runtimes = []
    for rank in range(2):
        runtime = RankRuntime(
            runner(holders[rank]), rank=rank, slots=2, modules=modules[rank], exchange=gather.for_rank(rank)
        )
        holders[rank]["runtime"] = runtime
        runtimes.append(runtime)
    long = tuple((1, 1.0) for _ in range(50))
    jobs = [runtimes[r].submit(FakeRequest(f"r{r}-{i}", long)) for r in range(2) for i in range(3)]
    errors: list[BaseException] = []

    def rank_thread(rank):
        try:
            runtimes[rank].session()
        except SessionFailedError as err:
            errors.append(err)
            gather.barrier.abort()

    started = time.monotonic()
    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(job.wait(5) for job in jobs)
    elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed
    assert all(isinstance(job.error, SessionFailedError) for job in jobs)
    assert "rank 0: the forward of transformer failed: InjectedError" in str(runtimes[0].failure)
    assert len(errors) == 2


def test_an_unsharded_runtime_runs_requests_without_ticks():
    def run_request(request, on_step):
        on_step(1, 1)
        if request.own_error_at is not None:
            raise InjectedError("its own error")
        return request.request_id.upper()

    runtime = RankRuntime(run_request, slots=2)
    jobs = [runtime.submit(FakeRequest(f"r{i}", ((0, 1.0),), 0 if i == 2 else None)) for i in range(5)]
    assert runtime.session() == 5
    assert [job.value for job in jobs if job.error is None] == ["R0", "R1", "R3", "R4"]
    assert isinstance(jobs[2].error, InjectedError)
    assert runtime.ticks == 0


def test_a_completion_takes_its_first_outcome_only():
    """Where "exactly once" lives: later outcomes are refused and callbacks fire once."""
    done = Completion()
    fired = []
    done.add_done_callback(fired.append)
    assert done.complete(1) and not done.complete(2) and not done.complete(error=InjectedError("late"))
    done.add_done_callback(fired.append)  # added after: fires at once
    assert fired == [done, done] and done.get() == 1


def test_a_cancel_that_overtakes_its_offer_stops_the_request():
    """The cancel reaches the rank before the request does (they come on different threads of the
    actor): the request is answered with the cancel's error when it arrives and never starts."""
    started = []

    def run_request(request, on_step):
        started.append(request.request_id)
        return 1

    runtime = RankRuntime(run_request, slots=1)
    assert runtime.cancel("early", InjectedError("cancelled early")) is False  # nothing held yet
    job = runtime.submit(FakeRequest("early", ((0, 1.0),)))
    other = runtime.submit(FakeRequest("other", ((0, 1.0),)))
    assert runtime.session() == 1
    assert isinstance(job.error, InjectedError) and "cancelled early" in str(job.error)
    assert started == ["other"] and other.value == 1


def test_a_lane_whose_leader_was_cancelled_before_its_offer_drops_the_request_on_every_rank():
    """A lane of 2: the follower has its offer, the leader's cancel came before the leader's offer.
    The leader asks the lane to stop the ticket, so the follower never waits for a start."""
    gather = FakeAllGather(2)
    runtimes = []
    for rank in range(2):
        holder: dict = {}

        def run_request(request, on_step, holder=holder):
            holder["runtime"].call(1, (torch.tensor([1.0]),), {})
            on_step(1, 1)
            return 1.0

        runtime = RankRuntime(run_request, rank=rank, modules=LaneModules(), exchange=gather.for_rank(rank))
        holder["runtime"] = runtime
        runtimes.append(runtime)
    request = FakeRequest("q", ((1, 1.0),))
    follower = runtimes[1].submit(request, ticket=lane_ticket(7, 0, 2))
    runtimes[0].cancel("q", InjectedError("cancelled"))
    leader = runtimes[0].submit(request, ticket=lane_ticket(7, 0, 2))
    threads = [threading.Thread(target=rt.session, daemon=True) for rt in runtimes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a rank still waits for the cancelled request"
    assert isinstance(leader.error, InjectedError) and follower.done and follower.error is not None
    assert runtimes[0].forwards == runtimes[1].forwards == 0


class LaneModules(FakeModules):
    """Fake modules that also log the keys (module, request) of the real forwards they ran."""

    def __init__(self):
        super().__init__()
        self.keys: list[int] = []

    def forward(self, calls: list[ForwardCall]) -> list:
        self.keys.extend(c.key for c in calls)
        return super().forward(calls)


def lane_runtimes(rng: random.Random, world_size: int, fails=lambda: set(), **options):
    """Thread ranks of lane tests, each with its ``LaneModules``: a request runs its calls, sleeps a
    little between them, stops when asked and, on the ranks whose ``fails()`` names it, fails
    halfway with an error of that rank alone. Returns the runtimes and their modules."""
    gather = FakeAllGather(world_size)
    runtimes, modules = [], []
    for rank in range(world_size):
        mods = LaneModules()
        holder: dict = {}
        fail_here = fails()

        def run_request(request: FakeRequest, on_step, holder=holder, fail_here=fail_here):
            total = 0.0
            for step, (module_id, x) in enumerate(request.calls):
                if request.request_id in fail_here and step == len(request.calls) // 2:
                    raise InjectedError(f"{request.request_id}: its own error on one rank")
                total += holder["runtime"].call(module_id, (torch.tensor([x]),), {}).item()
                time.sleep(rng.random() * 0.002)
                if on_step(step + 1, len(request.calls)):
                    raise InjectedError(f"{request.request_id}: stopped after step {step + 1}")
            return total

        runtime = RankRuntime(
            run_request,
            rank=rank,
            slots=rng.randint(1, 2),
            modules=mods,
            exchange=gather.for_rank(rank),
            patience_s=0.01,
            **options,
        )
        holder["runtime"] = runtime
        runtimes.append(runtime)
        modules.append(mods)
    return runtimes, modules


def run_lanes(runtimes: list, feed, jobs: list) -> None:
    """The group's part for the lane tests: every rank runs sessions, together, while ``feed``
    hands requests over; then waits for every job (the last item of each entry of ``jobs``, whose
    first two are the request and the rank), for every request thread to end, and stops the ranks
    together. Fails on anything left hanging."""
    stop = threading.Event()
    decision = [False]
    between = threading.Barrier(len(runtimes), action=lambda: decision.__setitem__(0, stop.is_set()))

    def rank_thread(rank: int) -> None:
        while True:
            runtimes[rank].session()
            between.wait()
            if decision[0]:
                return
            time.sleep(0.001)

    feeder = threading.Thread(target=feed)
    threads = [threading.Thread(target=rank_thread, args=(r,), daemon=True) for r in range(len(runtimes))]
    for t in [feeder, *threads]:
        t.start()
    feeder.join()
    deadline = time.monotonic() + DEADLINE_S
    while not all(entry[-1].done for entry in jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(entry[-1].done for entry in jobs), [(e[0].request_id, e[1]) for e in jobs if not e[-1].done]
    while any(rt.request_threads() for rt in runtimes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(rt.request_threads() for rt in runtimes), "a request thread hangs"
    stop.set()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in threads)


#: Seeds of the lane contract test: 30 in ``make test``; RAY_HSDP_LANE_SEEDS=800 for the long run.
LANE_SEEDS = int(os.environ.get("RAY_HSDP_LANE_SEEDS", "30"))


@pytest.mark.parametrize("seed", range(LANE_SEEDS))
def test_lanes_run_each_call_on_all_their_ranks_at_the_same_tick(seed):
    """Lanes of 2 ranks (2 or 3 lanes): each request runs on both ranks of its lane, offered to them
    at different moments; leaders cancel at random; a request fails on one rank only at random.
    Every request and call completes once, no thread hangs, both ranks of a lane ran exactly the
    same calls (by key) and a leader's uncancelled, unfailed request returns its real result."""
    rng = random.Random(1000 + seed)
    lanes, lane_size = rng.choice((2, 3)), 2
    world_size = lanes * lane_size
    # Each rank fails about a tenth of the requests alone.
    runtimes, modules = lane_runtimes(rng, world_size, lambda: {f"q{i}" for i in range(12) if rng.random() < 0.1})

    requests = [make_request(rng, f"q{i}", own_errors=False) for i in range(12)]
    jobs: list[tuple[FakeRequest, int, object]] = []
    cancelled: set[str] = set()

    def feed() -> None:
        for ticket, request in enumerate(requests):
            lane = rng.randrange(lanes)
            ranks = list(range(lane * lane_size, (lane + 1) * lane_size))
            lane_ticket_of = lane_ticket(ticket, ranks[0], lane_size)
            rng.shuffle(ranks)  # the ranks of a lane get their offers in any order
            for rank in ranks:
                jobs.append((request, rank, runtimes[rank].submit(request, lane_ticket_of)))
                time.sleep(rng.random() * 0.003)
            if rng.random() < 0.25:
                time.sleep(rng.random() * 0.01)
                # Only a cancel that answered the request counts: one that came after its end did not.
                if runtimes[lane * lane_size].cancel(request.request_id, InjectedError("cancelled")):
                    cancelled.add(request.request_id)

    run_lanes(runtimes, feed, jobs)
    for mods in modules:
        assert all(call.done for call in mods.calls)
        assert not mods.wrong_results, mods.wrong_results
    for lane in range(lanes):
        lead, follower = modules[lane * lane_size], modules[lane * lane_size + 1]
        assert lead.keys == follower.keys, (lane, lead.keys, follower.keys)
        assert lead.ran == follower.ran
    for request, rank, job in jobs:
        if rank % lane_size == 0 and job.error is None:
            assert job.value == pytest.approx(request.expected())
            assert request.request_id not in cancelled
        elif rank % lane_size:
            assert job.value is None  # followers never answer: the leader does


def test_a_lane_decodes_together_one_request_at_a_time_in_ticket_order():
    """Split decodes (``lane_decodes``): every rank of the lane goes on past the last step, and a
    rank enters a request's decode only once the requests it started before have ended, so the
    ranks of a lane meet in the same decode. Here the second request (1 step) ends its denoising
    while the first (2 steps) still decodes, on both ranks."""
    gather = FakeAllGather(2)
    runtimes, decodes = [], [[], []]
    for rank in range(2):
        holder: dict = {}

        def run_request(request: FakeRequest, on_step, holder=holder, log=decodes[rank]):
            total = 0.0
            for step, (module_id, x) in enumerate(request.calls):
                total += holder["runtime"].call(module_id, (torch.tensor([x]),), {}).item()
                if on_step(step + 1, len(request.calls)):
                    raise InjectedError(f"{request.request_id}: stopped")
            log.append((request.request_id, "begin", time.monotonic()))
            time.sleep(0.5 if request.request_id == "first" else 0.05)  # the decode
            log.append((request.request_id, "end", time.monotonic()))
            return total

        runtime = RankRuntime(
            run_request,
            rank=rank,
            slots=2,
            modules=LaneModules(),
            exchange=gather.for_rank(rank),
            patience_s=0.01,
            lane_decodes=lambda request: True,
        )
        holder["runtime"] = runtime
        runtimes.append(runtime)
    first, second = FakeRequest("first", ((1, 1.0), (1, 2.0))), FakeRequest("second", ((1, 3.0),))
    jobs = [rt.submit(first, ticket=lane_ticket(0, 0, 2)) for rt in runtimes]
    jobs += [rt.submit(second, ticket=lane_ticket(1, 0, 2)) for rt in runtimes]
    threads = [threading.Thread(target=rt.session, daemon=True) for rt in runtimes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    assert jobs[0].value == first.expected() and jobs[2].value == second.expected()  # the leader's answers
    for log in decodes:
        assert [(rid, event) for rid, event, _ in log] == [
            ("first", "begin"),
            ("first", "end"),
            ("second", "begin"),
            ("second", "end"),
        ]


@pytest.mark.parametrize("seed", range(LANE_SEEDS))
def test_lanes_of_one_two_and_four_ranks_run_side_by_side(seed):
    """Adaptive lanes' runtime: on 4 ranks, each request runs on a lane of its own size (1, 2 or 4
    aligned ranks, named by its ticket), offered to the lane's ranks in any order, with leaders
    cancelling at random. Every request and call completes once, nothing hangs, each request's
    calls ran on exactly its lane's ranks (the same keys in the same order on each), and a
    leader's uncancelled request returns its real result."""
    rng = random.Random(5000 + seed)
    world_size = 4
    # Calls of lanes of one rank may batch; a lane of several runs one call.
    runtimes, modules = lane_runtimes(rng, world_size, max_batch=2)

    requests = [make_request(rng, f"q{i}", own_errors=False) for i in range(14)]
    lanes = {}
    for request in requests:
        size = rng.choice((1, 2, 4))
        lanes[request.request_id] = list(range(world_size))[rng.randrange(world_size // size) * size :][:size]
    jobs: list[tuple[FakeRequest, int, int, object]] = []
    cancelled: set[str] = set()

    def feed() -> None:
        for sequence, request in enumerate(requests):
            ranks = lanes[request.request_id]
            ticket = lane_ticket(sequence, ranks[0], len(ranks))
            for rank in rng.sample(ranks, len(ranks)):
                jobs.append((request, rank, ticket, runtimes[rank].submit(request, ticket)))
                time.sleep(rng.random() * 0.003)
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.01)
                if runtimes[ranks[0]].cancel(request.request_id, InjectedError("cancelled")):
                    cancelled.add(request.request_id)

    run_lanes(runtimes, feed, jobs)
    for mods in modules:
        assert all(call.done for call in mods.calls) and not mods.wrong_results, mods.wrong_results
    for request, rank, ticket, job in jobs:
        ran = [[key for key in mods.keys if key % KEY_SPACE == ticket] for mods in modules]
        ranks = lanes[request.request_id]
        assert all(ran[r] == ran[ranks[0]] for r in ranks), (request.request_id, ranks, ran)
        assert not any(ran[r] for r in range(world_size) if r not in ranks), (request.request_id, ranks, ran)
        if rank == ranks[0] and job.error is None:
            assert job.value == pytest.approx(request.expected()) and request.request_id not in cancelled
        elif rank != ranks[0]:
            assert job.value is None  # followers never answer: the leader does


class WideningModules(LaneModules):
    """Lane modules that log each real forward's key with its tick's place in ``ran`` (every rank
    appends one module per tick that runs one), so that the ranks of a wider lane can be checked to
    run a widened forward at the same tick. A helper's call carries no inputs (the real modules
    broadcast them from the source rank); its output is dropped."""

    def __init__(self):
        super().__init__()
        self.at: list[tuple[int, int]] = []

    def forward(self, calls: list[ForwardCall]) -> list:
        self.at.append((len(self.ran), calls[0].key))
        if not calls[0].args:  # a helper's
            self.keys.append(calls[0].key)
            self.forwards += 1
            self.ran.append(calls[0].module_id)
            return [None]
        return super().forward(calls)


@pytest.mark.parametrize("seed", range(LANE_SEEDS // 3))
def test_widened_requests_run_their_forwards_with_their_helpers_at_the_same_ticks(seed):
    """Lane widening's runtime: on 4 ranks, requests on lanes of one and two ranks; some are widened
    at random moments (the other ranks of the aligned lane of 2 or 4 around theirs help, whatever
    those run themselves) and released at random moments or once they end; leaders cancel at
    random. Every request and call completes once, nothing hangs, a leader's uncancelled request
    returns its real result, and every forward a request ran on its wider lane ran on every rank of
    that lane at the same tick."""
    rng = random.Random(9000 + seed)
    plan = random.Random(seed)  # the feed's choices alone: the request threads draw from rng meanwhile
    world_size = 4
    runtimes, _ = lane_runtimes(rng, world_size)
    modules = [WideningModules() for _ in range(world_size)]
    for runtime, mods in zip(runtimes, modules):
        runtime.modules = mods
    requests = [make_request(rng, f"q{i}", own_errors=False) for i in range(12)]
    jobs: list[tuple[FakeRequest, int, object]] = []
    cancelled: set[str] = set()
    wide_tickets: dict[int, list[int]] = {}  # wider lane's ticket -> its ranks

    def feed() -> None:
        helping: dict[int, tuple[int, object]] = {}  # helper rank -> (ticket, the leader's job)
        for sequence, request in enumerate(requests):
            size = plan.choice((1, 2))
            ranks = list(range(plan.randrange(world_size // size) * size, world_size))[:size]
            ticket = lane_ticket(sequence, ranks[0], size)
            for rank in plan.sample(ranks, size):
                jobs.append((request, rank, runtimes[rank].submit(request, ticket)))
            leader = next(job for _, rank, job in jobs[-size:] if rank == ranks[0])
            for helper, (wide, job) in list(helping.items()):  # some helpers go back, done or not
                if plan.random() < 0.15 or job.done:
                    runtimes[helper].release(wide)
                    del helping[helper]
            wide_size = plan.choice((2, 4)) if size == 1 else 4
            lane = list(range(ranks[0] // wide_size * wide_size, ranks[0] // wide_size * wide_size + wide_size))
            helpers = [r for r in lane if r not in ranks]
            if plan.random() < 0.6 and not set(helpers) & set(helping):
                wide = widened(ticket, lane[0], wide_size)
                wide_tickets[wide] = lane
                for helper in helpers:
                    runtimes[helper].help(request, wide, ranks[0] - lane[0])
                    helping[helper] = (wide, leader)
            time.sleep(plan.random() * 0.02)
            if plan.random() < 0.2 and runtimes[ranks[0]].cancel(request.request_id, InjectedError("cancelled")):
                cancelled.add(request.request_id)
        while helping:  # the group gives every helper back once its request ends
            for helper, (wide, job) in list(helping.items()):
                if job.wait(0.01):
                    runtimes[helper].release(wide)
                    del helping[helper]
        for _, _, job in list(jobs):
            job.wait(DEADLINE_S)
        # One request surely widened, whatever the draws: rank 1 helps a lone request of rank 0 from its start.
        last = FakeRequest("widened", tuple((1, float(i)) for i in range(20)))
        home = lane_ticket(len(requests), 0, 1)
        wide = widened(home, 0, 2)
        wide_tickets[wide] = [0, 1]
        runtimes[1].help(last, wide, 0)
        jobs.append((last, 0, runtimes[0].submit(last, home)))
        jobs[-1][-1].wait(DEADLINE_S)
        runtimes[1].release(wide)

    run_lanes(runtimes, feed, jobs)
    for mods in modules:
        assert all(call.done for call in mods.calls) and not mods.wrong_results, mods.wrong_results
    for request, rank, job in jobs:
        if job.lane_first not in (None, rank):
            continue
        if request.request_id not in cancelled:  # no fault is injected here: every other request succeeds
            assert job.error is None, (request.request_id, job.error)
        if job.error is None:
            assert job.value == pytest.approx(request.expected()) and request.request_id not in cancelled
    assert wide_tickets, "no request was widened"
    widened_forwards = 0
    for wide, lane in wide_tickets.items():
        ran = [[(at, key) for at, key in modules[r].at if key % KEY_SPACE == wide] for r in lane]
        assert all(forwards == ran[0] for forwards in ran), (wide, lane, ran)
        widened_forwards += len(ran[0])
    assert widened_forwards > 0, "no forward ran on a wider lane"


def test_a_help_that_overtakes_the_release_of_the_one_before_replaces_it():
    """The group releases a rank's help before it asks for the next, but Ray runs the two calls on a
    rank's threaded control group in either order: a help that comes first replaces the one before,
    and the late release of that one changes nothing. The rank then helps the newer request."""
    runtimes, _ = lane_runtimes(random.Random(5), 2)
    modules = [WideningModules() for _ in range(2)]
    for runtime, mods in zip(runtimes, modules):
        runtime.modules = mods
    earlier = widened(lane_ticket(0, 0, 1), 0, 2)
    request = FakeRequest("newer", tuple((1, float(i)) for i in range(10)))
    home = lane_ticket(1, 0, 1)
    wide = widened(home, 0, 2)
    jobs = []

    def feed() -> None:
        runtimes[1].help(FakeRequest("earlier", ((1, 0.0),)), earlier, 0)
        runtimes[1].help(request, wide, 0)  # before the release of the earlier help
        runtimes[1].release(earlier)
        jobs.append((request, 0, runtimes[0].submit(request, home)))
        jobs[-1][-1].wait(DEADLINE_S)
        runtimes[1].release(wide)

    run_lanes(runtimes, feed, jobs)
    assert jobs[0][-1].value == pytest.approx(request.expected())
    helped = [key for _, key in modules[1].at if key % KEY_SPACE == wide]
    assert helped and helped == [key for _, key in modules[0].at if key % KEY_SPACE == wide]
