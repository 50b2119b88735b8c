"""A pipeline's frames, from the device tensor it decoded to the array a request is answered with.

The pipelines are asked for ``output_type="pt"`` (the denormalized frames, still on the device),
and the conversion that diffusers' ``"np"`` output does on the host (a float32 copy of every
frame, a stack, then for ``uint8_frames`` a clip, a scale, a round and a cast, each a pass over
the whole video) runs on the device, so that one copy of the final dtype crosses to the host. At
1280x720 and 81 frames that is 224 MB of uint8 instead of 0.9 GB of float32 and five host passes
over it. The values are those of the ``"np"`` path: the same bf16 -> float32 cast, and the same
IEEE float32 clip, scale and round-half-to-even as numpy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HostFrames:
    """Frames on the host, shaped (outputs, frames, height, width, channels).

    Attributes:
        frames: float32 in [0, 1], or uint8 in [0, 255] when asked for.
        non_finite: How many values were NaN or infinite (then the frames stay float32: a uint8 cast
            would hide them).
    """

    frames: np.ndarray
    non_finite: int


def to_host(frames: torch.Tensor | np.ndarray | list, uint8: bool) -> HostFrames:
    """``frames`` as a pipeline returned them (a tensor of ``output_type="pt"``: (outputs, frames,
    channels, height, width) for video, (outputs, channels, height, width) for images; or an array
    or list of arrays shaped channels-last, from a pipeline that ignores ``output_type``), on the
    host, with one image per output as a video of one frame. Call it on the stream that made them."""
    if isinstance(frames, torch.Tensor):
        non_finite = int(frames.numel() - torch.isfinite(frames).sum())
        values = frames.movedim(-3, -1).float()  # channels last, as diffusers' pt_to_numpy
        if uint8 and not non_finite:
            values = values.clamp(0.0, 1.0).mul_(255.0).round_().to(torch.uint8)
        host = values.contiguous().cpu().numpy()  # one copy, in the order the host reads it
    else:
        host = np.asarray(frames, dtype=np.float32)
        non_finite = int(host.size - np.isfinite(host).sum())
        if uint8 and not non_finite:
            host = (np.clip(host, 0.0, 1.0) * 255).round().astype(np.uint8)
    if host.ndim == 4:  # images: (n, H, W, C) -> (n, 1, H, W, C)
        host = host[:, None]
    return HostFrames(host, non_finite)
