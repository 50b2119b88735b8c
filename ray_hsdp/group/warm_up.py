"""A group's warm-up: requests run on every lane before the group serves, so that what a first
request would pay once (``torch.compile``'s tracing and compiling of a shape, the first run of the
VAE at a size) is paid at the start. The warm-up is marked: no record, listener or lane time
counts it (``records``).

Shapes and ``torch.compile``: blocks compile with ``dynamic=None`` (torch's automatic dynamic
shapes). The first shape a block sees compiles a static graph; a later shape compiles a graph in
which the dimensions that changed are dynamic, and shapes that differ from the warmed ones only in
those never trace again (measured on the tiny Wan: warmed at 64x64x5 and 96x64x9, 128x64x13 traced
nothing, 128x96x17 compiled once more for its height). A block gets at most
``torch._dynamo.config.recompile_limit`` (8) graphs before it silently runs eagerly;
``recompile_limit_hits`` (``ray_hsdp.rank.reports``) counts how often that happened.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import ray

from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.group.intake import enqueue
from ray_hsdp.group.state import GroupState
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.variant.lane import sequence_tokens

#: The compile warm-up's height, in tokens of the pipeline's token grid (64 pixels at Wan's stride
#: of 16): small, as its time is part of the group's start.
WARM_UP_SIDE = 4


def warm_up_size(sequence: Mapping | None, degree: int) -> tuple[int, int]:
    """``(width, height)`` of a one-frame warm-up request whose tokens split over ``degree``
    sequence ranks, from the pipeline's token grid (``sequence``: ``ShardedPipeline.facts``):
    ``WARM_UP_SIDE`` tokens high and the least multiple of ``degree`` at least that wide.

    Raises:
        ValueError: Not even that splits (the message names the degree and the tokens).
    """
    if not sequence or degree == 1:
        return 64, 64
    stride = sequence["spatial_stride"]
    width, height = -(-WARM_UP_SIDE // degree) * degree * stride, WARM_UP_SIDE * stride
    tokens = sequence_tokens(sequence, height, width, 1)
    if tokens % degree:
        raise ValueError(
            f"compile: the warm-up of a lane of {degree} sequence ranks ({width}x{height}, one frame) is {tokens} "
            f"tokens, which do not split over {degree}; leave compile off or choose lanes that split it"
        )
    return width, height


def on_every_lane(
    dims: ParallelDims, requests_per_rank: int, make: Callable[[str, int, int | None], GenerationRequest]
) -> list[list[GenerationRequest]]:
    """Batches, run one after the other, that reach every lane: one request per lane; with adaptive
    lanes, for each lane size in turn, one per place of every lane of that size (a rank compiles
    graphs of its own per lane size, and a lane fills its places before the next lane of its size
    takes one). ``make(name, sequence_degree, lane_size)`` builds each request."""
    if not dims.adaptive:
        return [[make(str(lane), dims.ring * dims.ulysses, None) for lane in range(dims.num_lanes)]]
    return [
        [make(f"{size}-{i}", dims.lane_shape(size)[1], size) for i in range(len(dims.blocks(size)) * requests_per_rank)]
        for size in sorted(dims.lane_sizes)
    ]


def warm_up_requests(
    dims: ParallelDims, requests_per_rank: int, image_input: bool, steps: int = 1, sequence: Mapping | None = None
) -> list[list[GenerationRequest]]:
    """The compile warm-up of a group started without shapes to warm (``on_every_lane``): small
    requests of a size whose tokens split over each lane's sequence ranks (``warm_up_size`` of the
    pipeline's token grid ``sequence``). An image-to-video pipeline (``image_input``) takes no
    request without its first frame; each request runs ``steps`` steps, enough to reach every
    expert of a two-expert pipeline (the pipeline's ``warm_up_steps`` fact).

    Raises:
        ValueError: A lane's sequence ranks split no warm-up size (``warm_up_size``).
    """

    def warm(name: str, degree: int, lane_size: int | None) -> GenerationRequest:
        width, height = warm_up_size(sequence, degree)
        return GenerationRequest(
            prompt="warm up", num_inference_steps=steps, request_id=f"warm-up-{name}", width=width, height=height,
            num_frames=1, image=gray_png(width, height) if image_input else None, lane_size=lane_size,
            size_given=False,  # the group's pick: a pipeline whose size follows its image makes its own
        )  # fmt: skip

    return on_every_lane(dims, requests_per_rank, warm)


def copies_of(request: GenerationRequest) -> Callable[[str, int, int | None], GenerationRequest]:
    """What ``on_every_lane`` makes of ``request``: a copy under an id of its own, on its lane size."""
    return lambda name, degree, lane_size: dataclasses.replace(
        request, request_id=f"{request.request_id}-{name}", lane_size=lane_size
    )


def gray_png(width: int, height: int) -> bytes:
    """A plain gray PNG: the first frame of an image-to-video warm-up request."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


class WarmUp:
    """A group's warm-up runs. ``state.warm_up_record`` is the warm-up's own record: per request
    warmed, its shape, steps, seconds on its lanes, of them the decode's (the pipeline's time after
    its last step), the encoding that followed it, and whether a rank compiled graphs for it
    (``GenerationResult.compiled``).

    Args:
        state: The group's state, whose queue runs the warm-up and which keeps its record.
        shutdown: Ends the group when a warm-up fails: it would fail a user's request the same way.
    """

    def __init__(self, state: GroupState, shutdown: Callable[[], None]):
        self.state = state
        self.shutdown = shutdown

    def warm_up(
        self,
        requests: Sequence[GenerationRequest],
        follow: Callable[[GenerationRequest, GenerationResult], None] | None = None,
    ) -> None:
        """Runs each request on every lane (``ShardGroup.warm_up``), then ``follow`` with one of
        its results."""
        state = self.state

        def run() -> None:
            for request in requests:
                batches = on_every_lane(state.dims, state.config.requests_per_rank, copies_of(request))
                result = self._run_batches(batches)
                if follow is not None and request.decode:  # latents: nothing follows them
                    started = time.perf_counter()
                    follow(request, result)
                    state.warm_up_record[-1]["encode_s"] = round(time.perf_counter() - started, 3)

        self._in_warm_up_phase(run)

    def compile_warm_up(self) -> None:
        """Compiles each lane's first forwards with small requests (``warm_up_requests``)."""
        state, facts = self.state, self.state.pipeline_facts
        batches = warm_up_requests(
            state.dims, state.config.requests_per_rank, bool(facts.get("image_input")), facts["warm_up_steps"],
            facts.get("sequence"),
        )  # fmt: skip
        self._in_warm_up_phase(lambda: self._run_batches(batches))

    def _run_batches(self, batches: list[list[GenerationRequest]]) -> GenerationResult:
        """Runs each batch's requests at once, marked as the warm-up, each batch recorded
        (``warm_up_record``); the first result."""
        first = None
        for batch in batches:
            started = time.perf_counter()
            results = [future.result() for future in [enqueue(self.state, r, warm_up=True) for r in batch]]
            request, result = batch[0], results[0]
            self.state.warm_up_record.append({
                "shape": f"{request.width}x{request.height}x{request.num_frames}",
                "steps": request.num_inference_steps,
                "requests": len(batch),
                "s": round(time.perf_counter() - started, 3),
                "decode_s": round(result.after_loop_s, 3) if result.after_loop_s is not None else None,
                "compiled": any(r.compiled for r in results),
            })  # fmt: skip
            first = results[0] if first is None else first
        return first

    def _in_warm_up_phase(self, run: Callable[[], None]) -> None:
        state = self.state
        state.rewarm = run  # what a mend runs again for its new rank (``Mend``)
        state.warm_up_record = []
        try:
            with state.phases.phase("warm-up"):
                run()
            # Each rank's counts once warm: the metrics count from them (no warm-up tick is a user's).
            ranks = [rank.warm_up_done.remote() for rank in state.ranks]
            state.warm_up_stats = ray.get(ranks, timeout=state.config.request_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        state.phases.seconds["total"] = round(time.perf_counter() - state.started, 3)
