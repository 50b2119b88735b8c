"""A model replica's place in its GPU share (``gpu_share``): where its group places its ranks, the
room its group's load waits for, the lease each request holds while it runs (a request for a
sleeping model waits here while the model wakes), and the model's state on the share."""

from __future__ import annotations

import asyncio
import time
import uuid

import ray

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group import Engine, QueueTimeoutError
from ray_hsdp.group.residency import reserve_host
from ray_hsdp.serve.replica.gpu_share import open_share

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
        #: The share's key of the model's current group (``model/id``): each start has its own.
        self.key: str | None = None
        #: The share's placement group: the model's group places its ranks there, beside the other models'.
        self.placement = ray.get(self.actor.placement_group.remote(PLACEMENT_WAIT_S), timeout=PLACEMENT_WAIT_S + 10)

    def start(self, build) -> Engine:
        """Starts the model's group with ``build`` once the share made room for its load (the
        group it replaces, if any, forgotten first: a rebuild shut it down), then reserves its
        ranks' host memory (a sleep's) and tells the share what it holds.

        Raises:
            MemoryError: A node lacks the host memory its ranks' weights need asleep.
        """
        if self.key is not None:
            self.forget()
        self.key = f"{self.model}/{uuid.uuid4().hex[:8]}"
        group = None
        try:
            ray.get(self.actor.join.remote(self.key, self.model, self.resident), timeout=self.timeout_s)
            group = build()
            reserved = reserve_host(group.ranks, self.timeout_s)
            node = group.placement[0]["node_ip"] if group.placement else ""
            ray.get(self.actor.ready.remote(self.key, group.ranks, node, reserved["bytes"]), timeout=60)
        except BaseException:
            if group is not None:
                group.shutdown()  # its memory free before the share counts it so
            self.forget()
            raise
        return group

    async def enter(self, deadline: float) -> tuple[str, dict]:
        """Returns once the model's group is awake (woken here if it slept), holding it awake
        until ``leave`` of the lease returned.

        Returns:
            The lease, and ``woke`` with, if it did, ``wake_s``.

        Raises:
            QueueTimeoutError: It was not awake by ``deadline`` (``time.time()``).
            WakeFailedError: Its group could not be woken (the caller fails the group: it is rebuilt).
        """
        lease = uuid.uuid4().hex
        call = self.actor.enter.remote(self.key, lease)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                return lease, await call
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
        """The request holding ``lease`` was answered (or gave up): the group may sleep once none does."""
        self.actor.leave.remote(self.key, lease)

    def state(self, timeout_s: float = 5.0) -> dict:
        """The model's entry of the share's states (``GpuShare.states``)."""
        return ray.get(self.actor.states.remote(), timeout=timeout_s).get(self.model, {"state": "joining"})

    def forget(self) -> None:
        """The model's group is shut down (the replica stops, or rebuilds it): it leaves the share."""
        if self.key is None:
            return
        try:
            ray.get(self.actor.forget.remote(self.key), timeout=10)
        except Exception:  # noqa: BLE001 - a share that is gone holds nothing of it
            pass
