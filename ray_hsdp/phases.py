"""Where a start's time goes: seconds per named phase, in the order they ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("ray_hsdp")


class Phases:
    """Seconds per phase of one start (a group's, or one rank's part of it).

    Args:
        who: Names the starter in the log line each phase writes (``"group 3f2a"``, ``"rank 1"``).
    """

    def __init__(self, who: str):
        self.who = who
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the ``with`` block as phase ``name`` (a repeated name adds up) and logs it."""
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 3)
            logger.info("%s start phase %s: %.2f s", self.who, name, took)
