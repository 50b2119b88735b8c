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
from ray_hsdp.serve.replica.awake_set import (
    FAILED,
    JOINING,
    PARKING,
    READY,
    SLEEPING,
    STARTING,
    WAKING,
    AwakeSet,
)

logger = logging.getLogger("ray_hsdp")

SHARE_NAMESPACE = "ray_hsdp"


#: Device memory left free beyond a group's weights for its wake to start beside the others' sleeps.
WAKE_HEADROOM_BYTES = 2 * 2**30


def share_actor_name(share: str) -> str:
    return f"ray_hsdp-gpu-share-{share}"


class WakeFailedError(RuntimeError):
    """A model's group could not be woken (or was lost while asleep): its replica rebuilds it."""


class GpuShare:
    """One GPU share's placement group and awake set (a detached Ray actor, async). Each group of
    a model on it has a key of its own (``join``): a rebuilt or replacing group never takes over the
    state of the one before, which counts until its replica forgets it.

    Args:
        share: The share's name (``gpu_share``).
        bundles: One bundle per GPU (the first model's group's bundles).
        budget_bytes: ``gpu_share_budget_gib`` in bytes; ``None``: one model awake at a time.
        call_timeout_s: Longest a group's sleep or wake may take; past it the group's ranks are
            killed (their memory goes with them) and its replica rebuilds it.
    """

    def __init__(self, share: str, bundles: list[dict], budget_bytes: int | None, call_timeout_s: float = 600.0):
        logging.basicConfig(level=logging.INFO)
        self.share = share
        self.terms = {"bundles": bundles, "budget_bytes": budget_bytes}
        self.call_timeout_s = call_timeout_s
        self.awake = AwakeSet(budget_bytes)
        self.placement = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        self.ranks: dict[str, list] = {}  # key -> its group's ranks
        self.nodes: dict[str, str] = {}
        self.parked: dict[str, int] = {}  # key -> bytes its ranks park (all of them together)
        self._left: collections.deque[str] = collections.deque(maxlen=4096)
        self._waiting: dict[str, float] = {}  # key -> since when it waits for room (others' work in flight)
        self._locks: dict[str, asyncio.Lock] = {}
        self._incoming = 0  # bytes per GPU that wakes started beside sleeps are bringing now
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

    def check_terms(self) -> dict:
        """The share's bundles and budget, as its first model set them (a model that says others
        is refused by ``open_share``, naming both)."""
        return self.terms

    async def placement_group(self, timeout_s: float):
        """The share's placement group, once placed."""
        await asyncio.wait_for(self.placement.ready(), timeout_s)
        return self.placement

    async def join(self, key: str, model: str, resident: bool) -> None:
        """Before group ``key`` of ``model`` loads: the other idle groups sleep until it fits (all
        but the resident ones while its size is unknown). Returns once it may load."""
        member = self.awake.join(key, model, resident)
        async with self._lock(key):
            await self._make_room(key)
            member.state = STARTING
        await self._notify()

    async def ready(self, key: str, ranks: list, node: str, nbytes: int) -> None:
        """Group ``key`` loaded: its ranks, its node and what it holds per GPU awake.

        Raises:
            ValueError: It can never be awake within the budget (``AwakeSet.too_large``).
        """
        member = self.awake.members[key]
        member.bytes, self.ranks[key], self.nodes[key] = nbytes, ranks, node
        why = self.awake.too_large(key)
        member.state = FAILED if why else READY
        await self._notify()
        if why:
            raise ValueError(why)

    async def enter(self, key: str, lease: str) -> dict:
        """A request of group ``key`` is about to run: returns once the group is awake, holding it
        awake until ``leave(lease)``; wakes it first if it sleeps.

        Returns:
            ``woke``: whether this call woke it, and ``wake_s`` its seconds.

        Raises:
            WakeFailedError: The group could not be woken, or is gone (its replica rebuilds it).
        """
        while True:
            if lease in self._left:
                self._left.remove(lease)
                return {"woke": False}
            member = self.awake.members.get(key)
            if member is None or member.state == FAILED:
                raise WakeFailedError(f"{key.split('/')[0]}'s shard group is not on its GPU share now (it is rebuilt)")
            if member.state == READY and not self._turn_taken(key):
                self.awake.enter(key, lease)
                return {"woke": False}
            if member.state == SLEEPING:
                woke = await self._wake(key, lease)
                if woke["woke"]:
                    return woke
                continue
            await self._wait_change()

    async def leave(self, key: str, lease: str) -> None:
        """The request ``lease`` was answered: its group may sleep once none holds it."""
        member = self.awake.members.get(key)
        if member is not None and lease in member.leases:
            member.leases.discard(lease)
            await self._notify()
        else:
            self._left.append(lease)  # its enter has not returned yet: it returns without holding

    async def forget(self, key: str) -> None:
        """Group ``key`` is shut down (its replica stops, or rebuilds it): its memory is free."""
        self.awake.members.pop(key, None)
        self.ranks.pop(key, None)
        self.nodes.pop(key, None)
        self.parked.pop(key, None)
        self._locks.pop(key, None)
        await self._notify()

    def states(self) -> dict[str, dict]:
        """Each model's newest group's state, bytes per GPU awake, bytes parked, wakes and their
        seconds, requests in flight."""
        out = {}
        for key, m in self.awake.members.items():  # joined in order: a model's newest group last
            out[m.model] = {
                "state": m.state,
                "bytes_per_gpu": m.bytes,
                "parked_bytes": self.parked.get(key, 0) if m.state == SLEEPING else 0,
                "node": self.nodes.get(key),
                "wakes": m.wakes,
                "wake_seconds": round(m.wake_seconds, 4),
                "in_flight": len(m.leases),
            }
        return out

    def _turn_taken(self, key: str) -> bool:
        """Whether a new request of awake group ``key`` waits, so that a group waiting for room gets
        its turn: else a model under steady load would hold the GPUs for as long as it is asked,
        and the other models' requests would wait until their deadlines. (A resident group never
        gives way: it never sleeps.)"""
        member = self.awake.members[key]
        return not member.resident and any(other != key for other in self._waiting)

    def rank_handles(self, model: str) -> list:
        """The rank actors of ``model``'s newest group (drills, tests)."""
        keys = [key for key, m in self.awake.members.items() if m.model == model and key in self.ranks]
        return list(self.ranks[keys[-1]]) if keys else []

    # ---- the sleeps and wakes --------------------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _make_room(self, key: str) -> None:
        """Puts the least recently used idle groups to sleep until group ``key`` fits; waits while
        it cannot (the others' work in flight)."""
        while key in self.awake.members:
            victims = self.awake.victims(key)
            if victims == []:
                return
            if victims is None:
                self._waiting[key] = self._waiting.get(key, time.monotonic())
                try:
                    await self._wait_change()
                finally:
                    self._waiting.pop(key, None)
                continue
            keys = [k for k, m in self.awake.members.items() if any(m is v for v in victims)]
            for victim in victims:
                victim.state = PARKING  # still holding its memory: counted, never picked again
            await asyncio.gather(*(self._sleep(k) for k in keys))
        raise WakeFailedError(f"{key.split('/')[0]}'s shard group left its GPU share while it waited for room")

    async def _ranks_call(self, key: str, method: str) -> list[dict]:
        calls = [getattr(rank, method).remote() for rank in self.ranks.get(key, [])]
        return await asyncio.wait_for(asyncio.gather(*calls), self.call_timeout_s)

    async def _sleep(self, key: str) -> None:
        member = self.awake.members.get(key)
        try:
            reports = await self._ranks_call(key, "sleep")
        except BaseException as err:  # noqa: BLE001 - its ranks go (their memory with them); its replica rebuilds it
            logger.warning("Putting %s to sleep failed: %s; its ranks are stopped", key, remote_cause(err))
            self._kill(key)
            if member is not None:
                member.state = FAILED
        else:
            if member is not None:
                if any(r.get("busy") for r in reports):
                    # A rank still held a request (it ends at its next step): it stays awake and is
                    # weighed again. (Ranks that parked wake at the group's next request.)
                    member.state = READY
                else:
                    self.parked[key] = sum(r["bytes"] for r in reports)
                    member.state = SLEEPING
                    logger.info("%s sleeps (%.2f GiB parked per GPU)", key, member.bytes / 2**30)
        await self._notify()

    async def _wake(self, key: str, lease: str) -> dict:
        """Wakes group ``key`` for request ``lease``, which holds it from the moment it is awake
        (before any other waiter could pick it to sleep again)."""
        member = self.awake.members[key]
        async with self._lock(key):
            if member.state != SLEEPING:
                return {"woke": False}
            started = time.perf_counter()
            waking = await self._wake_beside_sleeps(key, member)
            try:
                await self._make_room(key)
            except BaseException:
                self._left_waking(key, member, waking)
                raise
            member.state = WAKING
            try:
                await (waking or self._ranks_call(key, "wake"))
            except BaseException as err:
                self._kill(key)
                member.state = FAILED
                await self._notify()
                raise WakeFailedError(f"waking {member.model}'s shard group failed: {remote_cause(err)}") from None
            seconds = time.perf_counter() - started
            member.state = READY
            if lease in self._left:  # its caller gave up meanwhile: the group is awake, and free to sleep
                self._left.remove(lease)
            else:
                self.awake.enter(key, lease)
            member.wakes += 1
            member.wake_seconds += seconds
            logger.info("%s woke in %.3f s%s", key, seconds, " (beside the sleeps)" if waking else "")
        await self._notify()
        return {"woke": True, "wake_s": seconds}

    async def _wake_beside_sleeps(self, key: str, member) -> asyncio.Future | None:
        """Starts group ``key``'s wake at once, beside the sleeps that make room for it: a sleep
        copies to the host and a wake from it, the two directions of the link at once. Only where
        its GPUs have the memory for its weights now (less what other such wakes are bringing) and
        every other group awake is one that sleeps for it (idle: no request can need memory
        meanwhile). Returns the wake's task, or None (it waits for the sleeps)."""
        try:
            free = await asyncio.wait_for(
                asyncio.gather(*(rank.device_free.remote() for rank in self.ranks.get(key, []))), 10
            )
        except Exception:  # noqa: BLE001 - a rank that cannot say: wake after the sleeps (their error shows there)
            return None
        # From here to the task's start nothing awaits: the groups idle now are those decided on.
        victims = self.awake.victims(key)
        others = [m for m in self.awake.awake() if m is not member]
        room = min(free, default=0) - self._incoming
        if not victims or len(others) != len(victims) or room < member.bytes + WAKE_HEADROOM_BYTES:
            return None
        member.state = WAKING
        self._incoming += member.bytes
        task = asyncio.ensure_future(self._ranks_call(key, "wake"))
        task.add_done_callback(lambda _: self._landed(member.bytes))
        return task

    def _landed(self, nbytes: int) -> None:
        self._incoming -= nbytes

    def _left_waking(self, key: str, member, waking: asyncio.Future | None) -> None:
        """The wait for room ended in an error (the group left the share, or the call was
        cancelled): a group not yet waking sleeps on; one whose wake started beside the sleeps is
        what that wake makes it (awake, or failed and stopped)."""
        if waking is None:
            if member.state == WAKING:
                member.state = SLEEPING
            return

        def ended(task: asyncio.Future) -> None:
            if task.cancelled() or task.exception() is not None:
                self._kill(key)
                member.state = FAILED
            else:
                member.state = READY
            asyncio.ensure_future(self._notify())

        waking.add_done_callback(ended)

    def _kill(self, key: str) -> None:
        """Stops a group whose sleep or wake failed: its memory is free once its processes are."""
        for rank in self.ranks.get(key, []):
            try:
                ray.kill(rank, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass


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
    terms = ray.get(actor.check_terms.remote())
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
