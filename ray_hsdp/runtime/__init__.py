"""One rank's execution: the tick thread, the request threads, the waiting forward calls.

The contract of :class:`RankRuntime`, which the ``Rank`` actor merely wraps:

- **Lock step.** Every rank of a group issues the same collectives in the same order: before
  every forward of a sharded root module the ranks all-gather one integer each: a key (the
  cheapest waiting call's module and request ticket, or a queued request to start), a stop, or
  ``BUSY`` / ``IDLE``. The smallest module among the lanes whose ranks all offered the same key
  runs for real on those lanes' ranks and as a ghost pass (the same unshard / reshard sequence,
  no compute) on every other rank. A key of a lane of several ranks that some of its ranks
  offered and the lane did not agree on is offered first at the next tick by every rank that
  can (the same set on every rank, read from the gather): a rank in two lanes (adaptive lanes)
  thus never holds one lane back for as long as its other lane's request runs.
- **Lanes.** The ranks of a lane (several in combined mode or when replicated) run each request
  together; they start it, run each of its calls and stop it at the same tick, because they act
  only on a key all of them offered, so a context-parallel all-to-all inside a forward always
  finds the whole lane. Only the leader answers and decodes.
- **Exactly once.** Every forward call and every request completes exactly once, with a result
  or an error.
- **Fail fast.** An error inside a forward, a ghost pass or a tick (the all-gather included)
  leaves this rank's collectives out of step with the other ranks'. The session then fails at
  once: every request and call the rank holds completes with a :class:`SessionFailedError`, new
  ones are refused, and ``session`` raises it, which is how the group learns of it (the group
  then kills every rank: gloo does not abort, and NCCL peers would wait for their own timeout).
  An error of a request's own (bad input, a failed decode) fails that request only: it issued no
  collective.
- **Seams.** The all-gather (``exchange``), the modules (``modules``) and the observer are
  replaceable attributes; fault injection and profiling wrap them (``ray_hsdp.runtime.faults``)
  rather than adding branches to the tick.

Layer: below the pipeline, above ``variant`` (each forward runs inside its request's variant; the
lock-step protocol they share is ``ray_hsdp.protocol``, in the bottom layer): may import variant,
sharding, config and the shared modules."""

from ray_hsdp.runtime.core import BUSY, IDLE, Completion, ForwardCall, Job, RankRuntime, SessionFailedError

__all__ = ["BUSY", "IDLE", "Completion", "ForwardCall", "Job", "RankRuntime", "SessionFailedError"]
