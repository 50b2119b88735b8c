"""A group that loses one rank replaces that rank alone (``mend_lost_rank``).

The other ranks keep their processes, their shards and their compiled graphs: they abort their
communicators (on NCCL; gloo fails on the dead peer's socket), wait until their session ends, and
join the new rank in a new rendezvous, where every rank forms its process groups again in the
order of the start (so each gets its predecessor's name, which the shards' meshes resolve). The
new rank loads its own slices. The requests the group ran fail as a lost group's do (the ingress
retries them); its queue waits and runs after. A mend that fails, or a second death during one,
fails the group, which its keeper rebuilds whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from ray_hsdp.group.errors import GroupFailedError
from ray_hsdp.group.scheduler import resolve
from ray_hsdp.phases import Phases

logger = logging.getLogger("ray_hsdp")


class GroupMend:
    """The mend of a ``ShardGroup`` (its scheduler calls ``_lost`` for a rank's death)."""

    def _init_mend(self) -> None:
        #: The rank being replaced, or None.
        self._mending: int | None = None
        #: Why this group cannot replace a lost rank alone (``Rank.mend_refusal``), or None.
        self.mend_refusal: str | None = "the group has not started"
        #: Each mend so far: the rank replaced and the seconds of its phases.
        self.mends: list[dict] = []
        #: The group's warm-up (``GroupWarmUp``), run again after a mend with ``compile``: the new
        #: rank loads its graphs from the compile cache there rather than in a user's request.
        self._rewarm: Callable[[], None] | None = None

    @property
    def mending(self) -> bool:
        """Whether a lost rank is being replaced now (requests wait in the queue meanwhile)."""
        return self._mending is not None

    def _lost(self, rank_index: int, reason: str, also=None) -> None:
        """Rank ``rank_index`` died (``reason``): replace it alone where the group can, or fail the
        group. ``also``: a request the caller took out of the running ones already."""
        with self._cond:
            again = self._mending == rank_index  # the same death, seen through another of its calls
            mend = self._mending is None and self.mend_refusal is None and not (self._failure or self._closed)
            sessions: list = []
            jobs = [also] if also is not None else []
            if mend:
                self._mending = rank_index
                # Its watch is answered; a later failure must not find it and blame this rank again.
                self._watchers = {ref: i for ref, i in self._watchers.items() if i != rank_index}
                jobs += [job for _, job in self._inflight.values()]
                sessions = list(self._sessions or {})
                self._inflight, self._loop_watches = {}, {}
                self._sessions, self._sessions_done = None, set()
        if not (mend or again):
            self._fail(reason, also=also)
            return
        error = GroupFailedError(f"{reason}; the group replaces it and serves again", ran=True)
        for job in {id(job): job for job in jobs}.values():
            job.helpers, job.wide = (), range(0)
            resolve(job.future, error=error)
        if mend:
            logger.warning("Shard group %s: %s; replacing rank %d alone", self.group_id, reason, rank_index)
            args = (rank_index, reason, sessions)
            threading.Thread(target=self._mend, args=args, name="ray_hsdp-mend", daemon=True).start()

    def _mend(self, lost: int, reason: str, sessions: list) -> None:
        phases = Phases(f"group {self.group_id} mend")
        started = time.perf_counter()
        try:
            self._replace(lost, sessions, phases)
        except BaseException as err:  # noqa: BLE001 - the group fails and is rebuilt whole
            with self._cond:
                self._mending = None
            logger.exception("Shard group %s could not replace rank %d", self.group_id, lost)
            self._fail(f"{reason}, and replacing it failed: {type(err).__name__}: {err}")
            return
        with self._cond:
            self._mending = None
            self._wake = True
            self._cond.notify_all()
        if self.config.compile and self._rewarm is not None:
            try:
                with phases.phase("warm-up"):
                    self._rewarm()
            except BaseException as err:  # noqa: BLE001 - it would fail a user's request the same way
                self._fail(f"{reason}; its replacement's warm-up failed: {type(err).__name__}: {err}")
                return
        phases.seconds["total"] = round(time.perf_counter() - started, 3)
        self.mends.append({"rank": lost, "phases_s": dict(phases.seconds)})
        logger.info("Shard group %s replaced rank %d in %.1f s", self.group_id, lost, phases.seconds["total"])

    def _replace(self, lost: int, sessions: list, phases: Phases) -> None:
        """The mend's steps: the survivors' sessions end, a new rank joins them, it loads."""
        config = self.config
        survivors = [(i, r) for i, r in enumerate(self.ranks) if i != lost]
        with phases.phase("sessions end"):
            ray.get([r.abort.remote() for _, r in survivors], timeout=config.rendezvous_timeout_s)
            ray.wait(sessions, num_returns=len(sessions), timeout=config.collective_timeout_s)
        with phases.phase("rank process and imports"):
            # Not under the lock: creating an actor waits on Ray's thread, which runs ``_watch``'s callbacks.
            rank = self._spawn_rank(lost, time.time())
            with self._cond:  # a shutdown meanwhile kills what ``ranks`` holds: the new rank too, or none
                gone = self._failure or self._closed
                if not gone:
                    self.ranks[lost] = rank
            if gone:
                ray.kill(rank, no_restart=True)
                raise GroupFailedError(self._failure or "the shard group was shut down during the mend")
            ray.get(rank.prepare.remote(), timeout=config.load_timeout_s)
        master, port = ray.get(self.ranks[0].address.remote(), timeout=config.rendezvous_timeout_s)
        with phases.phase("rendezvous"):
            joined = ray.get([r.join.remote(master, port) for r in self.ranks], timeout=config.rendezvous_timeout_s)
        with phases.phase("load"):
            ray.get(rank.load.remote(), timeout=config.load_timeout_s)
        self.placement[lost] = {**joined[lost], "actor_name": self._rank_name(lost), "bundle": lost}
        self._watch_rank(lost)
        with self._cond:
            if self._failure or self._closed:
                raise GroupFailedError(self._failure or "the shard group was shut down during the mend")
