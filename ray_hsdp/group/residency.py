"""A group's sleep and wake: every rank parks its weights in host memory, or takes them back, at
the same time (``Rank.sleep``, ``Rank.wake``); the group's processes, communicators and compiled
graphs stay. What a caller learns is the slowest rank's figures, and each rank's."""

from __future__ import annotations

import time

import ray


def _summary(kind: str, reports: list[dict], started: float) -> dict:
    busy = [r["rank"] for r in reports if r.get("busy")]
    return {
        kind: not busy,
        "busy_ranks": busy,
        "seconds": round(time.perf_counter() - started, 4),
        "bytes": max((r.get("bytes", 0) for r in reports), default=0),
        "ranks": reports,
    }


def sleep_ranks(ranks: list, timeout_s: float) -> dict:
    """Parks every rank's weights in host memory; returns the seconds it took (the slowest rank's
    with the calls), the most bytes a rank parked, and each rank's report; ``slept`` is False and
    ``busy_ranks`` names the ranks that still held a request (they parked nothing; the others did,
    and the next request wakes them)."""
    started = time.perf_counter()
    return _summary("slept", ray.get([r.sleep.remote() for r in ranks], timeout=timeout_s), started)


def wake_ranks(ranks: list, timeout_s: float) -> dict:
    """Copies every rank's weights back to its device; returns as ``sleep_ranks``."""
    started = time.perf_counter()
    return _summary("woke", ray.get([r.wake.remote() for r in ranks], timeout=timeout_s), started)


def reserve_host(ranks: list, timeout_s: float) -> dict:
    """Allocates every rank's host memory for a sleep (``Rank.reserve_host``) once the ranks of each
    node together fit in what it has available (they would all pass a check of their own at once);
    returns the most bytes a rank reserves and the slowest allocation.

    Raises:
        MemoryError: A node lacks the memory, with the bytes its ranks need and what it has.
        OSError: At ``sleep_level`` 2, a node's ``sleep_dir`` lacks the disk for its ranks' files.
    """
    needs = ray.get([r.host_need.remote() for r in ranks], timeout=timeout_s)
    for node in {need["node"] for need in needs}:
        mine = [need for need in needs if need["node"] == node]
        total, available = sum(need["bytes"] for need in mine), min(need["available"] for need in mine)
        if total > available:
            raise MemoryError(
                f"the group's {len(mine)} rank(s) on node {node} need {total / 2**30:.2f} GiB of host memory "
                f"({total} bytes) to hold their weights while the model sleeps; the node has {available / 2**30:.2f} "
                "GiB available: give it more memory, sleep_level: 2 (the weights rest on disk), or the model GPUs of "
                "its own (no gpu_share)"
            )
        check_spill_disk(node, mine)
    reports = ray.get([r.reserve_host.remote() for r in ranks], timeout=timeout_s)
    return {
        "bytes": max((r["bytes"] for r in reports), default=0),
        "allocate_s": max((r["allocate_s"] for r in reports), default=0.0),
    }


def check_spill_disk(node: str, needs: list[dict]) -> None:
    """Raises ``OSError`` where a level-2 sleep's files would not fit the node's ``sleep_dir``."""
    spilling = [need for need in needs if "disk_bytes" in need]
    if not spilling:
        return
    total, free = sum(need["disk_bytes"] for need in spilling), min(need["disk_free"] for need in spilling)
    if total > free:
        raise OSError(
            f"sleep_level 2: the group's {len(spilling)} rank(s) on node {node} need {total / 2**30:.2f} GiB ({total} "
            f"bytes) of disk in {spilling[0]['folder']} for their weights while the model sleeps; it has "
            f"{free / 2**30:.2f} GiB free: set sleep_dir to a larger disk"
        )
