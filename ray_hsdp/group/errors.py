"""Why a group or a request of it failed: the errors a group raises, and how an error from a rank
reads in one line."""

from __future__ import annotations

import ray


def remote_cause(err: BaseException) -> BaseException:
    """The remote exception inside a Ray task error (else ``err`` itself)."""
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        return err.cause
    return err


def describe_error(err: BaseException) -> str:
    """One line for an error from a rank: the remote cause without Ray's traceback and colours."""
    err = remote_cause(err)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:400]


def died(rank_index: int, err: BaseException) -> str:
    """The failure reason of a group whose rank ``rank_index`` died."""
    return f"shard group failed: rank {rank_index} died: {describe_error(err)}"


class GroupFailedError(RuntimeError):
    """The group can no longer run requests (a rank died, missed its deadline, or the group shut down).

    Attributes:
        ran: Whether a rank had taken the request it fails (it failed running, not queued).
    """

    def __init__(self, message: str, ran: bool = True):
        super().__init__(message)
        self.ran = ran


class GroupOverloadedError(RuntimeError):
    """The group's queue is full; the request was not accepted."""


class GroupBusyError(RuntimeError):
    """The group holds requests, so it cannot sleep now."""


class QueueTimeoutError(TimeoutError):
    """No rank took the request within ``queue_timeout_s`` (HTTP 504)."""


class GroupUnplaceableError(RuntimeError):
    """No node of the Ray cluster can hold a group's bundles (a group never spans nodes)."""
