"""A model replica's place in its GPU share (``gpu_share``): where its group places its ranks, the
room its group's load waits for, the lease each request holds while it runs (a request for a
sleeping model waits here while the model wakes), and the model's state on the share."""

from __future__ import annotations

import asyncio
import time

import ray

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import QueueTimeoutError, ShardGroup
from ray_hsdp.group.residency import reserve_host
from ray_hsdp.serve.gpu_share import open_share

#: How long a replica waits for the share's placement group (its GPUs) to be placed.
PLACEMENT_WAIT_S = 600.0


class ShareMember:
    """One model's membership of its GPU share.

    Args:
        config: The model's configuration (``gpu_share`` set).
        dims: Its mesh arithmetic: the share's bundles are its group's.
    """

    def __init__(self, config: AppConfig, dims: ParallelDims):
        self.model = config.served_model_name
        self.resident = config.resident
        self.timeout_s = config.load_timeout_s
        budget = int(config.gpu_share_budget_gib * 2**30) if config.gpu_share_budget_gib is not None else None
        self.actor = open_share(config.gpu_share, dims.bundles(config.device, config.cpus_per_rank), budget)
        #: The share's placement group: the model's group places its ranks there, beside the other models'.
        self.placement = ray.get(self.actor.placement_group.remote(PLACEMENT_WAIT_S), timeout=PLACEMENT_WAIT_S + 10)

    def start(self, build) -> ShardGroup:
        """Starts the model's group with ``build`` once the share made room for its load, then
        reserves its ranks' host buffers (a sleep's) and tells the share what it holds.

        Raises:
            MemoryError: A rank's node lacks the host memory its weights need asleep.
        """
        ray.get(self.actor.join.remote(self.model, self.resident), timeout=self.timeout_s)
        group = None
        try:
            group = build()
            reserved = reserve_host(group.ranks, self.timeout_s)
            node = group.placement[0]["node_ip"] if group.placement else ""
            ray.get(self.actor.ready.remote(self.model, group.ranks, node, reserved["bytes"]), timeout=60)
        except BaseException:
            ray.get(self.actor.forget.remote(self.model), timeout=60)
            if group is not None:
                group.shutdown()
            raise
        return group

    async def enter(self, lease: str, deadline: float) -> dict:
        """Returns once the model is awake (woken here if it slept), holding it awake until
        ``leave(lease)``.

        Returns:
            ``woke`` and, if it did, ``wake_s``.

        Raises:
            QueueTimeoutError: It was not awake by ``deadline`` (``time.time()``).
            WakeFailedError: Its group could not be woken (the caller fails the group: it is rebuilt).
        """
        call = self.actor.enter.remote(self.model, lease)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                return await call
        except TimeoutError:
            self.leave(lease)
            raise QueueTimeoutError(
                f"{self.model} was still waking at the request's deadline (its GPU share's other models held their "
                "GPUs with work in flight)"
            ) from None
        except asyncio.CancelledError:
            self.leave(lease)
            raise

    def leave(self, lease: str) -> None:
        """The request ``lease`` was answered (or given up): the model may sleep once none holds it."""
        self.actor.leave.remote(self.model, lease)

    def state(self, timeout_s: float = 5.0) -> dict:
        """The model's entry of the share's states (``GpuShare.states``)."""
        return ray.get(self.actor.states.remote(), timeout=timeout_s).get(self.model, {"state": "joining"})

    def forget(self) -> None:
        """The replica stops: the model leaves the share."""
        try:
            ray.get(self.actor.forget.remote(self.model), timeout=10)
        except Exception:  # noqa: BLE001 - a share that is gone holds nothing of it
            pass
