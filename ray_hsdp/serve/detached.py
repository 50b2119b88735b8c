"""Work a replica does for a request that must outlive the request's cancel (a job's create and
start, a job left by its caller): run as tasks of the replica's own.

Why not ``asyncio.shield``: a shielded task is still the cancelled request's as far as Ray knows.
Serve cancels a call with ``ray.cancel``, whose ``recursive`` default also cancels the Ray calls
that call made, and a task made while the call runs carries the call's task id into every Ray
call it makes. A rank's cancel sent that way was seen dropped before it ran (the cancelled request
then ran all its steps), and a store's create, adopt or delete can be dropped the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

logger = logging.getLogger("ray_hsdp")


class Detached:
    """Starts coroutines from a task made with the replica (on its event loop, in its constructor),
    never from the request that asks for them; holds them until they end (the loop holds tasks
    weakly)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[Coroutine, asyncio.Future]] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._runner = asyncio.get_running_loop().create_task(self._run())

    def start(self, work: Coroutine) -> asyncio.Future:
        """Starts ``work`` on the replica's own.

        Returns:
            Its outcome. A caller that awaits it and is cancelled cancels the outcome only, never
            ``work``.
        """
        outcome = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((work, outcome))
        return outcome

    async def _run(self) -> None:
        while True:
            work, outcome = await self._queue.get()
            task = asyncio.get_running_loop().create_task(work)
            self._tasks.add(task)
            task.add_done_callback(lambda done, outcome=outcome: self._ended(done, outcome))

    def _ended(self, task: asyncio.Task, outcome: asyncio.Future) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if outcome.cancelled():
            if error is not None:  # nobody waits for it any more: said here, never lost
                logger.warning("Work whose caller went away failed: %s: %s", type(error).__name__, error)
        elif task.cancelled():
            outcome.cancel()
        elif error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(task.result())
