"""A request's lane: whether its tokens split evenly over the ``ring x ulysses`` ranks of a fixed
lane; in a group of adaptive lanes (``lane_sizes``), the sizes it may run on and the one it asks
for, and, around each of its forwards, the context-parallel state of the lane it was given (its
ticket names it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_hsdp.protocol import lane_of
from ray_hsdp.request import GenerationRequest, InvalidRequestError
from ray_hsdp.variant.base import Feature, RankFeatures


class UnsplittableRequestError(InvalidRequestError):
    """The request's tokens cannot be split evenly over its lane (HTTP 400)."""


def sequence_tokens(sequence: dict, height: int, width: int, frames: int) -> int:
    """Tokens of one request in a pipeline whose token grid is ``sequence`` (``ShardedPipeline.facts``)."""
    latent_frames = (frames - 1) // sequence["temporal_stride"] + 1
    spatial = sequence["spatial_stride"]
    return latent_frames // sequence["temporal_patch"] * (height // spatial) * (width // spatial)


def check_split(request: GenerationRequest, facts: Mapping[str, Any]) -> None:
    """Raises ``UnsplittableRequestError`` (with the token count, the degree and what to change)
    when the request's tokens do not split over its lane's sequence ranks."""
    sequence = facts.get("sequence")
    if not sequence:
        return
    tokens = sequence_tokens(sequence, request.height, request.width, request.num_frames)
    if tokens % sequence["degree"]:
        raise UnsplittableRequestError(
            f"{request.width}x{request.height} with {request.num_frames} frames is {tokens} tokens, which do not "
            f"split over ulysses_degree x ring_degree = {sequence['degree']} ranks; choose a size whose "
            f"width / {sequence['spatial_stride']} x height / {sequence['spatial_stride']} x latent frames is "
            f"a multiple of {sequence['degree']}"
        )


def runnable_sizes(request: GenerationRequest, config, facts: Mapping[str, Any]) -> tuple[int, ...]:
    """The lane sizes of an adaptive group that split ``request``'s tokens evenly over their Ulysses
    ranks (a lane without a Ulysses split always does); ``()`` for a group of fixed lanes.

    Raises:
        UnsplittableRequestError: They split over none of them (HTTP 400).
    """
    sequence = facts.get("sequence")
    if not config.lane_sizes:
        return ()
    dims = config.parallel_dims()
    tokens = sequence_tokens(sequence, request.height, request.width, request.num_frames) if sequence else 0
    # A lane splits the tokens over its Ulysses ranks (half its ranks with cfg_parallel).
    ulysses = {size: dims.lane_shape(size)[1] for size in dims.lane_sizes}
    sizes = tuple(size for size, u in ulysses.items() if u == 1 or (tokens and tokens % u == 0))
    if not sizes:  # it would wait for a lane forever
        raise UnsplittableRequestError(
            f"{request.width}x{request.height} with {request.num_frames} frames is {tokens} tokens, which split "
            f"evenly over none of this group's lanes (lane_sizes {list(dims.lane_sizes)}); choose another size"
        )
    return sizes


def work_of(request: GenerationRequest, facts: Mapping[str, Any]) -> int:
    """Tokens x denoising steps x outputs of ``request``; 0 when the token grid is unknown."""
    sequence = facts.get("sequence")
    if not sequence:
        return 0
    tokens = sequence_tokens(sequence, request.height, request.width, request.num_frames)
    return tokens * request.num_inference_steps * request.n


class LaneFeature(Feature):
    """``lane_size``: the lane a request asks for (adaptive groups; a fixed group refuses it: a
    pair of the table of refusals). Around every forward, whatever the request asked, the
    context-parallel state of the lane its ticket names."""

    field = "lane_size"

    def choose(self, request, config, facts):
        if request.lane_size is None:
            return None
        if request.lane_size not in config.lane_sizes:
            sizes = ", ".join(map(str, sorted(config.lane_sizes)))
            raise InvalidRequestError(f"lane_size={request.lane_size}: this group's lanes are of {sizes} ranks")
        if request.lane_size not in runnable_sizes(request, config, facts):
            raise UnsplittableRequestError(
                f"lane_size={request.lane_size}: {request.width}x{request.height} with {request.num_frames} frames "
                f"does not split over {request.lane_size} ranks; ask for another lane_size or size"
            )
        return request.lane_size

    def around_forward(self, choice, ticket, module, context, features: RankFeatures):
        if features.lane_parallel is not None and ticket >= 0:  # -1: a forward outside any request
            features.lane_parallel.activate(lane_of(ticket)[1])
        return super().around_forward(choice, ticket, module, context, features)
