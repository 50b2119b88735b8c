"""A GPU share: the models of an endpoint that name the same ``gpu_share`` take turns on the same
GPUs. Its actor (one per share in the cluster, started by the first model replica that needs it,
outliving every application as the job store does) holds the share's placement group, one bundle per
GPU, in which each model's group places its ranks (one per GPU, each taking a sliver of its
bundle's GPU so that every model's rank fits); and it decides who is awake (``awake_set``): a request
of a sleeping model waits in ``enter`` while the least recently used idle models sleep and its own
group wakes. Sleeps and wakes go straight to the ranks (``Rank.sleep``, ``Rank.wake``): a group
sleeps only with no request in flight, which the leases of ``enter`` and ``leave`` guarantee.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import ray
from ray.util.placement_group import placement_group

from ray_hsdp.config.topology import PLACEMENT_STRATEGY
from ray_hsdp.group import remote_cause
from ray_hsdp.serve.awake_set import (
    FAILED,
    JOINING,
    PARKING,
    READY,
    SLEEPING,
    STARTING,
    WAKING,
    AwakeSet,
    Member,
)

logger = logging.getLogger("ray_hsdp")

SHARE_NAMESPACE = "ray_hsdp"


def share_actor_name(share: str) -> str:
    return f"ray_hsdp-gpu-share-{share}"


class WakeFailedError(RuntimeError):
    """A model's group could not be woken (or was lost while asleep): its replica rebuilds it."""


class GpuShare:
    """One GPU share's placement group and awake set (a detached Ray actor, async).

    Args:
        share: The share's name (``gpu_share``).
        bundles: One bundle per GPU (the first model's group's bundles).
        budget_bytes: ``gpu_share_budget_gib`` in bytes; ``None``: one model awake at a time.
    """

    def __init__(self, share: str, bundles: list[dict], budget_bytes: int | None):
        logging.basicConfig(level=logging.INFO)
        self.share = share
        self.terms = {"bundles": bundles, "budget_bytes": budget_bytes}
        self.awake = AwakeSet(budget_bytes)
        self.placement = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        self.ranks: dict[str, list] = {}
        self.nodes: dict[str, str] = {}
        self.parked: dict[str, int] = {}  # model -> bytes its ranks park (all of them together)
        self._left: collections.deque[str] = collections.deque(maxlen=4096)
        self._locks: dict[str, asyncio.Lock] = {}
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._condition():
            self._condition().notify_all()

    async def _wait_change(self, timeout_s: float = 1.0) -> None:
        async with self._condition():
            try:
                await asyncio.wait_for(self._condition().wait(), timeout_s)
            except TimeoutError:
                pass

    def check_terms(self, bundles: list[dict], budget_bytes: int | None) -> dict:
        """The share's bundles and budget, as its first model set them (a model that says others
        is refused by its replica, naming both)."""
        return self.terms

    async def placement_group(self, timeout_s: float):
        """The share's placement group, once placed."""
        await asyncio.wait_for(self.placement.ready(), timeout_s)
        return self.placement

    async def join(self, model: str, resident: bool) -> None:
        """Before ``model``'s group loads (its first start or a rebuild): the other idle models
        sleep until it fits (all of them while its size is unknown). Returns once it may load."""
        member = self.awake.join(model, resident)
        member.state = JOINING  # not awake yet: room is made first
        self.ranks.pop(model, None)
        async with self._lock(model):
            await self._make_room(member)
            member.state = STARTING
        await self._notify()

    async def ready(self, model: str, ranks: list, node: str, nbytes: int) -> None:
        """``model``'s group loaded: its ranks, its node and what it holds per GPU awake.

        Raises:
            ValueError: It can never be awake within the budget (``AwakeSet.too_large``).
        """
        member = self.awake.members[model]
        member.bytes, self.ranks[model], self.nodes[model] = nbytes, ranks, node
        why = self.awake.too_large(model)
        member.state = FAILED if why else READY
        await self._notify()
        if why:
            raise ValueError(why)

    async def enter(self, model: str, lease: str) -> dict:
        """A request of ``model`` is about to run: returns once the model is awake, holding it
        awake until ``leave(lease)``; wakes it first if it sleeps.

        Returns:
            ``woke``: whether this call woke it, and ``wake_s`` its seconds.

        Raises:
            WakeFailedError: The model's group could not be woken (its replica rebuilds it).
        """
        woke: dict = {"woke": False}
        while True:
            if lease in self._left:
                self._left.remove(lease)
                return woke
            member = self.awake.members.get(model)
            if member is None or member.state == FAILED:
                raise WakeFailedError(f"{model}'s shard group is not on its GPU share now (it is being rebuilt)")
            if member.state == READY:
                self.awake.enter(model, lease)
                return woke
            if member.state == SLEEPING:
                woke = await self._wake(member)
                continue
            await self._wait_change()

    async def leave(self, model: str, lease: str) -> None:
        """The request ``lease`` of ``model`` was answered: the model may sleep once it has none."""
        member = self.awake.members.get(model)
        if member is not None and lease in member.leases:
            member.leases.discard(lease)
            await self._notify()
        else:
            self._left.append(lease)  # its enter has not returned yet: it returns without holding

    async def forget(self, model: str) -> None:
        """``model``'s replica stops: it leaves the share (its memory is freed with its ranks)."""
        self.awake.members.pop(model, None)
        self.ranks.pop(model, None)
        await self._notify()

    def states(self) -> dict[str, dict]:
        """Each model's state, bytes per GPU awake, bytes parked, wakes and their seconds."""
        return {
            model: {
                "state": m.state,
                "bytes_per_gpu": m.bytes,
                "parked_bytes": self.parked.get(model, 0) if m.state == SLEEPING else 0,
                "node": self.nodes.get(model),
                "wakes": m.wakes,
                "wake_seconds": round(m.wake_seconds, 4),
                "in_flight": len(m.leases),
            }
            for model, m in self.awake.members.items()
        }

    def rank_handles(self, model: str) -> list:
        """The rank actors of ``model``'s group as it told them at ``ready`` (drills, tests)."""
        return list(self.ranks.get(model, []))

    # ---- the sleeps and wakes --------------------------------------------------------------

    def _lock(self, model: str) -> asyncio.Lock:
        return self._locks.setdefault(model, asyncio.Lock())

    async def _make_room(self, member: Member) -> None:
        """Puts the least recently used idle models to sleep until ``member`` fits; waits while
        it cannot (the others' work in flight)."""
        while True:
            victims = self.awake.victims(member.model)
            if victims == []:
                return
            if victims is None:
                await self._wait_change()
                continue
            for victim in victims:
                victim.state = PARKING  # still holding its memory: counted, never picked again
            await asyncio.gather(*(self._sleep(victim) for victim in victims))

    async def _sleep(self, member: Member) -> None:
        ranks = self.ranks.get(member.model, [])
        try:
            reports = await asyncio.gather(*(rank.sleep.remote() for rank in ranks))
        except Exception as err:  # noqa: BLE001 - its ranks' memory went with them; its replica rebuilds it
            logger.warning("Putting %s to sleep failed: %s", member.model, remote_cause(err))
            member.state = FAILED
        else:
            self.parked[member.model] = sum(r["bytes"] for r in reports)
            member.state = SLEEPING
            logger.info("%s sleeps (%.2f GiB parked per GPU)", member.model, member.bytes / 2**30)
        await self._notify()

    async def _wake(self, member: Member) -> dict:
        async with self._lock(member.model):
            if member.state != SLEEPING:
                return {"woke": False}
            started = time.perf_counter()
            await self._make_room(member)
            member.state = WAKING
            await self._notify()
            try:
                await asyncio.gather(*(rank.wake.remote() for rank in self.ranks.get(member.model, [])))
            except Exception as err:
                member.state = FAILED
                await self._notify()
                raise WakeFailedError(f"waking {member.model}'s shard group failed: {remote_cause(err)}") from None
            seconds = time.perf_counter() - started
            member.state = READY
            member.wakes += 1
            member.wake_seconds += seconds
            logger.info("%s woke in %.3f s", member.model, seconds)
            await self._notify()
            return {"woke": True, "wake_s": seconds}


