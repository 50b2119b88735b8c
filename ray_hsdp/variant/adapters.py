"""A request's LoRA adapters (``lora``): checked against the group's registered ones, selected on
the rank around each of the request's forwards (or once per request on an unsharded rank)."""

from __future__ import annotations

from contextlib import contextmanager

from ray_hsdp.request import InvalidRequestError
from ray_hsdp.variant.base import Feature, RankFeatures


class AdapterFeature(Feature):
    field = "lora"

    def choose(self, request, config, facts):
        if not request.lora:
            return None
        if len(request.lora) > config.max_loras_per_request:
            raise InvalidRequestError(
                f"{len(request.lora)} adapters in one request; max_loras_per_request={config.max_loras_per_request}"
            )
        unknown = [name for name, _ in request.lora if name not in config.loras]
        if unknown:
            switched = sorted(config.lora_sources(fused=False))
            known = ", ".join(switched) or "none (the deployment registers no loras)"
            names = ", ".join(map(repr, unknown))
            raise InvalidRequestError(f"unknown lora {names}; this deployment's adapters: {known}")
        return tuple(request.lora)

    def batch_key(self, choice, ticket):
        return choice

    @contextmanager
    def around_run(self, choice, pipe, features: RankFeatures):
        if features.adapters is not None and not features.adapters_per_forward:
            features.adapters.select(choice or ())
        yield

    @contextmanager
    def around_forward(self, choice, ticket, module, context, features: RankFeatures):
        # Every forward selects: the module ran another request's adapters (or none) before.
        if features.adapters is not None and features.adapters_per_forward and features.adapters.adapts(module):
            features.adapters.select(choice or ())
        yield
