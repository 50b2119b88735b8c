"""A group's sleep and wake: every rank parks its weights in host memory, or takes them back, at
the same time (``Rank.sleep``, ``Rank.wake``); the group's processes, communicators and compiled
graphs stay. What a caller learns is the slowest rank's figures, and each rank's."""

from __future__ import annotations

import time

import ray


def _summary(kind: str, reports: list[dict], started: float) -> dict:
    return {
        kind: True,
        "seconds": round(time.perf_counter() - started, 4),
        "bytes": max((r["bytes"] for r in reports), default=0),
        "ranks": reports,
    }


def sleep_ranks(ranks: list, timeout_s: float) -> dict:
    """Parks every rank's weights in host memory; returns the seconds it took (the slowest rank's
    with the calls), the most bytes a rank parked, and each rank's report.

    Raises:
        RuntimeError: A rank still holds a request (none is put to sleep mid-request).
    """
    started = time.perf_counter()
    return _summary("slept", ray.get([r.sleep.remote() for r in ranks], timeout=timeout_s), started)


def wake_ranks(ranks: list, timeout_s: float) -> dict:
    """Copies every rank's weights back to its device; returns as ``sleep_ranks``."""
    started = time.perf_counter()
    return _summary("woke", ray.get([r.wake.remote() for r in ranks], timeout=timeout_s), started)


def reserve_host(ranks: list, timeout_s: float) -> dict:
    """Allocates every rank's host buffers for a sleep (``Rank.reserve_host``); returns the most
    bytes a rank reserves and the slowest allocation."""
    reports = ray.get([r.reserve_host.remote() for r in ranks], timeout=timeout_s)
    return {
        "bytes": max((r["bytes"] for r in reports), default=0),
        "allocate_s": max((r["allocate_s"] for r in reports), default=0.0),
    }
