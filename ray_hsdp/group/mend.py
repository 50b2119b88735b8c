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

import ray

from ray_hsdp.group.errors import GroupFailedError
from ray_hsdp.group.failure import fail
from ray_hsdp.group.ranks import RankActors
from ray_hsdp.group.state import GroupState, QueuedJob, resolve
from ray_hsdp.phases import Phases

logger = logging.getLogger("ray_hsdp")


class Mend:
    """A group's replacement of a lost rank (the scheduler thread and the health check call
    ``lost`` for a rank's death).

    Args:
        state: The group's state: its running jobs fail, its queue waits, ``mends`` records each mend.
        actors: Spawns the new rank in the lost one's bundle and watches it.
    """

    def __init__(self, state: GroupState, actors: RankActors):
        self.state = state
        self.actors = actors

    def lost(self, rank_index: int, reason: str, also: QueuedJob | None = None) -> None:
        """Rank ``rank_index`` died (``reason``): replace it alone where the group can, or fail the
        group. ``also``: a request the caller took out of the running ones already."""
        state = self.state
        with state.cond:
            again = state.mending_rank == rank_index  # the same death, seen through another of its calls
            mend = state.mending_rank is None and state.mend_refusal is None and not (state.failure or state.closed)
            sessions: list = []
            jobs = [also] if also is not None else []
            if mend:
                state.mending_rank = rank_index
                # Its watch is answered; a later failure must not find it and blame this rank again.
                state.watchers = {ref: i for ref, i in state.watchers.items() if i != rank_index}
                jobs += [job for _, job in state.inflight.values()]
                sessions = list(state.sessions or {})
                state.inflight, state.loop_watches = {}, {}
                state.sessions, state.sessions_done = None, set()
        if not (mend or again):
            fail(state, reason, also=also)
            return
        error = GroupFailedError(f"{reason}; the group replaces it and serves again", ran=True)
        for job in {id(job): job for job in jobs}.values():
            job.helpers, job.wide = (), range(0)
            resolve(job.future, error=error)
        if mend:
            logger.warning("Shard group %s: %s; replacing rank %d alone", state.group_id, reason, rank_index)
            args = (rank_index, reason, sessions)
            threading.Thread(target=self._mend, args=args, name="ray_hsdp-mend", daemon=True).start()

    def _mend(self, lost: int, reason: str, sessions: list) -> None:
        state = self.state
        phases = Phases(f"group {state.group_id} mend")
        started = time.perf_counter()
        try:
            self._replace(lost, sessions, phases)
        except BaseException as err:  # noqa: BLE001 - the group fails and is rebuilt whole
            with state.cond:
                state.mending_rank = None
            logger.exception("Shard group %s could not replace rank %d", state.group_id, lost)
            fail(state, f"{reason}, and replacing it failed: {type(err).__name__}: {err}")
            return
        with state.cond:
            state.mending_rank = None
            state.wake = True
            state.cond.notify_all()
        if state.config.compile and state.rewarm is not None:
            try:
                with phases.phase("warm-up"):
                    state.rewarm()
            except BaseException as err:  # noqa: BLE001 - it would fail a user's request the same way
                fail(state, f"{reason}; its replacement's warm-up failed: {type(err).__name__}: {err}")
                return
        phases.seconds["total"] = round(time.perf_counter() - started, 3)
        state.mends.append({"rank": lost, "phases_s": dict(phases.seconds)})
        logger.info("Shard group %s replaced rank %d in %.1f s", state.group_id, lost, phases.seconds["total"])

    def _replace(self, lost: int, sessions: list, phases: Phases) -> None:
        """The mend's steps: the survivors' sessions end, a new rank joins them, it loads."""
        state, config = self.state, self.state.config
        survivors = [(i, r) for i, r in enumerate(state.ranks) if i != lost]
        with phases.phase("sessions end"):
            ray.get([r.abort.remote() for _, r in survivors], timeout=config.rendezvous_timeout_s)
            ray.wait(sessions, num_returns=len(sessions), timeout=config.collective_timeout_s)
        with phases.phase("rank process and imports"):
            # Not under the lock: creating an actor waits on Ray's thread, which runs ``watch``'s callbacks.
            rank = self.actors.spawn(lost, time.time())
            with state.cond:  # a shutdown meanwhile kills what ``ranks`` holds: the new rank too, or none
                gone = state.failure or state.closed
                if not gone:
                    state.ranks[lost] = rank
            if gone:
                ray.kill(rank, no_restart=True)
                raise GroupFailedError(state.failure or "the shard group was shut down during the mend")
            ray.get(rank.prepare.remote(), timeout=config.load_timeout_s)
        master, port = ray.get(state.ranks[0].address.remote(), timeout=config.rendezvous_timeout_s)
        with phases.phase("rendezvous"):
            joined = ray.get([r.join.remote(master, port) for r in state.ranks], timeout=config.rendezvous_timeout_s)
        with phases.phase("load"):
            ray.get(rank.load.remote(), timeout=config.load_timeout_s)
        state.placement[lost] = {**joined[lost], "actor_name": self.actors.name(lost), "bundle": lost}
        self.actors.watch(lost)
        with state.cond:
            if state.failure or state.closed:
                raise GroupFailedError(state.failure or "the shard group was shut down during the mend")
