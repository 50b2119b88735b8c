"""The request variant: every per-request choice of one accepted request, in one object.

A variant is built once, where a request reaches its group (``RequestVariant.build``: each
feature reads and checks its field; a refusal is an ``InvalidRequestError`` naming the field),
takes the request's ticket when a lane takes it, travels to the lane's ranks, and is what their
request threads and tick thread read: the pipeline's keyword arguments, what wraps the request's
pipeline call, what wraps each of its forwards on the tick thread, what is released when it ends.
A request that asks for nothing carries no choice; the rank's features still put their defaults
on around its forwards (no adapter, no step cache), since a module serves several requests.

The features, one module each: ``adapters``, ``step_cache``, ``solver`` (and the sigmas), ``shift``, ``guidance``
(both experts' choices), ``image``;
``lane`` checks that the request's tokens split over its lane.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ray_hsdp.config.pairs import refuse_request
from ray_hsdp.request import GenerationRequest
from ray_hsdp.variant.adapters import AdapterFeature
from ray_hsdp.variant.base import Feature, RankFeatures
from ray_hsdp.variant.guidance import ExpertBoundary, SecondExpertGuidance
from ray_hsdp.variant.image import FirstFrame
from ray_hsdp.variant.lane import LaneFeature, check_split, runnable_sizes, work_of
from ray_hsdp.variant.shift import ShiftFeature
from ray_hsdp.variant.solver import SigmasFeature, SolverFeature
from ray_hsdp.variant.step_cache import StepCacheFeature

#: Every per-request feature, in the order their parts are checked and entered.
FEATURES: tuple[Feature, ...] = (
    AdapterFeature(),
    StepCacheFeature(),
    SolverFeature(),  # before the shift: a request's flow_shift shifts the solver it chose
    ShiftFeature(),
    SigmasFeature(),  # after both: it sets the schedule of the scheduler they made
    SecondExpertGuidance(),
    ExpertBoundary(),
    FirstFrame(),
    LaneFeature(),
)


@dataclass(frozen=True)
class RequestVariant:
    """One accepted request and its per-request choices.

    Attributes:
        request: The request as the group accepted it.
        choices: Feature field -> the request's choice, for the features it asked something of.
        ticket: The group's number for it, given when a lane takes it (the same on the lane's
            ranks; it names the lane, ``ray_hsdp.protocol.lane_ticket``); step caches key
            the request's state by it. -1 until then.
        lane_sizes: In a group of adaptive lanes, the lane sizes that split its tokens (those it
            may be given); empty for a group of fixed lanes.
        work: Its tokens times its denoising steps (0 when the pipeline's token grid is unknown):
            what the group keeps its measured run times by (``group.lanes.LaneTimes``).
    """

    request: GenerationRequest | None
    choices: Mapping[str, Any] = field(default_factory=dict)
    ticket: int = -1
    lane_sizes: tuple[int, ...] = ()
    work: int = 0

    @classmethod
    def build(cls, request: GenerationRequest, config, facts: Mapping[str, Any]) -> RequestVariant:
        """Reads and checks every per-request choice of ``request`` for a group of ``config``
        whose pipeline has ``facts`` (``ShardedPipeline.facts``).

        Raises:
            InvalidRequestError: A pair of the table of refusals, or a feature's field the group
                cannot run (the message names the field and what to send instead).
        """
        refuse_request(config, facts, request)
        choices = {}
        for feature in FEATURES:
            choice = feature.choose(request, config, facts)
            if choice is not None:
                choices[feature.field] = choice
        if not config.lane_sizes:
            check_split(request, facts)
        return cls(request, choices, lane_sizes=runnable_sizes(request, config, facts), work=work_of(request, facts))

    @classmethod
    def unchecked(cls, request: GenerationRequest, ticket: int = 0) -> RequestVariant:
        """The variant of a request run without a group (a pipeline or runtime driven directly):
        its fields taken as they are."""
        choices = {f.field: getattr(request, f.field) for f in FEATURES if getattr(request, f.field) not in (None, ())}
        return cls(request, choices, ticket)

    def with_ticket(self, ticket: int) -> RequestVariant:
        return dataclasses.replace(self, ticket=ticket)

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request is not None else ""

    @property
    def num_inference_steps(self) -> int:
        return self.request.num_inference_steps

    @property
    def batch_key(self) -> Hashable:
        """What a forward's calls must share to run as one batch (a request without choices: ())."""
        keys = ((f.field, f.batch_key(self.choices[f.field], self.ticket)) for f in FEATURES if f.field in self.choices)
        return tuple((name, key) for name, key in keys if key is not None)

    def pipeline_kwargs(self) -> dict:
        kwargs: dict = {}
        for feature in FEATURES:
            if feature.field in self.choices:
                kwargs.update(feature.pipeline_kwargs(self.choices[feature.field]))
        return kwargs

    @contextmanager
    def run(self, pipe, features: RankFeatures) -> Iterator[None]:
        """Around the request's pipeline call, on its request thread (``release`` follows it)."""
        with ExitStack() as stack:
            for feature in FEATURES:
                stack.enter_context(feature.around_run(self.choices.get(feature.field), pipe, features))
            yield

    @contextmanager
    def forward(self, module, context, features: RankFeatures) -> Iterator[None]:
        """Around one forward of ``module`` for this request, on the thread that runs it.

        Args:
            context: The ``(name, kwargs)`` of the pipeline's ``cache_context`` around the call.
        """
        with ExitStack() as stack:
            for feature in FEATURES:
                choice = self.choices.get(feature.field)
                stack.enter_context(feature.around_forward(choice, self.ticket, module, context, features))
            yield

    def release(self, features: RankFeatures) -> dict:
        """Drops what the rank keeps for this request; the result fields the features add."""
        out: dict = {}
        for feature in FEATURES:
            out.update(feature.release(self.choices.get(feature.field), self.ticket, features))
        return out


#: The variant of a forward outside any request: every feature at its default.
NO_REQUEST = RequestVariant(None)
