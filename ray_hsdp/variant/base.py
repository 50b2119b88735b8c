"""What every per-request feature is: a field of the request, read and checked once, and what its
choice does on a rank (``ray_hsdp.variant``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ray_hsdp.request import GenerationRequest


@dataclass
class RankFeatures:
    """What a rank loaded for the per-request features, which a variant's choices apply to.

    Attributes:
        adapters: The switched LoRA adapters in its transformers (``ray_hsdp.loading.adapters.Adapters``);
            ``None``: none registered.
        adapters_per_forward: Whether the adapters are selected around each forward (on the tick
            thread of a sharded rank) rather than once per request (an unsharded rank, which runs
            one request at a time).
        step_caches: The step caches of its sharded modules (``ray_hsdp.sharding.step_cache.StepCaches``);
            ``None``: the group loaded none.
        lane_parallel: In a group of adaptive lanes, what switches its models' context parallel to
            the lane of the forward that runs (``ray_hsdp.sharding.context_parallel.LaneParallel``).
    """

    adapters: Any = None
    adapters_per_forward: bool = True
    step_caches: Any = None
    lane_parallel: Any = None


class Feature:
    """One per-request feature: how a request's choice of it is read and checked, and what the
    choice does on a rank. ``choice`` is ``None`` where the request asked nothing of it."""

    #: The ``GenerationRequest`` field it reads.
    field: str = ""

    def choose(self, request: GenerationRequest, config, facts: Mapping[str, Any]) -> Any:
        """The request's choice (``None``: it asks nothing); raises ``InvalidRequestError`` naming
        the field when the group cannot run it."""
        return getattr(request, self.field)

    def batch_key(self, choice: Any, ticket: int) -> Hashable:
        """What of the choice a forward's calls must share to run as one batch; ``None``: the
        choice does not change a forward (an input of the pipeline call only)."""
        return None

    def pipeline_kwargs(self, choice: Any) -> dict:
        """Keyword arguments of the pipeline call."""
        return {}

    def around_run(self, choice: Any, pipe, features: RankFeatures) -> ContextManager:
        """Entered on the request thread around the pipeline call, on the request's pipeline slot."""
        return nullcontext()

    def around_forward(self, choice: Any, ticket: int, module, context, features: RankFeatures) -> ContextManager:
        """Entered on the thread that runs a forward of one of the request's sharded modules."""
        return nullcontext()

    def release(self, choice: Any, ticket: int, features: RankFeatures) -> dict:
        """Called once the request ended on the rank; what it adds to the result's fields."""
        return {}


@contextmanager
def scheduler_for_the_run(pipe, make: Callable[[Any], Any]) -> Iterator[None]:
    """``pipe``'s scheduler replaced by ``make(its own)`` around a request's pipeline call (on the
    request's own pipeline slot), and its own back afterwards: how a request's solver, shift and
    sigmas take effect."""
    scheduler = pipe.scheduler
    pipe.scheduler = make(scheduler)
    try:
        yield
    finally:
        pipe.scheduler = scheduler
