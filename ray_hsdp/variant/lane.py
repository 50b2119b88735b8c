"""Whether a request's tokens split evenly over the ``ring x ulysses`` ranks of its lane."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_hsdp.request import GenerationRequest, InvalidRequestError


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
