"""Health per model, as the ingress sees it: each model's state (``loading``, ``ready``,
``degraded``) from a check of one of its groups every ``CHECK_EVERY_S``, kept here so that
``/health`` and ``/v1/models`` answer at once, from the ingress' first moment, whatever any model's
groups are doing (starting, warming up, rebuilding)."""

from __future__ import annotations

import asyncio
import logging
import time

from ray_hsdp.group import remote_cause

logger = logging.getLogger("ray_hsdp")

#: How often the ingress checks each model, and how long one check may take (a group that is
#: starting or warming up does not answer: its model is loading, or degraded).
CHECK_EVERY_S = 1.0
CHECK_TIMEOUT_S = 5.0

#: The states of a model (``/v1/models``' ``state``, an extension field).
LOADING, READY, DEGRADED = "loading", "ready", "degraded"
#: A model of a GPU share answers requests in these states too: asleep, a request waits while it wakes.
SHARE_SERVING = ("sleeping", "waking", "parking")


class ModelWatch:
    """The state of each model of an endpoint, and its ``/v1/models`` entry once a group told it.

    Args:
        servers: Model id -> the handle of its group deployment.
    """

    def __init__(self, servers: dict):
        self.servers = servers
        self.states = {model: LOADING for model in servers}
        self.errors: dict[str, str] = {}  # model -> why its last check failed (for callers with the key)
        self.checked_at: dict[str, float] = {}
        self.descriptions: dict[str, dict] = {}

    def entry(self, model: str) -> dict:
        """The model's ``/v1/models`` entry: its group's description once known, and its state."""
        known = self.descriptions.get(model, {"id": model, "object": "model", "owned_by": "ray_hsdp"})
        return {**known, "state": self.states[model]}

    def healthy(self, model: str | None = None) -> bool:
        """Whether ``model`` has a ready group, or (none named) whether the endpoint can answer for
        a model at all: one model at least has one. One model's outage (a rebuild, a restart, its
        application deleted) is that model's alone: a load balancer that drained the endpoint for
        it would drain the models that serve."""
        serving = (READY, *SHARE_SERVING)
        if model is not None:
            return self.states[model] in serving
        return any(state in serving for state in self.states.values())

    async def run(self) -> None:
        """Checks every model, each on its own, until cancelled."""
        await asyncio.gather(*(self._watch(model) for model in self.servers))

    async def _watch(self, model: str) -> None:
        while True:
            await self.check(model)
            await asyncio.sleep(CHECK_EVERY_S)

    async def check(self, model: str) -> None:
        """One check: a group of the model answers its health (every rank within its deadline)."""
        handle = self.servers[model]
        call = handle.health.remote()
        try:
            answer = await asyncio.wait_for(call, CHECK_TIMEOUT_S)
            if model not in self.descriptions:
                self.descriptions[model] = await asyncio.wait_for(handle.describe.remote(), CHECK_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the state says it; the error is kept for callers with the key
            call.cancel()
            cause = remote_cause(err)
            if isinstance(cause, asyncio.TimeoutError):
                why = f"no group answered within {CHECK_TIMEOUT_S:g}s (none runs yet, or all are starting)"
            else:
                why = f"{type(cause).__name__}: {cause}"
            self.errors[model] = why
            if self.states[model] == READY:
                logger.warning("Model %s is degraded: %s", model, self.errors[model])
                self.states[model] = DEGRADED
        else:
            self.errors.pop(model, None)
            # A model of a GPU share says its state there; it serves asleep too (a request wakes it).
            self.states[model] = answer if answer in SHARE_SERVING else READY
        self.checked_at[model] = time.time()
