"""The engine interface: what a Serve replica (``ray_hsdp.serve.replica``) calls on the engine it
serves, and ``ShardGroup`` implements. Ray Serve LLM puts the same seam between its server and its
engine: the replica depends on these members alone, so another engine (a small fake in a test, a
future engine) can stand behind it, and the group runs without Serve.

The members are ``ShardGroup``'s own (``tests/test_engine.py`` holds the two to the same names
and parameters): see each one's docstring there for the contract in full."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from ray_hsdp.phases import Phases
from ray_hsdp.request import GenerationRequest, GenerationResult


@runtime_checkable
class Engine(Protocol):
    """A started engine of one model on its GPUs, as a replica sees it."""

    #: The engine's id in logs and metrics.
    group_id: str
    #: Called once per answered request with its record (a replica's metrics).
    listeners: list[Callable[[Any], None]]
    #: Facts of the loaded pipeline (``ShardedPipeline.facts``): image input, experts, video, ...
    pipeline_facts: dict
    #: The ranks' actor handles, and where each runs (node, GPU): for a GPU share's memory moves.
    ranks: list
    placement: list[dict]
    #: Each rank's counters once its warm-up ran (``tick_stats`` then).
    warm_up_stats: list[dict]
    #: Seconds per phase of its start.
    phases: Phases

    @property
    def failure(self) -> str | None:
        """Why it failed, or None while it serves."""

    @property
    def mending(self) -> bool:
        """Whether a lost rank is being replaced (requests wait meanwhile)."""

    def start(self, warm_up: bool = True) -> Engine:
        """Places, loads and starts it; returns itself."""

    def warm_up(
        self,
        requests: Sequence[GenerationRequest],
        follow: Callable[[GenerationRequest, GenerationResult], None] | None = None,
    ) -> None:
        """Runs ``requests`` before any client's (their shapes compiled, their kernels chosen)."""

    def check(self, request: GenerationRequest) -> Any:
        """The request's variant, or the ``InvalidRequestError`` that refuses it."""

    def submit(self, request: Any) -> Future:
        """Queues a request, or the variant ``check`` made of it; the future resolves exactly once,
        to its result or its error."""

    def cancel(self, request_id: str) -> bool:
        """Cancels a queued or running request."""

    def fail(self, reason: str) -> None:
        """Marks it failed from outside: its requests fail with ``reason``."""

    def shutdown(self) -> None:
        """Fails what it holds and gives its GPUs back; safe to call more than once."""

    def load(self) -> tuple[int, int]:
        """``(queued, running)`` requests."""

    def idle_lanes(self) -> int:
        """Lanes where a request would start at once and alone."""

    def progress(self) -> dict[str, dict]:
        """Request id -> its state (queued, or running: rank, lane, step)."""

    def describe(self) -> dict:
        """Its topology: sizes, mode, device, where each rank runs."""

    def memory(self, units: bool = False) -> list[dict]:
        """Each rank's memory report."""

    def tick_stats(self) -> list[dict]:
        """Each rank's counters."""

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Raises unless every rank answers within ``timeout_s``."""
