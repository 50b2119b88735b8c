"""The replica (``HSDPServer``) against a small fake engine, through its engine factory: its request
path, its errors and its cancel, with no Ray ranks, no model and no Serve.

Outside Serve, the test takes the deployment's undecorated class (``HSDPServer.func_or_class``) and
stands in for what Serve gives a replica: its context (``serve.get_replica_context``: its id, its
application) and its placement group (none). The constructor runs on an event loop, as Serve runs it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gc
import inspect
import io
from concurrent.futures import Future

import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.context import ReplicaContext

from ray_hsdp.config.app import AppConfig
from ray_hsdp.group import Engine, GroupFailedError
from ray_hsdp.phases import Phases
from ray_hsdp.request import GenerationRequest, GenerationResult, InvalidRequestError, RequestCancelledError
from ray_hsdp.serve.errors import error_response
from ray_hsdp.serve.replica.server import HSDPServer

# Python's collector calls the deployment's async ``__del__`` too, making a coroutine no one awaits
# (Serve awaits its own call; the tests await theirs).
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'HSDPServer.__del__' was never awaited:RuntimeWarning")

REPLICA = "fake-replica"
#: The tiny model's fields, as the app builder passes them; no metrics poll or takeover runs meanwhile.
CONFIG = {"model": "tiny", "device": "cpu", "metrics_interval_s": 3600.0, "video_takeover_after_s": None}
MODEL = AppConfig(**CONFIG).served_model_name
#: The prompt the fake engine refuses at its check.
REFUSED = "a prompt this engine refuses"


@dataclasses.dataclass(frozen=True)
class FakeVariant:
    """What the fake's ``check`` makes of a request (the group's ``RequestVariant`` carries it too)."""

    request: GenerationRequest


class FakeEngine:
    """An engine of no GPUs: it holds what it is given, and a test answers, fails or cancels each
    request. Built as the replica builds ``ShardGroup`` (``EngineFactory``)."""

    def __init__(self, config: AppConfig, *, placement_group, dims, labels: dict[str, str], shares_gpus: bool):
        self.config, self.labels, self.shares_gpus = config, labels, shares_gpus
        self.group_id = f"fake-{len(BUILT)}"
        self.listeners: list = []
        self.pipeline_facts: dict = {"video": False, "image_input": False}
        self.ranks: list = []
        self.placement: list[dict] = []
        self.warm_up_stats: list[dict] = []
        self.phases = Phases(self.group_id)
        self.started: bool | None = None  # its start's warm_up argument, once started
        self.submitted: list[GenerationRequest] = []
        self.running: dict[str, Future] = {}
        self.cancelled: list[str] = []
        self.shut_down = False
        self._failure: str | None = None
        BUILT.append(self)

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def mending(self) -> bool:
        return False

    def start(self, warm_up: bool = True) -> FakeEngine:
        self.started = warm_up
        return self

    def warm_up(self, requests, follow=None) -> None:
        raise AssertionError("the tiny config warms no shapes")

    def check(self, request: GenerationRequest) -> FakeVariant:
        if request.prompt == REFUSED:
            raise InvalidRequestError("prompt: this engine refuses it")
        return FakeVariant(request)

    def submit(self, request) -> Future:
        request = request.request if isinstance(request, FakeVariant) else request
        future: Future = Future()
        self.submitted.append(request)
        self.running[request.request_id] = future
        return future

    def answer(self, request_id: str, pixel: int) -> GenerationResult:
        """Answers a request with one image of one colour (``pixel`` in every channel)."""
        request = next(r for r in self.submitted if r.request_id == request_id)
        frames = np.full((1, 1, request.height, request.width, 3), pixel, dtype=np.uint8)
        result = GenerationResult(frames=frames, seed=request.seed, rank=0, elapsed_s=0.5, request_id=request_id)
        self.running.pop(request_id).set_result(result)
        return result

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        future = self.running.pop(request_id, None)
        if future is not None:
            future.set_exception(RequestCancelledError(f"request {request_id!r} was cancelled"))
        return future is not None

    def fail(self, reason: str) -> None:
        self._failure = reason
        for future in self.running.values():
            future.set_exception(GroupFailedError(reason))
        self.running.clear()

    def shutdown(self) -> None:
        self.shut_down = True
        self.fail(self._failure or "shut down")

    def load(self) -> tuple[int, int]:
        return 0, len(self.running)

    def idle_lanes(self) -> int:
        return 0 if self.running else 1

    def progress(self) -> dict[str, dict]:
        return {rid: {"state": "running", "step": 0, "total": 1} for rid in self.running}

    def describe(self) -> dict:
        return {"group_id": self.group_id, "device": "cpu"}

    def memory(self, units: bool = False) -> list[dict]:
        return []

    def tick_stats(self) -> list[dict]:
        return []

    def check_health(self, timeout_s: float = 30.0) -> None:
        if self._failure:
            raise GroupFailedError(self._failure)


#: The engines the factory built, in order (a rebuild builds another).
BUILT: list[FakeEngine] = []


@pytest.fixture
def outside_serve(monkeypatch):
    """What Serve gives a replica: its context, and no placement group of its own."""
    BUILT.clear()
    replica_id = ReplicaID(REPLICA, DeploymentID(name="HSDPServer", app_name="fake"))
    context = ReplicaContext(
        replica_id=replica_id, servable_object=None, _deployment_config=None, rank=None, world_size=1
    )
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)


def with_server(test):
    """Runs ``test(server)`` on an event loop against a replica of the fake engine, then removes
    the replica as Serve does (its ``__del__``)."""

    async def run():
        dims = AppConfig(**CONFIG).parallel_dims()
        server = HSDPServer.func_or_class(CONFIG, dims, shapes_checked=True, engine_factory=FakeEngine)
        try:
            await test(server)
        finally:
            await server.__del__()

    asyncio.run(run())
    gc.collect()  # the replica, in a cycle with its keeper: collected here, under this module's warning filter


async def submitted(engine: FakeEngine, count: int = 1) -> None:
    """Waits until ``engine`` holds ``count`` requests (the replica hands them over on its loop)."""
    async with asyncio.timeout(10):
        while len(engine.submitted) < count:
            await asyncio.sleep(0.01)


def body(prompt: str = "a red fox", seed: int = 7) -> dict:
    return {"prompt": prompt, "size": "32x16", "seed": seed}


def test_the_fake_is_an_engine_and_the_replica_builds_and_starts_it_through_its_factory(outside_serve):
    for name, member in vars(Engine).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            assert list(inspect.signature(getattr(FakeEngine, name)).parameters) == list(
                inspect.signature(member).parameters
            ), name

    async def test(server):
        (engine,) = BUILT
        assert isinstance(engine, Engine)
        assert engine.labels == {"replica": REPLICA} and engine.shares_gpus is False
        assert engine.started is True  # no warm-up shapes: the engine's own start warms it
        assert engine.listeners == [server.state.metrics.request_done]
        assert server.health() == "ready" and server.record_routing_stats()["group_ok"] is True
        assert server.describe() == {
            "id": MODEL, "object": "model", "owned_by": "ray_hsdp", "kind": "image", "input": "text",
        }  # fmt: skip
        assert not engine.shut_down

    with_server(test)
    assert BUILT[0].shut_down  # the replica's removal shut its engine down


def test_a_request_is_answered_once_with_the_engines_result_and_a_retry_joins_its_run(outside_serve):
    async def test(server):
        (engine,) = BUILT
        first = asyncio.create_task(server.generate(body(), request_id="r1"))
        await submitted(engine)
        # The ingress' retry after Ray lost sight of this replica: the same id joins the run.
        retry = asyncio.create_task(server.generate(body(), request_id="r1"))
        await asyncio.sleep(0.1)
        engine.answer("r1", pixel=200)
        answers = await asyncio.gather(first, retry)
        assert [r.request_id for r in engine.submitted] == ["r1"]
        for answer in answers:
            assert answer["id"] == "r1" and answer["seed"] == 7 and answer["model"] == MODEL
            (image,) = answer["data"]
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(image["b64_json"]))))
            assert pixels.shape == (16, 32, 3) and (pixels == 200).all()
        assert server.requests.held == {} and engine.cancelled == []

    with_server(test)


def test_a_request_the_engine_refuses_at_check_is_the_clients_error_and_never_runs(outside_serve):
    async def test(server):
        (engine,) = BUILT
        with pytest.raises(InvalidRequestError, match="this engine refuses it") as refused:
            await server.generate(body(REFUSED), request_id="r2")
        assert engine.submitted == []
        assert error_response(refused.value, 5).status_code == 400

    with_server(test)


def test_an_engine_failure_is_the_servers_error_naming_the_replica_for_the_retry(outside_serve):
    async def test(server):
        (engine,) = BUILT
        failed = asyncio.create_task(server.generate(body(), request_id="r3"))
        crashed = asyncio.create_task(server.generate(body(seed=8), request_id="r4"))
        await submitted(engine, 2)
        engine.running.pop("r4").set_exception(RuntimeError("the pipeline crashed"))
        engine.fail("a rank died")
        with pytest.raises(GroupFailedError, match="a rank died") as lost:
            await failed
        assert lost.value.replica == REPLICA  # what the ingress' retry avoids
        with pytest.raises(RuntimeError, match="the pipeline crashed") as crash:
            await crashed
        assert error_response(lost.value, 5).status_code == 503
        assert error_response(crash.value, 5).status_code == 500

    with_server(test)


def test_a_failed_engine_is_rebuilt_through_the_factory_and_serves_the_next_request(outside_serve):
    async def test(server):
        BUILT[0].fail("a rank died")
        call = asyncio.create_task(server.generate(body(), request_id="r5"))
        async with asyncio.timeout(10):
            while len(BUILT) < 2 or not BUILT[1].submitted:
                await asyncio.sleep(0.01)
        first, rebuilt = BUILT
        assert first.shut_down and first.submitted == [] and rebuilt.started is True
        rebuilt.answer("r5", pixel=9)
        assert (await call)["id"] == "r5"
        assert server.state.keeper.rebuilds == 1 and server.group is rebuilt

    with_server(test)


def test_a_caller_that_goes_away_cancels_its_request_on_the_engine(outside_serve):
    async def test(server):
        (engine,) = BUILT
        call = asyncio.create_task(server.generate(body(), request_id="r6"))
        await submitted(engine)
        call.cancel()  # the ingress' call is cancelled: its client disconnected
        with pytest.raises(asyncio.CancelledError):
            await call
        assert engine.cancelled == ["r6"] and "r6" not in engine.running
        assert "r6" in server.state.cancelled and server.requests.held == {}

    with_server(test)
