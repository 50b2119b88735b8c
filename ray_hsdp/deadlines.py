"""Every deadline of a request, in one place.

A request has two, and may ask for a target: the **queue deadline**, by which a rank must have
taken it (``queue_timeout_s`` from its arrival, kept through a rebuild's wait, the queue and a
takeover of a queued job; a 504 when missed), and the **run deadline**, from the moment a rank takes it
(``timeout_s``, or the group's ``request_timeout_s``; the request is interrupted at its next step
and answered with a 504). A request run again on another group (the ingress' retry after its group
was lost or failed under it, a released video job placed elsewhere) waits its turn anew. The
**target** (``deadline_s`` from arrival) stops nothing: a group serves earliest targets first
(one its measured times say can no longer make it waits behind those that can), and an adaptive
group's lane policy gives the request a lane that finishes by then (``group.lanes``).
"""

from __future__ import annotations

import dataclasses
import time

from ray_hsdp.request import GenerationRequest


def from_arrival(config) -> float:
    """The queue deadline (``time.time()``) of a request arriving now."""
    return time.time() + config.queue_timeout_s


def due(seconds: float | None) -> float | None:
    """The answer's target (``time.time()``) of a request arriving now that asks for an answer
    within ``seconds`` (``deadline_s``); ``None``: none. The group's serving order and lane policy
    aim for it; nothing is stopped at it."""
    return time.time() + seconds if seconds is not None else None


def queue_deadline(request: GenerationRequest, config) -> float:
    """When a rank must have taken ``request``: the deadline set at its arrival, or, for a request
    that never passed a server, ``queue_timeout_s`` from now."""
    return request.queue_deadline or from_arrival(config)


def waits_anew(request: GenerationRequest, config) -> GenerationRequest:
    """``request`` with a queue deadline from now: it ran once, and is run again elsewhere."""
    return dataclasses.replace(request, queue_deadline=from_arrival(config))


def run_timeout(request: GenerationRequest, config) -> float:
    """Seconds ``request`` may run once a rank took it."""
    return request.timeout_s or config.request_timeout_s