def open_share(share: str, bundles: list[dict], budget_bytes: int | None):
    """The share's actor, started with these terms if none runs yet.

    Raises:
        ValueError: The share runs with other bundles or another budget (every model of a share
            has the same ``shard_size``, ``cpus_per_rank`` and ``gpu_share_budget_gib``).
    """
    actor = (
        ray.remote(GpuShare)
        .options(
            name=share_actor_name(share),
            namespace=SHARE_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=1000,
        )
        .remote(share, bundles, budget_bytes)
    )
    terms = ray.get(actor.check_terms.remote(bundles, budget_bytes))
    if terms != {"bundles": bundles, "budget_bytes": budget_bytes}:
        raise ValueError(
            f"gpu_share {share!r} runs with {len(terms['bundles'])} x {terms['bundles'][0]} and a budget of "
            f"{terms['budget_bytes']} bytes per GPU; this model asks {len(bundles)} x {bundles[0]} and {budget_bytes}: "
            "give every model of a share the same shard_size, cpus_per_rank and gpu_share_budget_gib"
        )
    return actor


def close_share(share: str) -> bool:
    """Removes the share's actor and its placement group (``ray-hsdp serve`` at its end; tests).
    Returns whether one ran."""
    try:
        actor = ray.get_actor(share_actor_name(share), namespace=SHARE_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


#: The states a model of a share may be in (``awake_set``).
SHARE_STATES = (JOINING, STARTING, READY, PARKING, SLEEPING, WAKING, FAILED)
