"""The request threads of a rank runtime (``RankRuntime``): each runs one request's pipeline call,
reports its steps, and ends it exactly once."""

from __future__ import annotations

import threading

from ray_hsdp.protocol import Job, SessionFailedError
from ray_hsdp.request import LaneCollectiveError
from ray_hsdp.runtime.state import RankState


class RequestThreads:
    """The request threads of a rank runtime.

    Args:
        state: The rank's runtime state: the threads run ``state.run_request`` and keep
            ``state.running``, ``state.expecting`` and ``state.progress``.
    """

    def __init__(self, state: RankState) -> None:
        self.state = state

    def start(self, job: Job) -> None:
        """Starts ``job``'s request thread (called with the lock held)."""
        state = self.state
        if state.modules is not None:
            # Before the thread starts: the next tick must already wait for its first call.
            state.expecting += 1
        thread = threading.Thread(
            target=self._run_job, args=(job,), name=f"rank{state.rank}-request-{state.threads_started}", daemon=True
        )
        state.running[job] = thread
        state.threads_started += 1
        thread.start()

    def _await_decode_turn(self, job: Job) -> None:
        """Waits until no request of a lane of several ranks that this rank started before ``job``
        (a smaller ticket) still runs: every rank enters the split decodes it shares with others in
        the order of their tickets, so no two of them wait on each other. A request of a lane of one
        rank (adaptive lanes) decodes alone and is not waited for: the lane's other ranks, which
        do not run it, would otherwise wait in the decode's collectives until it ends.

        Raises:
            SessionFailedError: The session failed meanwhile.
        """
        state = self.state
        with state.cond:
            while state.failure is None and any(
                other.ticket < job.ticket and other.lane_size > 1 for other in state.running
            ):
                state.cond.wait()
            if state.failure is not None:
                raise SessionFailedError(str(state.failure))

    def _run_job(self, job: Job) -> None:
        state = self.state
        request_id = job.request.request_id
        expecting = [state.modules is not None]
        state.local.job = job
        lane = job.lane_size > 1
        follower_done = [False]
        decodes_together = False

        def stop_expecting() -> None:
            state.note_loop_end(request_id)  # (its group may wait for it: a widened request's helpers)
            if expecting[0]:
                expecting[0] = False
                with state.cond:
                    state.expecting -= 1
                    state.cond.notify_all()

        def on_step(done: int, total: int) -> bool:
            state.progress[request_id] = (done, total)
            state.observer.request(request_id, "step")
            # A lane acts on its stops, decided at a tick; a lone rank on its own cancellation.
            halt = job.stopped if lane else job.cancelled
            if done >= total and not job.leads(state.rank):
                follower_done[0] = True  # the leader answers; this rank is done once it decoded its part
                halt = not decodes_together
            if done >= total or halt:
                stop_expecting()  # decoding (or interrupted) from here: no more sharded forwards
            if done >= total and decodes_together:
                # Past the last step the lane decodes whatever stop comes: its ranks may read a
                # stop at different moments, and a decode all of them must join cannot be skipped
                # by some of them.
                self._await_decode_turn(job)
                return False
            return halt

        state.progress[request_id] = (0, job.request.num_inference_steps)
        state.observer.request(request_id, "start")
        try:
            decodes_together = lane and state.lane_decodes is not None and state.lane_decodes(job.request)
            job.complete(state.run_request(job.request, on_step))
        except LaneCollectiveError as err:
            # Its lane's other ranks may wait in the decode's collectives for this one: the
            # session fails (the tick thread raises it), and with it every request held here.
            state.fail(SessionFailedError(f"rank {state.rank}: {err}"[:400]))
        except BaseException as err:  # noqa: BLE001 - the request's own error belongs to its caller
            if follower_done[0]:
                job.complete(None)
            else:
                job.complete(error=err)
                if lane and not job.stopped:
                    # The other ranks of the lane may wait on a call this one will never make.
                    state.ask_stop(job.ticket)
        finally:
            state.local.job = None
            stop_expecting()
            state.progress.pop(request_id, None)
            state.observer.request(request_id, "end")
            with state.cond:
                state.running.pop(job, None)
                state.cond.notify_all()
