"""A replica's shard group, rebuilt in place after it fails: one rebuild at a time."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from ray_hsdp.group import Engine, GroupFailedError

logger = logging.getLogger("ray_hsdp")


def _settled(group: Engine | None = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is None:
        future.set_result(group)
    else:
        future.set_exception(error)
    return future


class GroupKeeper:
    """Holds a replica's shard group and rebuilds it when it fails.

    Requests, Serve's health check and the router's stats may all notice a failure at once; one
    rebuild runs, and every caller waits for that one. A rebuild that fails leaves the keeper
    broken: the replica's health check then fails and Serve replaces the replica.

    Args:
        build: Creates and starts a group (in the replica's placement group).
    """

    def __init__(self, build: Callable[[], Engine]):
        self._build = build
        self._lock = threading.Lock()
        self.group = build()
        self._rebuild: Future | None = None
        self._closed = False
        self.broken: str | None = None
        self.rebuilds = 0
        self.failures = 0  # failures noticed (each started a rebuild)

    def current(self) -> Future:
        """A future of the group to use: done at once while the group is healthy; else the
        rebuild's (started here if none runs yet), or an error if the group cannot be rebuilt."""
        with self._lock:
            if self.broken:
                return _settled(error=GroupFailedError(self.broken))
            if self._rebuild is None:
                if not self.group.failure:
                    return _settled(self.group)
                logger.warning("Rebuilding the shard group after: %s", self.group.failure)
                self.failures += 1
                self._rebuild = Future()
                threading.Thread(
                    target=self._run_rebuild, args=(self.group, self._rebuild), name="ray_hsdp-rebuild", daemon=True
                ).start()
            return self._rebuild

    @property
    def ready(self) -> bool:
        """Whether the group can run requests now (not failed, not being rebuilt, not replacing a
        lost rank: requests sent meanwhile wait in its queue)."""
        with self._lock:
            return not self.broken and self._rebuild is None and not self.group.failure and not self.group.mending

    def _run_rebuild(self, failed: Engine, future: Future) -> None:
        try:
            failed.shutdown()
            group = self._build()
        except Exception as err:  # noqa: BLE001 - reported by the health check; Serve replaces the replica
            logger.exception("Rebuilding the shard group failed")
            with self._lock:
                self.broken = f"the shard group failed ({failed.failure}) and could not be rebuilt: {err}"
                self._rebuild = None
            error: BaseException | None = GroupFailedError(self.broken)
            group = None
        else:
            with self._lock:
                closed = self._closed
                self.group, self._rebuild = group, None
                self.rebuilds += 1
            error = None
            logger.info("Shard group rebuilt (rebuild %d)", self.rebuilds)
            if closed:  # the keeper was shut down while this rebuild ran: nothing may outlive it
                group.shutdown()
        try:
            future.set_exception(error) if error else future.set_result(group)
        except InvalidStateError:  # a waiter cancelled it; the others were answered by this one
            pass

    def shutdown(self) -> None:
        """Shuts the group down; a rebuild that runs shuts its new group down when it is built."""
        with self._lock:
            self._closed = True
            group = self.group
        group.shutdown()
